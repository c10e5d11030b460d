#!/usr/bin/env bash
# Profile a scoring worker under open-loop load with py-spy (make profile).
#   bench/profile.sh [RATE] [DURATION_S] [LABEL]
# Writes bench/results/profile-<label>-<rate>.svg (a flame graph of the
# worker, every thread) and .json (the share of samples per pipeline stage),
# and prints the functions with the most samples (self and inclusive).
# FRAUD_* settings in the environment reach the worker (FRAUD_BATCH_SIZE=...);
# PYSPY_RATE sets the samples per second (100; more for a quiet worker);
# PYSPY_ARGS replaces the raw sampler's --nonblocking (--native: C and Rust
# frames too, which needs the worker paused at each sample).
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-750}; DURATION=${2:-30}; LABEL=${3:-worker}
BIN=.venv/bin; DATA=data/transactions.parquet; POPULATION=data/bench-population.parquet; WORKER_PID=""
RAW=.stack/profile-${LABEL}-${RATE}.txt
SVG=bench/results/profile-${LABEL}-${RATE}.svg
cleanup() {
  [[ -n "$WORKER_PID" ]] && kill -TERM "$WORKER_PID" 2>/dev/null && sleep 3 && kill -KILL "$WORKER_PID" 2>/dev/null || true
  $BIN/python -m tools.stack down >/dev/null
}
trap cleanup EXIT
# py-spy is a tool for this script, not a dependency of the project.
test -x $BIN/py-spy || $BIN/python -m pip install -q py-spy
$BIN/python -m tools.stack up >/dev/null
# shellcheck disable=SC1091
source .stack/env
# Topics of its own: the local stack keeps earlier runs' records, which a new
# group would otherwise decide first (it starts from the earliest offset).
TAG=profile-$RANDOM
export FRAUD_CLIENT_KEYS_FILE=.stack/client-keys.json FRAUD_APP_ID=$TAG FRAUD_WORKER_ROLE=score
export FRAUD_TOPIC_TRANSACTIONS=$TAG-tx FRAUD_TOPIC_DECISIONS=$TAG-dec FRAUD_TOPIC_DLQ=$TAG-dlq \
  FRAUD_TOPIC_FEEDBACK=$TAG-fb FRAUD_TOPIC_MONITORING=$TAG-mon FRAUD_TOPIC_LABELS=$TAG-lab
$BIN/fraud-pipeline keys loadgen --file "$FRAUD_CLIENT_KEYS_FILE" >/dev/null
export FRAUD_DECISION_SIGNING_KEY_FILE=.stack/decision-key.pem FRAUD_DECISION_PUBLIC_KEYS_FILE=.stack/decision-public-keys.json
$BIN/fraud-pipeline decision-key --key "$FRAUD_DECISION_SIGNING_KEY_FILE" --public "$FRAUD_DECISION_PUBLIC_KEYS_FILE" >/dev/null
test -f $POPULATION || $BIN/fraud-pipeline simulate --users 50000 --merchants 20000 --days 20 --out $POPULATION --quiet
$BIN/fraud-pipeline materialize --data $POPULATION >/dev/null
$BIN/fraud-pipeline worker > .stack/profile-worker.log 2>&1 &
WORKER_PID=$!
for _ in $(seq 1 120); do grep -q "Ready" .stack/profile-worker.log && break; sleep 0.5; done
# Warm-up load first: the model's first calls, the transactional producer's
# first partitions and the local caches are not what a profile should show.
$BIN/fraud-pipeline loadgen --rate 100 --duration 5 --data $POPULATION --every 5 --verify-share 0.02 >/dev/null || true
$BIN/fraud-pipeline loadgen --rate "$RATE" --duration "$DURATION" --data $POPULATION --every 5 --verify-share 0.02 \
  --json .stack/profile-load.json &
LOAD=$!
sleep $(( DURATION / 4 ))
# Two samplers side by side (neither stops the process): raw stacks to count, a flame graph to look at.
$BIN/py-spy record --pid "$WORKER_PID" --duration $(( DURATION / 2 )) --format raw --output "$RAW" --threads \
  --rate "${PYSPY_RATE:-100}" ${PYSPY_ARGS:---nonblocking} >/dev/null 2>&1 &
$BIN/py-spy record --pid "$WORKER_PID" --duration $(( DURATION / 2 )) --format flamegraph --output "$SVG" --threads \
  --rate "${PYSPY_RATE:-100}" --nonblocking >/dev/null 2>&1 || true
wait $LOAD
$BIN/python -m bench.stages "$RAW" --rate "$RATE" --label "$LABEL" --load .stack/profile-load.json \
  --out "bench/results/profile-${LABEL}-${RATE}.json"
echo "flame graph: $SVG"
