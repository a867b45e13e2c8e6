#!/usr/bin/env bash
# Once per deployment, on every host: the secrets directory the compose files read.
#   secrets/redis_password   a generated Redis password (kept if present; copy this file to
#                            the other hosts of the deployment), readable by its owner only
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
  exit 0
fi
python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "$secrets/redis_password"
echo "compose-env: wrote a generated Redis password to $secrets/redis_password"
