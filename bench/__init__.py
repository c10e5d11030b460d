"""The benchmark harness: the transport ceiling and the pipeline, side by side.

    python -m bench.run [--quick]     # or: make bench [QUICK=1]

:mod:`bench.run` starts a broker and Redis (unless ``KAFKA_BOOTSTRAP`` /
``REDIS_URL`` are set), then for each variant (the pass-throughs ``bare`` and
``ceiling``, the Kafka Streams peer, the ``unbatched`` and ``batched`` pipeline,
and a batch size × window sweep) a
worker subprocess on fresh topics, drives it open-loop with
:func:`tools.loadgen.run_load`, and writes ``bench/results/latest.json`` plus the
plots of :mod:`bench.plots`.
"""
