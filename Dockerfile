# The scoring worker. Built by docker-compose.yml (`docker compose up`), which
# also runs Kafka and Redis and mounts models/registry over /srv/models/registry.
FROM python:3.11.10-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /srv

# Only what the package and the worker need, so a change elsewhere (tests,
# docs, data) does not invalidate the install layer.
COPY pyproject.toml README.md ./
COPY app ./app
COPY pipeline ./pipeline
COPY models ./models
COPY agents ./agents
COPY gateway ./gateway
COPY tools ./tools
# gcc: the worker compiles the served trees to C (models/compiled.py); without
# it XGBoost scores, at ~0.15 ms more per batch.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# The worker runs as a non-root user; Faust keeps table state under .stack/faust
# (settings.data_dir, relative to /srv) and the compiled trees under
# .stack/compiled-trees: the one place it writes.
ENV FRAUD_COMPILED_TREES_DIR=/srv/.stack/compiled-trees
RUN pip install . \
    && useradd --system --uid 10001 --no-create-home --home-dir /srv fraud \
    && mkdir -p /srv/.stack \
    && chown fraud /srv/.stack

# Read at runtime from config/rules.json (settings.rules_path, relative to /srv).
COPY config ./config

USER fraud

CMD ["fraud-pipeline", "worker"]
