#!/usr/bin/env bash
# make demo: the whole job on one machine, real broker and Redis on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-100}
DURATION=${2:-20}
BIN=.venv/bin
DATA=data/transactions.parquet
WORKER_PID=""

cleanup() {
  if [[ -n "$WORKER_PID" ]] && kill -0 "$WORKER_PID" 2>/dev/null; then
    kill -TERM "$WORKER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$WORKER_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$WORKER_PID" 2>/dev/null || true
  fi
  $BIN/python -m tools.stack down
}
trap cleanup EXIT

echo "== 1/5 local stack (Apache Kafka broker + redis-server)"
$BIN/python -m tools.stack up
# shellcheck disable=SC1091
source .stack/env

# Producers sign their messages (HMAC); the demo's load generator is one of them.
export FRAUD_CLIENT_KEYS_FILE=.stack/client-keys.json
$BIN/fraud-pipeline keys loadgen --file "$FRAUD_CLIENT_KEYS_FILE" >/dev/null
# The worker signs every decision (Ed25519); the load generator verifies them with the public keys.
export FRAUD_DECISION_SIGNING_KEY_FILE=.stack/decision-key.pem
export FRAUD_DECISION_PUBLIC_KEYS_FILE=.stack/decision-public-keys.json
$BIN/fraud-pipeline decision-key --key "$FRAUD_DECISION_SIGNING_KEY_FILE" --public "$FRAUD_DECISION_PUBLIC_KEYS_FILE" >/dev/null

echo "== 2/5 data and model"
[[ -f $DATA ]] || $BIN/fraud-pipeline simulate --users 2000 --merchants 4000 --days 45 --out $DATA
if [[ ! -f models/registry/CURRENT ]]; then
  # The first model of a fresh registry is promoted here, visibly: the promotion is
  # logged in promotions.jsonl; later trainings only register (models promote serves).
  $BIN/fraud-pipeline train --data $DATA --serve-if-none
else
  echo "model $(cat models/registry/CURRENT) serves (\`fraud-pipeline models list\`; train registers a new one, \`models promote\` serves it)"
fi

echo "== 3/5 materialize features into Redis"
$BIN/fraud-pipeline materialize --data $DATA

echo "== 4/5 scoring worker"
$BIN/fraud-pipeline worker > .stack/worker.log 2>&1 &
WORKER_PID=$!
for _ in $(seq 1 120); do
  grep -q "Ready" .stack/worker.log 2>/dev/null && break
  kill -0 "$WORKER_PID" 2>/dev/null || { echo "worker exited:"; tail -30 .stack/worker.log; exit 1; }
  sleep 0.5
done
grep -q "Ready" .stack/worker.log || { echo "worker not ready:"; tail -30 .stack/worker.log; exit 1; }
echo "worker $WORKER_PID ready (log: .stack/worker.log)"

echo "== 5/5 load: ${RATE}/s for ${DURATION}s"
$BIN/fraud-pipeline loadgen --rate "$RATE" --duration "$DURATION" --data $DATA --json .stack/demo-summary.json
echo "summary: .stack/demo-summary.json"
