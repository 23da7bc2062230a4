#!/usr/bin/env bash
# Check that a stock sglang-router drives skymesh-replica (not part of the test suite).
#
# Creates its own venv outside the repo with sglang-router, starts two emulated replicas
# and, for each policy (round_robin, power_of_two, cache_aware), a router in front of them;
# sends streaming and non-streaming chat requests through it, and checks from the
# replicas' /metrics that requests reached them. For power_of_two it also checks that the
# router reads our /get_load (its /get_loads shows a loaded replica's num_tokens).
# Exits non-zero on any failure. Everything listens on 127.0.0.1 only.
#
#   examples/sglang_router_check.sh            # uses .venv/bin/skymesh-replica
#   SGLR_VENV=/tmp/sglr SGLR_VERSION=0.3.2 examples/sglang_router_check.sh
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SGLR_VENV=${SGLR_VENV:-/tmp/sglr}
SGLR_VERSION=${SGLR_VERSION:-0.3.2}
REPLICA=${SKYMESH_REPLICA:-$REPO/.venv/bin/skymesh-replica}
[[ -x $REPLICA ]] || REPLICA=$(command -v skymesh-replica)
MODEL=meta-llama/Llama-3.1-8B-Instruct
WORK=$(mktemp -d /tmp/sglr-check.XXXXXX)
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; echo "logs in $WORK" >&2; exit 1; }
log() { echo "== $*"; }

if [[ ! -x $SGLR_VENV/bin/python ]] || ! "$SGLR_VENV/bin/python" -c "import sglang_router" 2>/dev/null; then
  log "creating $SGLR_VENV with sglang-router==$SGLR_VERSION"
  python3 -m venv "$SGLR_VENV"
  "$SGLR_VENV/bin/pip" install -q "sglang-router==$SGLR_VERSION"
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_for CMD...: retry a command for up to 30 s.
wait_for() {
  for _ in $(seq 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

start_replica() {  # $1: name, $2: variable to receive the base URL
  # debug: access lines, to list what the router called.
  "$REPLICA" --port 0 --time-scale 0.2 --seed "$RANDOM" --log-level debug >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  local url=""
  for _ in $(seq 300); do
    url=$(grep -o 'listening on http://[0-9.:]*' "$WORK/$1.log" | awk '{print $3}' || true)
    [[ -n $url ]] && break
    sleep 0.1
  done
  [[ -n $url ]] || fail "replica $1 did not start"
  wait_for curl -sf "$url/health" || fail "replica $1 not healthy"
  printf -v "$2" '%s' "$url"
}

prompt_tokens() {  # $1: replica URL -> vllm:prompt_tokens_total
  curl -sf "$1/metrics" | awk '/^vllm:prompt_tokens_total/ {print int($2)}'
}

chat_json() {  # $1: router URL, $2: text; checks a complete non-streaming answer
  curl -sf -m 60 "$1/v1/chat/completions" -H 'Content-Type: application/json' -d "{
      \"model\": \"$MODEL\", \"max_tokens\": 8, \"ignore_eos\": true,
      \"messages\": [{\"role\": \"user\", \"content\": \"$2\"}]}" |
    python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["usage"]["completion_tokens"] == 8, d'
}

chat_stream() {  # $1: router URL, $2: text; checks deltas, usage and [DONE]
  curl -sfN -m 60 "$1/v1/chat/completions" -H 'Content-Type: application/json' -d "{
      \"model\": \"$MODEL\", \"max_tokens\": 6, \"ignore_eos\": true, \"stream\": true,
      \"stream_options\": {\"include_usage\": true},
      \"messages\": [{\"role\": \"user\", \"content\": \"$2\"}]}" |
    python3 -c '
import json, sys
events = [l[6:].strip() for l in sys.stdin if l.startswith("data: ")]
assert events[-1] == "[DONE]", events[-1:]
chunks = [json.loads(e) for e in events[:-1]]
deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
assert sum(1 for d in deltas if d) == 6, deltas
assert chunks[-1]["usage"]["completion_tokens"] == 6, chunks[-1]'
}

start_replica replica-a A
start_replica replica-b B
log "replicas: $A $B"

for policy in round_robin power_of_two cache_aware; do
  port=$(free_port)
  R=http://127.0.0.1:$port
  log "router --policy $policy on $R"
  "$SGLR_VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$port" \
    --worker-urls "$A" "$B" --policy "$policy" --log-level info >"$WORK/router-$policy.log" 2>&1 &
  rpid=$!
  PIDS+=($rpid)
  # Ready once it routes: workers are registered asynchronously after the port opens.
  wait_for chat_json "$R" "warm up" || fail "router ($policy) never served a request"
  a0=$(prompt_tokens "$A"); b0=$(prompt_tokens "$B")
  for i in 1 2 3 4; do chat_json "$R" "non-streaming request $i via $policy"; done
  for i in 1 2; do chat_stream "$R" "streaming request $i via $policy"; done
  a1=$(prompt_tokens "$A"); b1=$(prompt_tokens "$B")
  echo "   prompt tokens received: A +$((a1 - a0)), B +$((b1 - b0))"
  (( a1 + b1 > a0 + b0 )) || fail "no prompt tokens reached the replicas ($policy)"
  if [[ $policy == round_robin ]]; then
    (( a1 > a0 && b1 > b0 )) || fail "round_robin did not use both replicas"
  fi
  if [[ $policy == power_of_two ]]; then
    # Load A with a long request sent directly, then ask the router what it sees.
    curl -s -m 120 "$A/v1/chat/completions" -H 'Content-Type: application/json' -d "{
        \"model\": \"$MODEL\", \"max_tokens\": 2000, \"ignore_eos\": true,
        \"messages\": [{\"role\": \"user\", \"content\": \"keep busy\"}]}" >/dev/null &
    busy=$!
    loads_ok() {
      curl -sf "$R/get_loads" | python3 -c '
import json, sys
a = sys.argv[1]
loads = {w["worker"]: w["load"] for w in json.load(sys.stdin)["workers"]}
assert loads.get(a, 0) > 0, loads' "$A"
    }
    wait_for loads_ok || fail "router /get_loads did not show replica A's num_tokens"
    echo "   router /get_loads: $(curl -sf "$R/get_loads")"
    kill "$busy" 2>/dev/null || true
    wait "$busy" 2>/dev/null || true
  fi
  kill "$rpid"
  wait "$rpid" 2>/dev/null || true
done

log "endpoints the routers called on replica A:"
grep -o '"[A-Z]* /[^ ]* HTTP' "$WORK/replica-a.log" | sort | uniq -c | sort -rn || true
a=$(prompt_tokens "$A"); b=$(prompt_tokens "$B")
(( a > 0 && b > 0 )) || fail "a replica received nothing (A=$a B=$b)"
log "OK: both replicas served requests through sglang-router $SGLR_VERSION (A=$a, B=$b prompt tokens)"
