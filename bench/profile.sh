#!/usr/bin/env bash
# Profile a scoring worker under open-loop load with py-spy (make profile).
#   bench/profile.sh [RATE] [DURATION_S] [BATCH_SIZE]
# Writes .stack/profile-<batch>-<rate>.txt (collapsed stacks) and prints
# the functions with the most samples (self and inclusive).
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-200}; DURATION=${2:-20}; BATCH=${3:-32}
BIN=.venv/bin; DATA=data/transactions.parquet; WORKER_PID=""
OUT=.stack/profile-b${BATCH}-r${RATE}.txt
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
export FRAUD_CLIENT_KEYS_FILE=.stack/client-keys.json FRAUD_BATCH_SIZE=$BATCH FRAUD_APP_ID=profile-$RANDOM
$BIN/fraud-pipeline keys loadgen --file "$FRAUD_CLIENT_KEYS_FILE" >/dev/null
export FRAUD_DECISION_SIGNING_KEY_FILE=.stack/decision-key.pem FRAUD_DECISION_PUBLIC_KEYS_FILE=.stack/decision-public-keys.json
$BIN/fraud-pipeline decision-key --key "$FRAUD_DECISION_SIGNING_KEY_FILE" --public "$FRAUD_DECISION_PUBLIC_KEYS_FILE" >/dev/null
$BIN/fraud-pipeline materialize --data $DATA >/dev/null
$BIN/fraud-pipeline worker > .stack/profile-worker.log 2>&1 &
WORKER_PID=$!
for _ in $(seq 1 120); do grep -q "Ready" .stack/profile-worker.log && break; sleep 0.5; done
$BIN/fraud-pipeline loadgen --rate "$RATE" --duration "$DURATION" --data $DATA --every 5 --json .stack/profile-load.json &
LOAD=$!
sleep $(( DURATION / 4 ))
$BIN/py-spy record --pid "$WORKER_PID" --duration $(( DURATION / 2 )) --format raw --output "$OUT" --threads --rate 200 >/dev/null 2>&1 || true
wait $LOAD
$BIN/python - "$OUT" <<'PY'
import collections, sys
self_, incl, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); total += n
    frames = stack.split(";")
    self_[frames[-1]] += n
    for f in set(frames[1:]): incl[f] += n
print(f"{total} samples")
print("-- self"); [print(f"{c*100/total:5.1f}% {f}") for f, c in self_.most_common(25)]
print("-- inclusive"); [print(f"{c*100/total:5.1f}% {f}") for f, c in incl.most_common(40)]
PY
