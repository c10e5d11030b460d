#!/usr/bin/env bash
# make demo: the whole job on one machine, real broker and Redis on loopback.
#
# Secure by default (SECURE=0: plaintext): the broker takes SASL/SCRAM over TLS
# with ACLs, Redis ACL users, and every process below runs as its role's own
# user with its own password file (SECURITY.md, "Roles"); the stack's admin
# users only set the stack up. What a user copies first should be the secured
# deployment.
#
# Settings, from the environment (the defaults are `make demo`'s):
#   SECURE=1                 0: the plaintext stack (state in .stack)
#   DEMO_STATE_DIR           the stack's state, logs and keys (.stack/secure, or .stack)
#   DEMO_DATA                simulated data (data/transactions.parquet; simulated if missing)
#   DEMO_REGISTRY            the model registry (models/registry; trained if nothing serves)
#   DEMO_BROKER_PORT=19092   DEMO_REDIS_PORT=16379
#   DEMO_WEB_PORT=6066       the scoring worker's web port
#   DEMO_FEEDBACK_WEB_PORT   the feedback worker's (DEMO_WEB_PORT + 1)
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-100}
DURATION=${2:-20}
BIN=${DEMO_BIN:-.venv/bin}
SECURE=${SECURE:-1}
if [[ $SECURE == 1 ]]; then
  STATE=${DEMO_STATE_DIR:-.stack/secure}
  STACK_FLAGS=(--secure --state-dir "$STATE")
else
  STATE=${DEMO_STATE_DIR:-.stack}
  STACK_FLAGS=(--state-dir "$STATE")
fi
DATA=${DEMO_DATA:-data/transactions.parquet}
export FRAUD_REGISTRY_DIR=${DEMO_REGISTRY:-models/registry}
BROKER_PORT=${DEMO_BROKER_PORT:-19092}
REDIS_PORT=${DEMO_REDIS_PORT:-16379}
WEB_PORT=${DEMO_WEB_PORT:-6066}
FEEDBACK_WEB_PORT=${DEMO_FEEDBACK_WEB_PORT:-$((WEB_PORT + 1))}
# Faust's local table state belongs to one broker: each stack keeps its own.
export FRAUD_DATA_DIR=$STATE/faust
PIDS=()
STACK_STARTED=0

cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  if [[ $STACK_STARTED == 1 ]]; then $BIN/python -m tools.stack down "${STACK_FLAGS[@]}"; fi
}
trap cleanup EXIT

# Prints `export` lines that make a process the Kafka user $1 and the Redis user
# $2 ("-": none) of the secure stack: user names and password files, never a password.
role_env() {
  [[ $SECURE == 1 ]] || return 0
  local args=(env --state-dir "$STATE")
  [[ $1 == - ]] || args+=(--kafka-user "$1")
  [[ $2 == - ]] || args+=(--redis-user "$2")
  $BIN/python -m tools.stack "${args[@]}"
}

# start_worker ROLE KAFKA_USER REDIS_USER WEB_PORT: one worker in the background, its log in the state dir.
start_worker() {
  local env
  env=$(role_env "$2" "$3")
  ( eval "$env"; exec $BIN/fraud-pipeline worker --role "$1" --web-port "$4" ) > "$STATE/worker-$1.log" 2>&1 &
  PIDS+=($!)
}

wait_ready() {  # PID LOG
  for _ in $(seq 1 240); do
    grep -q "Ready" "$2" 2>/dev/null && return 0
    kill -0 "$1" 2>/dev/null || { echo "worker exited:"; tail -30 "$2"; exit 1; }
    sleep 0.5
  done
  echo "worker not ready:"; tail -30 "$2"; exit 1
}

echo "== 1/5 local stack (Apache Kafka broker + redis-server)$([[ $SECURE == 1 ]] && echo ', secured: TLS, SASL/SCRAM, ACLs, Redis users')"
STACK_STARTED=1
$BIN/python -m tools.stack up "${STACK_FLAGS[@]}" --broker-port "$BROKER_PORT" --redis-port "$REDIS_PORT" > /dev/null
echo "broker pid $(cat "$STATE/broker.pid" 2>/dev/null || echo '- (external)'), redis pid $(cat "$STATE/redis.pid" 2>/dev/null || echo '- (external)') (state: $STATE)"
# shellcheck disable=SC1091
source "$STATE/env"

# Producers sign their messages (HMAC); the demo's load generator is one of them.
export FRAUD_CLIENT_KEYS_FILE=$STATE/client-keys.json
$BIN/fraud-pipeline keys loadgen --file "$FRAUD_CLIENT_KEYS_FILE" >/dev/null
# The worker signs every decision (Ed25519); the load generator verifies them with the public keys.
export FRAUD_DECISION_SIGNING_KEY_FILE=$STATE/decision-key.pem
export FRAUD_DECISION_PUBLIC_KEYS_FILE=$STATE/decision-public-keys.json
$BIN/fraud-pipeline decision-key --key "$FRAUD_DECISION_SIGNING_KEY_FILE" --public "$FRAUD_DECISION_PUBLIC_KEYS_FILE" >/dev/null

echo "== 2/5 data and model"
[[ -f $DATA ]] || $BIN/fraud-pipeline simulate --users 2000 --merchants 4000 --days 45 --out "$DATA"
if ! $BIN/fraud-pipeline models check >/dev/null 2>&1; then
  # The first model of a fresh registry (or the first this code can serve, after a
  # feature-set change) is promoted here, visibly: the promotion is logged in
  # promotions.jsonl; later trainings only register (models promote serves).
  $BIN/fraud-pipeline train --data "$DATA" --serve-if-none
else
  echo "model $(cat "$FRAUD_REGISTRY_DIR/CURRENT") serves (\`fraud-pipeline models list\`; train registers a new one, \`models promote\` serves it)"
fi

echo "== 3/5 materialize features into Redis$([[ $SECURE == 1 ]] && echo ' (Redis user materialize)')"
( eval "$(role_env - materialize)"; exec $BIN/fraud-pipeline materialize --data "$DATA" )

# Two workers, as deployed (docker-compose.yml): scoring, and the feedback loop
# in its own consumer group. On the secure stack they are two principals.
echo "== 4/5 workers: scoring$([[ $SECURE == 1 ]] && echo ' (Kafka user scoring, Redis user worker)'), feedback$([[ $SECURE == 1 ]] && echo ' (Kafka user feedback, Redis user worker)')"
start_worker score scoring worker "$WEB_PORT"
start_worker feedback feedback worker "$FEEDBACK_WEB_PORT"
wait_ready "${PIDS[0]}" "$STATE/worker-score.log"
wait_ready "${PIDS[1]}" "$STATE/worker-feedback.log"
echo "workers ${PIDS[*]} ready (logs: $STATE/worker-score.log, $STATE/worker-feedback.log)"
# "Ready" comes before the group assigns the scoring worker its partitions and it
# starts a transactional producer per partition (seconds): a few probe
# transactions first, so the load below measures scoring, not the start-up.
probe_start=$SECONDS
if ( eval "$(role_env payments -)"
     exec $BIN/fraud-pipeline loadgen --rate 5 --duration 1 --data "$DATA" --every 60 ) > "$STATE/probe.log" 2>&1; then
  echo "first decisions $((SECONDS - probe_start)) s after the probe started (log: $STATE/probe.log)"
else
  echo "the probe got no decision within its drain time; loading anyway (log: $STATE/probe.log)"
fi

echo "== 5/5 load: ${RATE}/s for ${DURATION}s$([[ $SECURE == 1 ]] && echo ' (Kafka user payments)')"
( eval "$(role_env payments -)"
  exec $BIN/fraud-pipeline loadgen --rate "$RATE" --duration "$DURATION" --data "$DATA" --json "$STATE/demo-summary.json" )
echo "summary: $STATE/demo-summary.json"
