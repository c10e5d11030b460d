# fraud-pipeline: the two commands a new user needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
FP := $(BIN)/fraud-pipeline
STAMP := $(VENV)/.installed
DATA := data/transactions.parquet
DEMO_RATE ?= 100
DEMO_DURATION ?= 20
# The demo runs on the secured stack (TLS, SASL/SCRAM, ACLs, Redis users; SECURITY.md);
# SECURE=0: the plaintext one.
SECURE ?= 1
SOAK_MINUTES ?= 30
SOAK_RATE ?= 500
# The faust pass-through by default (bench/passthrough.py: the transport and
# broker alone, no scoring); SOAK_VARIANT=batched soaks the full pipeline
# (what one worker sustains: docs/performance.md).
SOAK_VARIANT ?= ceiling
# SOAK_BROKERS=3: the soak on the replicated stack instead (tools/cluster.py):
# the batched pipeline at SOAK_CLUSTER_RATE with SOAK_WORKERS scoring workers, a
# feedback worker consuming labels, a model promoted mid-run, the baseline after
# SOAK_WARMUP minutes (three brokers warm slower than one); no fault tests
# (test-cluster has the cluster's). bench/results/soak-cluster.json and .png.
SOAK_BROKERS ?= 1
SOAK_CLUSTER_RATE ?= 150
SOAK_WORKERS ?= 1
SOAK_WARMUP ?= 5
# stack-up / stack-status: 1 broker and 1 Redis, or BROKERS=3: 3 Kafka brokers,
# 3 KRaft controllers and a Redis primary with 2 replicas and 3 Sentinels (tools/cluster.py).
BROKERS ?= 1

.PHONY: setup test-tools lint check demo test test-cluster test-kafka39 soak stack-up stack-down stack-status simulate train materialize clean

# The broker's Kafka version: deploy/kafka/pom.xml's (4.4.0), or KAFKA_VERSION from
# the environment or the command line (KAFKA_VERSION=3.9.1 make setup, then the same
# variable for the stack and the tests: tools/stack/ reads it too). Each version has
# its own folder of jars, so switching never mixes them, and switching back is instant.
ifeq ($(KAFKA_VERSION),)
KAFKA_VERSION := $(shell sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' deploy/kafka/pom.xml)
endif
export KAFKA_VERSION
KAFKA_LIB := .kafka/$(KAFKA_VERSION)/lib
KAFKA_STAMP := $(KAFKA_LIB)/.fetched

setup: $(STAMP) $(KAFKA_STAMP)

# The local broker: Apache Kafka's jars and their runtime dependencies from Maven
# Central (~46 MB, cached in ~/.m2). Kafka 3.x logs through reload4j, 4.x through
# log4j2: the pom's profile for each brings the matching slf4j binding.
$(KAFKA_STAMP): deploy/kafka/pom.xml
	@{ command -v java >/dev/null && command -v mvn >/dev/null; } || { echo "installing Java and Maven (apt: default-jre-headless maven)"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends default-jre-headless maven) >/dev/null 2>&1 \
	  || { echo "need java (17+) and mvn on PATH (Debian: apt-get install default-jre-headless maven)"; exit 1; }; }
	@java -version 2>&1 | awk -F'"' '/version/ { split($$2, v, "."); if (v[1] < 17) { print "need Java 17+, found " $$2; exit 1 } }'
	rm -rf $(KAFKA_LIB)
	mvn -q -B -f deploy/kafka/pom.xml -Dkafka.version=$(KAFKA_VERSION) $(if $(filter 3.%,$(KAFKA_VERSION)),-Pkafka3,) \
	  dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory=$(CURDIR)/$(KAFKA_LIB)
	touch $(KAFKA_STAMP)

# The benchmark's peer (bench/streams/): a Kafka Streams exactly_once_v2
# pass-through, compiled with its runtime class path (~80 MB of jars, cached in
# ~/.m2) at the broker's Kafka version (KAFKA_VERSION above), so that both move
# together (the stamp names the version: another one rebuilds). Only `make bench` needs it.
STREAMS_STAMP := bench/streams/target/.built-$(KAFKA_VERSION)
.PHONY: streams
streams: $(STREAMS_STAMP)

$(STREAMS_STAMP): bench/streams/pom.xml deploy/kafka/pom.xml $(shell find bench/streams/src -type f) | $(KAFKA_STAMP)
	rm -rf bench/streams/target
	mvn -q -B -f bench/streams/pom.xml -Dkafka.version=$(KAFKA_VERSION) compile dependency:copy-dependencies
	touch $(STREAMS_STAMP)

$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null || { echo "installing redis-server (apt)"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null 2>&1 \
	  || { echo "need redis-server on PATH (Debian: apt-get install redis-server)"; exit 1; }; }
	@command -v redis-sentinel >/dev/null || { echo "installing redis-sentinel (apt; the replicated stack's failover)"; \
	  (apt-get update -qq && apt-get install -y -qq redis-sentinel) >/dev/null 2>&1 \
	  || { echo "need redis-sentinel on PATH (Debian: apt-get install redis-sentinel)"; exit 1; }; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# What only the tests need (the demo does not): docker-compose validates
# docker-compose.yml, kcat runs the README's plain-client example, promtool
# (Debian's prometheus package) checks and unit-tests deploy/prometheus-rules.yml,
# Chromium drives the review page's browser test.
test-tools:
	@command -v docker-compose >/dev/null || { echo "installing docker-compose (apt; validates docker-compose.yml in the tests)"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose) >/dev/null 2>&1 \
	  || echo "docker-compose not installed: the compose file test will be skipped"; }
	@command -v kcat >/dev/null || { echo "installing kcat (apt; runs the README's plain Kafka client example)"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends kcat) >/dev/null 2>&1 \
	  || echo "kcat not installed: the README's kcat example test will be skipped"; }
	@command -v promtool >/dev/null || { echo "installing prometheus (apt; its promtool checks deploy/prometheus-rules.yml)"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1 \
	  || echo "promtool not installed: the alerting rules' promtool tests will be skipped"; }
	@{ command -v chromium && command -v chromedriver; } >/dev/null || { echo "installing chromium + chromium-driver (apt, for the review page's browser test)"; \
	  (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
	  || { echo "need chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)"; exit 1; }; }

stack-up: setup
	$(PY) -m tools.stack up --brokers $(BROKERS)

# Every stack: the plaintext one (.stack), the secure one (.stack/secure) and
# both clusters (.stack/cluster, .stack/cluster-secure).
stack-down:
	@test -x $(PY) && { $(PY) -m tools.stack down; $(PY) -m tools.stack down --secure; \
	  $(PY) -m tools.stack down --brokers 3; $(PY) -m tools.stack down --brokers 3 --secure; } || true

stack-status: setup
	$(PY) -m tools.stack status --brokers $(BROKERS)

$(DATA): | setup
	$(FP) simulate --users 2000 --merchants 4000 --days 45 --out $(DATA)

simulate: setup
	$(FP) simulate --users 2000 --merchants 4000 --days 45 --out $(DATA)

# Registers a model; serves it only if nothing serves yet (logged). Later models:
# `fraud-pipeline models promote VERSION`.
train: setup $(DATA)
	$(FP) train --data $(DATA) --serve-if-none

materialize: setup $(DATA)
	$(FP) materialize --data $(DATA)

# Static checks, run first by `make test`: style and errors (ruff), types (mypy,
# strict on every package: app/ to bench/), and the layer contract (import-linter:
# imports only run down bench > tools > agents | gateway > models > pipeline > app).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# The gRPC contract's generated Python code (gateway/grpc_gen), regenerated from
# proto/fraud/v1/fraud.proto with the pinned grpcio-tools. Committed, so installs
# need no protoc; a unit test checks it matches the .proto (tools/protogen.py).
.PHONY: proto
proto: setup
	$(PY) -m tools.protogen

# The main job: stack up, train if there is no model, materialize, a scoring and
# a feedback worker, load at DEMO_RATE for DEMO_DURATION seconds, then stop
# everything. Secured, each process on its role's own credentials (SECURE=0: plaintext).
demo: setup
	@SECURE=$(SECURE) bash scripts/demo.sh $(DEMO_RATE) $(DEMO_DURATION)

# Unit tests, then integration tests against a real broker and Redis that the
# fixtures start (or KAFKA_BOOTSTRAP / REDIS_URL when set) and stop. Test files
# run on TEST_PROCS processes, each with a broker and Redis of its own on free
# ports: most of the suite waits on real processes, not on the CPU (2 cores:
# 7 min on 2 processes, 11.7 on 1).
TEST_PROCS ?= 2
test: setup test-tools lint
	@mkdir -p .stack && rm -f .stack/fault-report.txt
	FRAUD_FAULT_REPORT=.stack/fault-report.txt $(PY) -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_PROCS) --dist loadfile \
	  -m "not cluster and not soak"

# The developer's loop: static checks and the tests that need no broker or
# Redis (tests/unit/, a folder per product package: pure stages, the scoring
# loop on in-memory Kafka and stores), in a few minutes. `make test` runs these
# and the integration tests, as CI does.
check: setup lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests/unit

# The replicated stack (minutes: three Kafka brokers and three controllers, Redis with Sentinels): up,
# status, down, a broker lost under acks=all, the secure cluster, a worker
# under load through a Redis failover, and three workers under load through the
# loss of a broker, of a transaction coordinator and of the Redis primary in one
# run (tests/integration/test_cluster.py, test_redis_failover.py,
# test_cluster_faults.py); and the single node killed and restarted under load
# (test_broker_restart.py). Those tests are marked `cluster`; `make test` runs
# only the rest of these files, this target the four files in full (`-m` here
# replaces the default `not cluster and not soak`). CLUSTER_FIRST_KILL=controller:
# the cluster fault test's first kill takes the active KRaft controller.
test-cluster: setup
	@mkdir -p .stack
	FRAUD_FAULT_REPORT=.stack/fault-report.txt $(PY) -m pytest -q -p no:cacheprovider -m "not soak" \
	  tests/integration/test_cluster.py tests/integration/test_redis_failover.py \
	  tests/integration/test_cluster_faults.py tests/integration/test_broker_restart.py

# The other Kafka version kept working: the transaction and fault tests (every
# fault, exactly once) on Apache Kafka 3.9.1 instead of the default, its jars in
# .kafka/3.9.1 (docs/local-broker.md). The two files on two processes, as
# `make test` runs them beside the rest: ~6 minutes, the fault file's length.
KAFKA_OTHER_VERSION := 3.9.1
.PHONY: test-kafka39
test-kafka39: $(STAMP)
	$(MAKE) --no-print-directory KAFKA_VERSION=$(KAFKA_OTHER_VERSION) setup
	@mkdir -p .stack && rm -f .stack/fault-report-kafka39.txt
	KAFKA_VERSION=$(KAFKA_OTHER_VERSION) FRAUD_FAULT_REPORT=.stack/fault-report-kafka39.txt \
	  $(PY) -m pytest -q -p no:cacheprovider --durations=15 -n 2 --dist loadfile \
	  tests/integration/test_eos.py tests/integration/test_faults.py

# The fault and fuzz tests' soak variants (marked `soak`), longer (minutes):
# more load, longer outages. Then
# SOAK_MINUTES of steady load at SOAK_RATE TPS: broker CPU per message, p99 and
# broker RSS must stay flat (bench/soak.py; bench/results/soak.json and .png).
soak: setup
ifeq ($(SOAK_BROKERS),3)
	$(PY) -m bench.soak --brokers 3 --minutes $(SOAK_MINUTES) --rate $(SOAK_CLUSTER_RATE) --workers $(SOAK_WORKERS) \
	  --warmup-minutes $(SOAK_WARMUP)
else
	@mkdir -p .stack && rm -f .stack/fault-report.txt
	FRAUD_FAULT_REPORT=.stack/fault-report.txt $(PY) -m pytest -q -p no:cacheprovider -m soak tests/integration/test_faults.py
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) --rate $(SOAK_RATE) --variant $(SOAK_VARIANT)
endif

clean: stack-down
	rm -rf .stack data .kafka bench/streams/target

# Benchmark: transport ceiling vs unbatched vs batched pipeline on one broker,
# and the Kafka Streams peer beside them; latency vs offered rate, max
# sustainable rate, batch sweep (bench/run.py).
# ~20 minutes (the peer, both load shapes, two workers under each and a fresh worker included); QUICK=1: one rate and
# one search probe, short runs, no sweep (~3 minutes).
.PHONY: bench
bench: setup streams
	$(PY) -m bench.run $(if $(QUICK),--quick,)
