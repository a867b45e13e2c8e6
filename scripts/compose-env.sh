#!/usr/bin/env bash
# Once per deployment: write .env beside compose.yaml with a generated Redis password (kept if
# .env already has one). docker compose reads .env; the file is readable by its owner only.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .env ] && grep -q '^AUGURY_REDIS_PASSWORD=' .env; then
  echo "compose-env: .env already has AUGURY_REDIS_PASSWORD; left as it is"
  exit 0
fi
umask 077
password=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
echo "AUGURY_REDIS_PASSWORD=$password" >> .env
echo "compose-env: wrote a generated AUGURY_REDIS_PASSWORD to .env"
