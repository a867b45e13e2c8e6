#!/usr/bin/env bash
# A private CA and a certificate for the Redis host, for compose.redis-tls.yaml:
#   bash scripts/redis-tls-certs.sh redis.example.internal 10.0.0.5
# writes secrets/tls/{ca.crt,ca.key,redis.crt,redis.key} (names and addresses the clients use
# go into the certificate, with localhost for the healthcheck). Copy secrets/tls/ca.crt to
# every other host (secrets/tls/ca.crt there); the keys stay on the Redis host.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 HOST_NAME_OR_IP..." >&2; exit 2; }
dir=${AUGURY_SECRETS_DIR:-./secrets}/tls
umask 077
mkdir -p "$dir"
san="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san="$san,IP:$name"; else san="$san,DNS:$name"; fi
done
openssl req -x509 -newkey rsa:3072 -nodes -days 825 -subj "/CN=augury-redis-ca" \
  -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
openssl req -newkey rsa:3072 -nodes -subj "/CN=$1" \
  -keyout "$dir/redis.key" -out "$dir/redis.csr" 2>/dev/null
openssl x509 -req -in "$dir/redis.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -CAcreateserial -days 825 -out "$dir/redis.crt" \
  -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$san") 2>/dev/null
rm -f "$dir/redis.csr" "$dir/ca.srl"
chmod 644 "$dir/ca.crt" "$dir/redis.crt"
echo "redis-tls-certs: $dir/ca.crt and $dir/redis.{crt,key} for $san"
