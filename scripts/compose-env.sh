#!/usr/bin/env bash
# Once per deployment, on every host: the secrets directory the compose files read.
#   secrets/redis_password   a generated Redis password (kept if present; copy this file to
#                            the other hosts of the deployment), in a directory only its
#                            owner may enter
#   secrets/tls/             TLS material for rediss:// (scripts/redis-tls-certs.sh fills it)
#   model-store/             where a target other than SmolLM2 goes (mounted read-only)
# AUGURY_SECRETS_DIR and AUGURY_MODEL_STORE move them, as in the compose files.
set -euo pipefail
cd "$(dirname "$0")/.."
secrets=${AUGURY_SECRETS_DIR:-./secrets}
umask 077
mkdir -p "$secrets/tls" "${AUGURY_MODEL_STORE:-./model-store}"
chmod 700 "$secrets"
if [ -s "$secrets/redis_password" ]; then
  echo "compose-env: $secrets/redis_password exists; left as it is"
else
  python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "$secrets/redis_password"
  echo "compose-env: wrote a generated Redis password to $secrets/redis_password"
fi
# Compose mounts a file secret as it is (owner and mode included) and the services run as uid
# 10001 in their containers: the file must be readable there; the directory (700) keeps other
# users of this host out.
chmod 644 "$secrets/redis_password"
