#!/usr/bin/env bash
# CPU per thread of a scoring worker under open-loop load (RATE=150 bench/threads.sh):
# /proc/<pid>/task ticks over 10 s, thread names from py-spy dump; then how long
# its busiest threads and Redis waited for a core, and each process's share.
# WARM_S=60: that many seconds of the load first (a broker just started spends
# a third of a core compiling its hot paths).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin; DATA=data/transactions.parquet; W=""
# py-spy names the threads; a tool for this script, not a dependency of the project.
test -x $BIN/py-spy || $BIN/python -m pip install -q py-spy
# Whatever way it ends, what it started stops: the worker, then the stack.
trap '{ [[ -n "$W" ]] && kill -KILL $W 2>/dev/null; } || true; $BIN/python -m tools.stack down >/dev/null' EXIT
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
# Each thread as TID_name: librdkafka names its own (rdk:main, rdk:broker<id>); Python's
# show as the process's name, and py-spy's dump below names them by TID.
snap() { for t in /proc/$W/task/*; do echo "$(basename $t)_$(tr ' ' '-' < $t/comm) $(awk '{print $14+$15}' $t/stat)"; done | sort; }
WARM=${WARM_S:-0}
$BIN/fraud-pipeline loadgen --rate ${RATE:-150} --duration $((20 + WARM)) --data $DATA --every 100 > .stack/thr-load.txt &
L=$!
# schedstat: ns on a core, ns runnable but waiting for one. /proc/stat: the machine's idle ticks.
# Redis's main thread beside the worker's: the one the batch's call waits on.
R=$(pgrep -n -x redis-server || true)
sched() { for t in /proc/$W/task/* ${R:+/proc/$R/task/$R}; do echo "$(basename $t)_$(tr ' ' '-' < $t/comm) $(awk '{print $1, $2}' $t/schedstat)"; done | sort; }
idle() { awk '/^cpu /{print $5+$6, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
B=$(pgrep -n -f kafka.Kafka || true)
procs() { for p in worker:$W broker:$B redis:$R loadgen:$L; do echo "${p%%:*} $(awk '{print $14+$15}' /proc/${p#*:}/stat 2>/dev/null || echo 0)"; done; }
sleep $((5 + WARM)); snap > .stack/thr-s1; sched > .stack/thr-q1; idle > .stack/thr-i1; procs > .stack/thr-p1
sleep 10; snap > .stack/thr-s2; sched > .stack/thr-q2; idle > .stack/thr-i2; procs > .stack/thr-p2
# A load that fell behind ends with transactions still undecided, and loadgen says so in its status.
wait $L || true
join .stack/thr-s1 .stack/thr-s2 | awk '{printf "%-10s %6.1f%% of a core\n", $1, ($3-$2)/10}' | sort -k2 -nr | head -14
# A thread that is neither running nor waiting for a core waits on I/O (epoll, a
# lock, a reply): what separates "the machine is full" from "the loop waits on a call".
join .stack/thr-q1 .stack/thr-q2 | awk '{run=($4-$2)/1e8; q=($5-$3)/1e8; if (run > 2) printf "%-24s running %5.1f%%, waiting for a core %5.1f%%, off both %5.1f%% of the 10 s\n", $1, run, q, 100-run-q}'
paste .stack/thr-i1 .stack/thr-i2 | awk '{printf "machine: %.1f%% of its cores idle\n", 100*($3-$1)/($4-$2)}'
join .stack/thr-p1 .stack/thr-p2 | awk '{printf "%s %.1f%% ", $1, ($3-$2)/10} END {print "of a core"}'
$BIN/py-spy dump --pid $W 2>/dev/null | grep -E "^Thread" || true
tail -1 .stack/thr-load.txt
kill -TERM $W; sleep 3
