#!/usr/bin/env bash
# Augury over three "hosts" on one Linux machine: network namespaces joined by a bridge, each with
# its own address, no service reachable over another's loopback.
#
#   aug-a 10.39.0.1  Redis (password from a file) and cell 0: scheduler + verifier (the target)
#   aug-b 10.39.0.2  the drafter (draft-e)
#   aug-c 10.39.0.3  the gateway, on 10.39.0.3:8000
#   root  10.39.0.254 on the bridge: the client
#
# Sends greedy requests through the gateway, checks each answer equals plain greedy decoding of
# the target (the in-process engine, no draft) and that the drafter drafted over the wire (the
# gateway's speculation counters, the drafter's TCP connection to 10.39.0.1:6379), then takes
# everything down (trap: processes, namespaces, bridge). Needs root (ip netns) and redis-server.
#
#   sudo bash scripts/multihost-netns.sh
#
# Variables: PYTHON (default .venv/bin/python, else /work/main/.venv/bin/python), NETNS_DIR (logs,
# password, profile cache; default a temp dir, kept on failure), REQUESTS (4), MAX_TOKENS (16),
# THREADS (torch threads per model service, 2), READY_TIMEOUT_S (600).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

PYTHON=${PYTHON:-}
if [[ -z $PYTHON ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=/work/main/.venv/bin/python; fi
fi
PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"  # absolute, the venv's link kept
REQUESTS=${REQUESTS:-4}
MAX_TOKENS=${MAX_TOKENS:-16}
THREADS=${THREADS:-2}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-600}
NETNS_DIR=${NETNS_DIR:-$(mktemp -d /tmp/augury-netns.XXXXXX)}
mkdir -p "$NETNS_DIR"
BRIDGE=aug-br39
SUBNET=10.39.0
A=aug-a B=aug-b C=aug-c
PIDS=()
OK=0

say() { echo "[netns $(date -u +%T)] $*"; }

teardown() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  for ns in $A $B $C; do ip netns del "$ns" 2>/dev/null || true; done
  ip link del "$BRIDGE" 2>/dev/null || true
  if [[ $OK == 1 ]]; then
    say "taken down (logs in $NETNS_DIR)"
  else
    say "FAILED; logs in $NETNS_DIR:"
    for log in "$NETNS_DIR"/*.log; do [[ -f $log ]] && { echo "== $log"; tail -n 25 "$log"; }; done
  fi
}
trap teardown EXIT
trap 'exit 130' INT TERM

[[ $(id -u) == 0 ]] || { echo "needs root (ip netns)"; exit 2; }
command -v redis-server >/dev/null || { echo "needs redis-server on PATH"; exit 2; }

# ---- the network: a bridge in the root namespace, a veth pair per "host" ------------------------
say "network: bridge $BRIDGE $SUBNET.254/24; $A $SUBNET.1, $B $SUBNET.2, $C $SUBNET.3"
ip link add "$BRIDGE" type bridge
ip addr add "$SUBNET.254/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
i=0
for ns in $A $B $C; do
  i=$((i + 1))
  ip netns add "$ns"
  ip link add "v-$ns" type veth peer name eth0 netns "$ns"
  ip link set "v-$ns" master "$BRIDGE" up
  ip -n "$ns" addr add "$SUBNET.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done

# ---- host A: Redis ------------------------------------------------------------------------------
head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$NETNS_DIR/redis_password"
chmod 600 "$NETNS_DIR/redis_password"
{ echo "requirepass $(cat "$NETNS_DIR/redis_password")"; } >"$NETNS_DIR/redis.conf"
chmod 600 "$NETNS_DIR/redis.conf"
ip netns exec $A redis-server "$NETNS_DIR/redis.conf" --bind "$SUBNET.1" --port 6379 \
  --save "" --appendonly no --dir "$NETNS_DIR" >"$NETNS_DIR/redis.log" 2>&1 &
PIDS+=($!)
REDIS_URL="redis://$SUBNET.1:6379/0"
for _ in $(seq 1 50); do  # host B reaches Redis on host A, with the password (not on a command line)
  pong=$(ip netns exec $B env REDISCLI_AUTH="$(cat "$NETNS_DIR/redis_password")" \
    redis-cli -h "$SUBNET.1" -p 6379 ping 2>/dev/null || true)
  [[ $pong == PONG ]] && break
  sleep 0.2
done
[[ $pong == PONG ]] || { say "$B cannot reach Redis at $SUBNET.1:6379"; exit 1; }
say "$B reaches Redis at $SUBNET.1:6379; its own loopback has none: $(ip netns exec $B \
  redis-cli -h 127.0.0.1 -p 6379 ping 2>&1 | head -n 1)"

service() {  # service NAMESPACE LOG ARGS...: a service of cell 0 in that namespace
  local ns=$1 log=$2
  shift 2
  ip netns exec "$ns" env PYTHONPATH="$ROOT" AUGURY_REDIS__URL="$REDIS_URL" \
    REDIS_PASSWORD_FILE="$NETNS_DIR/redis_password" AUGURY_SERVICE__CELL=0 \
    AUGURY_SERVICE__REPLICA="$ns" AUGURY_ENGINE__PROFILE_CACHE_DIR="$NETNS_DIR/profiles" \
    AUGURY_ENGINE__KV_MEMORY_BYTES=$((256 << 20)) AUGURY_GATEWAY__HOST="$SUBNET.3" \
    AUGURY_GATEWAY__PORT=8000 "$PYTHON" -m services "$@" >"$NETNS_DIR/$log.log" 2>&1 &
  PIDS+=($!)
}

# ---- the services -------------------------------------------------------------------------------
say "host A: verifier and scheduler; host B: drafter draft-e; host C: gateway"
service $A verifier verifier --threads "$THREADS"
service $A scheduler scheduler --threads 1
service $B drafter drafter --name draft-e --threads "$THREADS"
service $C gateway gateway --threads 1

say "waiting for the gateway's readiness (one generation through every host)"
deadline=$((SECONDS + READY_TIMEOUT_S))
until curl -fsS -m 30 "http://$SUBNET.3:8000/health/ready" >/dev/null 2>&1; do
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || { say "a service exited"; exit 1; }; done
  ((SECONDS < deadline)) || { say "not ready in ${READY_TIMEOUT_S}s"; exit 1; }
  sleep 2
done
say "ready after ${SECONDS}s"

# ---- requests through the gateway, against plain greedy -----------------------------------------
PYTHONPATH="$ROOT" GATEWAY="http://$SUBNET.3:8000" REQUESTS="$REQUESTS" MAX_TOKENS="$MAX_TOKENS" \
  "$PYTHON" - <<'EOF'
import json
import os
import urllib.request

from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.model_set import target_dir
from shared.model.runner import ModelRunner
from tools.prompts import chat_ids
from shared.settings import GatewaySettings
from shared.values.sampling import SamplingParams
from transformers import AutoTokenizer

gateway, n, max_tokens = os.environ["GATEWAY"], int(os.environ["REQUESTS"]), int(os.environ["MAX_TOKENS"])
texts = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers.", "Explain what a network namespace is."]
tokenizer = AutoTokenizer.from_pretrained(target_dir())
prompts = [chat_ids(tokenizer, texts[i % len(texts)]) for i in range(n)]
runner = ModelRunner(load_model(target_dir()), kv_memory_bytes=64 << 20)
engine = SpecEngine(Verifier(runner), eos_token_ids=runner.cfg.eos_token_ids)
params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * n
expected = [tokenizer.decode(r.output, skip_special_tokens=True)
            for r in engine.generate(prompts, params)]

def post(prompt):
    body = {"model": GatewaySettings().model_name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"{gateway}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["text"]

same = 0
for prompt, want in zip(prompts, expected):
    got = post(prompt)
    print(f"  {got!r}" + ("" if got == want else f"  != plain greedy {want!r}"))
    same += got == want
with urllib.request.urlopen(f"{gateway}/metrics", timeout=30) as response:
    metrics = response.read().decode()
drafted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("augury_spec_decode_num_draft_tokens_total"))
accepted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("augury_spec_decode_num_accepted_tokens_total"))
print(f"equal to plain greedy: {same}/{n}; draft tokens verified {drafted:.0f}, accepted {accepted:.0f}")
assert same == n, "an answer differs from plain greedy"
assert drafted > 0, "nothing was drafted: the drafter on host B did not take part"
EOF

# ---- who talks to whom --------------------------------------------------------------------------
for ns in $B $C; do
  conns=$(ip netns exec "$ns" ss -Htn state established dst "$SUBNET.1" dport = :6379 | wc -l)
  say "$ns: $conns TCP connections to Redis at $SUBNET.1:6379"
  ((conns > 0)) || { say "$ns has no connection to Redis"; exit 1; }
done
say "$B listens on $(ip netns exec $B ss -Htln | wc -l) TCP sockets (a drafter only connects out)"
OK=1
say "OK: three namespaces, answers equal to plain greedy, drafts from host B"
