#!/usr/bin/env bash
# CPU per thread of a scoring worker under open-loop load (RATE=150 bench/threads.sh):
# /proc/<pid>/task ticks over 10 s, thread names from py-spy dump.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin; DATA=data/transactions.parquet
# py-spy names the threads; a tool for this script, not a dependency of the project.
test -x $BIN/py-spy || $BIN/python -m pip install -q py-spy
$BIN/python -m tools.stack up >/dev/null
source .stack/env
# Topics of its own, as bench/profile.sh: the local stack keeps earlier runs'
# records, which a new group would otherwise decide first (from the earliest offset).
TAG=thr-$RANDOM
export FRAUD_CLIENT_KEYS_FILE=.stack/client-keys.json FRAUD_APP_ID=$TAG FRAUD_WORKER_ROLE=score
export FRAUD_TOPIC_TRANSACTIONS=$TAG-tx FRAUD_TOPIC_DECISIONS=$TAG-dec FRAUD_TOPIC_DLQ=$TAG-dlq \
  FRAUD_TOPIC_FEEDBACK=$TAG-fb FRAUD_TOPIC_MONITORING=$TAG-mon FRAUD_TOPIC_LABELS=$TAG-lab
$BIN/fraud-pipeline keys loadgen --file "$FRAUD_CLIENT_KEYS_FILE" >/dev/null
export FRAUD_DECISION_SIGNING_KEY_FILE=.stack/decision-key.pem FRAUD_DECISION_PUBLIC_KEYS_FILE=.stack/decision-public-keys.json
$BIN/fraud-pipeline decision-key --key "$FRAUD_DECISION_SIGNING_KEY_FILE" --public "$FRAUD_DECISION_PUBLIC_KEYS_FILE" >/dev/null
$BIN/fraud-pipeline materialize --data $DATA >/dev/null 2>&1
$BIN/fraud-pipeline worker > .stack/thr-worker.log 2>&1 &
W=$!
for _ in $(seq 1 120); do grep -q "Ready" .stack/thr-worker.log && break; sleep 0.5; done
snap() { for t in /proc/$W/task/*; do echo "$(basename $t) $(awk '{print $14+$15}' $t/stat)"; done | sort; }
$BIN/fraud-pipeline loadgen --rate ${RATE:-150} --duration 20 --data $DATA --every 100 > .stack/thr-load.txt &
L=$!
sleep 5; snap > .stack/thr-s1; sleep 10; snap > .stack/thr-s2
wait $L
join .stack/thr-s1 .stack/thr-s2 | awk '{printf "%-10s %6.1f%% of a core\n", $1, ($3-$2)/10}' | sort -k2 -nr | head -8
$BIN/py-spy dump --pid $W 2>/dev/null | grep -E "^Thread" || true
tail -1 .stack/thr-load.txt
kill -TERM $W; sleep 3; kill -KILL $W 2>/dev/null || true
$BIN/python -m tools.stack down >/dev/null
