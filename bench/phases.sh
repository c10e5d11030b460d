#!/usr/bin/env bash
# Where the scoring loop's wall time goes under open-loop load (bench/phases.py).
#   bench/phases.sh [RATE] [DURATION_S] [LABEL]
# One worker with default settings (the bench's rate limits) on topics of its
# own; after 12 s of load, two scrapes of its /metrics 10 s apart, the worker's
# and Redis's CPU over them, and Redis's SLOWLOG of the batch script meanwhile;
# the broker's CPU by thread (and its kernel share) and its requests by type (JMX, opened with jcmd
# and read by Kafka's JmxTool; left out where the JDK has no jcmd).
# Writes bench/results/phases-<label>-<rate>.json. FRAUD_* settings in the
# environment reach the worker. DURATION_S must leave the window inside the
# load (at least 25).
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-3000}; DURATION=${2:-30}; LABEL=${3:-worker}
BIN=.venv/bin; POPULATION=data/bench-population.parquet; WORKER_PID=""
PORT=${PHASES_WEB_PORT:-16066}
TMP=$(mktemp -d)
cleanup() {
  [[ -n "$WORKER_PID" ]] && kill -TERM "$WORKER_PID" 2>/dev/null && sleep 3 && kill -KILL "$WORKER_PID" 2>/dev/null || true
  $BIN/python -m tools.stack down >/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
$BIN/python -m tools.stack up >/dev/null
# shellcheck disable=SC1091
source .stack/env
TAG=phases-$RANDOM
export FRAUD_CLIENT_KEYS_FILE=.stack/client-keys.json FRAUD_APP_ID=$TAG FRAUD_WORKER_ROLE=score FRAUD_WEB_PORT=$PORT
export FRAUD_TOPIC_TRANSACTIONS=$TAG-tx FRAUD_TOPIC_DECISIONS=$TAG-dec FRAUD_TOPIC_DLQ=$TAG-dlq \
  FRAUD_TOPIC_FEEDBACK=$TAG-fb FRAUD_TOPIC_MONITORING=$TAG-mon FRAUD_TOPIC_LABELS=$TAG-lab
# The bench's limits (bench/workers.py, BENCH_RATE_LIMITS): the limiter runs, it never bites.
export FRAUD_RATE_USER_PER_S=1e9 FRAUD_RATE_USER_BURST=1e9 FRAUD_RATE_CLIENT_PER_S=1e9 FRAUD_RATE_CLIENT_BURST=1e9
$BIN/fraud-pipeline keys loadgen --file "$FRAUD_CLIENT_KEYS_FILE" >/dev/null
export FRAUD_DECISION_SIGNING_KEY_FILE=.stack/decision-key.pem FRAUD_DECISION_PUBLIC_KEYS_FILE=.stack/decision-public-keys.json
$BIN/fraud-pipeline decision-key --key "$FRAUD_DECISION_SIGNING_KEY_FILE" --public "$FRAUD_DECISION_PUBLIC_KEYS_FILE" >/dev/null
test -f $POPULATION || $BIN/fraud-pipeline simulate --users 50000 --merchants 20000 --days 20 --out $POPULATION --quiet
$BIN/fraud-pipeline materialize --data $POPULATION >/dev/null 2>&1
$BIN/fraud-pipeline worker > .stack/phases-worker.log 2>&1 &
WORKER_PID=$!
for _ in $(seq 1 120); do grep -q "Ready" .stack/phases-worker.log && break; sleep 0.5; done
# PHASES_WARM_RATE / PHASES_WARM_S: load before the measured run (a new broker spends
# minutes of a core compiling its hot paths: 1000 and 40 leave less of that in the window).
$BIN/fraud-pipeline loadgen --rate "${PHASES_WARM_RATE:-100}" --duration "${PHASES_WARM_S:-5}" --data $POPULATION \
  --every 5 --verify-share 0.02 >/dev/null || true
$BIN/fraud-pipeline loadgen --rate "$RATE" --duration "$DURATION" --data $POPULATION --every 5 --verify-share 0.02 \
  --json "$TMP/load.json" > "$TMP/load.log" 2>&1 &
LOAD=$!
redis() { $BIN/python - "$REDIS_URL" "$@" <<'PY'
import json, sys
import redis
r = redis.Redis.from_url(sys.argv[1])
if sys.argv[2] == "cpu":
    info = r.info("cpu"); print(info["used_cpu_user"] + info["used_cpu_sys"])
elif sys.argv[2] == "watch":
    r.config_set("slowlog-log-slower-than", 0); r.config_set("slowlog-max-len", 100000); r.slowlog_reset()
else:
    entries = r.slowlog_get(100000); r.config_set("slowlog-log-slower-than", 10000)
    print(json.dumps([{"duration": e["duration"], "command": e["command"].decode(errors="replace")[:40]} for e in entries]))
PY
}
# After the load generator's start-up and the worker's first backlog: the
# window must hold no idle take (each waits up to 0.25 s for a record).
BROKER_PID=$(cat .stack/broker.pid)
threads() { for t in /proc/"$BROKER_PID"/task/*; do cat "$t/stat"; done; }
BROKER_ARGS=(--broker-threads "$TMP/threads-before.txt" "$TMP/threads-after.txt")
jmx() { :; }
if command -v jcmd >/dev/null; then
  # JMX on loopback only, for this broker's life (tools.stack down ends it).
  JMX_PORT=$($BIN/python -c "from tools.stack import free_port; print(free_port())")
  jcmd "$BROKER_PID" ManagementAgent.start "jmxremote.port=$JMX_PORT" "jmxremote.rmi.port=$JMX_PORT" \
    jmxremote.host=127.0.0.1 jmxremote.authenticate=false jmxremote.ssl=false >/dev/null
  CLASSPATH_KAFKA=$($BIN/python -c "from tools.stack.broker import kafka_classpath; print(kafka_classpath())")
  jmx() { java -cp "$CLASSPATH_KAFKA" org.apache.kafka.tools.JmxTool --one-time true --report-format properties \
    --jmx-url "service:jmx:rmi:///jndi/rmi://127.0.0.1:$JMX_PORT/jmxrmi" --attributes Count,Mean \
    --object-name 'kafka.network:type=RequestMetrics,name=RequestsPerSec,request=*,version=*' \
    --object-name 'kafka.network:type=RequestMetrics,name=LocalTimeMs,request=*' > "$1" 2>/dev/null || true; }
  BROKER_ARGS+=(--broker-jmx "$TMP/jmx-before.txt" "$TMP/jmx-after.txt")
fi
# PHASES_JFR=1: a JDK Flight Recorder profile of the broker over the window (its
# Java threads' execution samples; their kernel time is in the threads' stime).
jfr_start() { :; }; jfr_stop() { :; }
if [[ -n "${PHASES_JFR:-}" ]] && command -v jfr >/dev/null && command -v jcmd >/dev/null; then
  jfr_start() { jcmd "$BROKER_PID" JFR.start name=phases settings=profile >/dev/null; }
  jfr_stop() { jcmd "$BROKER_PID" JFR.stop name=phases filename="$TMP/broker.jfr" >/dev/null \
    && jfr print --json --events jdk.ExecutionSample "$TMP/broker.jfr" > "$TMP/jfr.json" \
    && BROKER_ARGS+=(--broker-jfr "$TMP/jfr.json"); }
fi
sleep 12
redis watch
jmx "$TMP/jmx-before.txt"
curl -s "localhost:$PORT/metrics" > "$TMP/before.txt"
jfr_start || true
T0=$(date +%s.%N); C0=$(awk '{print $14+$15}' "/proc/$WORKER_PID/stat"); R0=$(redis cpu); threads > "$TMP/threads-before.txt"
sleep 10
curl -s "localhost:$PORT/metrics" > "$TMP/after.txt"
T1=$(date +%s.%N); C1=$(awk '{print $14+$15}' "/proc/$WORKER_PID/stat"); R1=$(redis cpu); threads > "$TMP/threads-after.txt"
jmx "$TMP/jmx-after.txt"
jfr_stop || true
redis dump > "$TMP/slowlog.json"
wait $LOAD || true
tail -1 "$TMP/load.log"
$BIN/python - "$T0" "$T1" "$C0" "$C1" "$R0" "$R1" "$RATE" "$TMP/load.json" > "$TMP/extra.json" <<'PY'
import json, os, sys
from bench.procs import machine_info
t0, t1, c0, c1, r0, r1, rate = map(float, sys.argv[1:8])
wall = t1 - t0
load = json.load(open(sys.argv[8])) if os.path.exists(sys.argv[8]) else {}
print(json.dumps({
    "offered_tps": rate, "machine": machine_info(),
    "worker_cpu_pct": round((c1 - c0) / os.sysconf("SC_CLK_TCK") / wall * 100, 1),
    "redis_cpu_pct": round((r1 - r0) / wall * 100, 1),
    "load": {k: load[k] for k in ("sent", "decided", "achieved_rate", "latency_ms") if k in load},
}))
PY
$BIN/python -m bench.phases "$TMP/before.txt" "$TMP/after.txt" --wall "$(python3 -c "print($T1 - $T0)")" \
  --slowlog "$TMP/slowlog.json" --extra "$TMP/extra.json" "${BROKER_ARGS[@]}" \
  --out "bench/results/phases-${LABEL}-${RATE}.json"
