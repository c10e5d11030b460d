"""Score one micro-batch: the whole flow, top to bottom.

    raw messages ─ validate ─┬─ rejections ───────────────────────────────────► reject + DLQ
                             ├─ away from its home partition ─────────────────► re-routed there
                             └─ look up ─┬─ cache hits ───────────────────────► cached decision
                                         ├─ refused by admission ─────────────► reject + DLQ
                                         └─ features ─ ensemble ─ rules ──────► decision
                                                       └ failed, or past its 50 ms ► rules only, degraded

:class:`Scorer` is free of Kafka: it turns a list of :class:`Inbound` messages
into a :class:`BatchOutput` (what to produce where). The look-up (decision
cache, admission, enrichment) is a :class:`~pipeline.lookup.BatchLookup`: one
Redis call for the batch on one Redis server (:mod:`pipeline.redis_batch`),
else the separate calls in turn; either answers the same
:class:`~pipeline.lookup.BatchAnswer`, read here on one path. The agent in
:mod:`agents.score` only moves batches in and out. Every message is answered
once: a decision; a refused one a ``reject`` decision plus a dead-letter record
when its transaction id can be read, else (and when unauthenticated) the dead
letter alone (docs/contract.md, *Outcomes*); nothing raised here may escape
(the scoring loop would stop the worker, and a batch that always raised would
stop it again after every restart).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import numpy as np
import orjson

from app.contract import Decision, Transaction
from app.eos import Placed, Record
from app.placement import Placement
from pipeline.admission import Admission
from pipeline.auth import UNSIGNED
from pipeline.cache import DecisionCache
from pipeline.decide import explain
from pipeline.drift import DriftMonitor
from pipeline.feature_store import Enrichment, FeatureStore
from pipeline.features import FEATURE_NAMES, FEATURE_SET_VERSION, feature_matrix, feature_row
from pipeline.labels import MerchantTally
from pipeline.lookup import NOTHING_FOUND, BatchAnswer, BatchLookup, OneCallFirst, Request, SeparateCalls
from pipeline.model import Prediction, ScoringModel
from pipeline.resend_index import ResendIndex, indexed_value
from pipeline.rules import RuleSet, evaluate_rules
from pipeline.timing import RoundTrips, StageClock
from pipeline.validate import Limits, Rejection, validate

__all__ = ["BatchOutput", "Inbound", "Record", "Scorer", "Signs"]

log = logging.getLogger(__name__)

CORRELATION_HEADERS = ("correlation-id", "correlation_id", "x-correlation-id")
#: What a dead letter keeps of an oversized value or header (see _kept_bytes).
DLQ_PREFIX_BYTES = 4096
MAX_DLQ_HEADERS = 64
MAX_HEADER_NAME = 256
SCORE_BINS = np.linspace(0.0, 1.0, 11)
_SCORE_BIN_LABELS = SCORE_BINS.round(2).tolist()


def score_histogram(scores: np.ndarray) -> list[int]:
    """``np.histogram(scores, SCORE_BINS)[0]``, for a fraction of its cost.

    NOTE: np.histogram checks and sorts its way to the bins on every call:
    on a batch of one that was ~6 % of the scoring stage's CPU. The bins are
    fixed, so a search and a count do: each bin half-open except the last,
    which holds 1.0; values outside [0, 1] (or NaN) are not counted, as there.
    """
    values = np.asarray(scores, dtype=np.float64)
    idx = np.searchsorted(SCORE_BINS, values, side="right") - 1
    idx[values == SCORE_BINS[-1]] = len(SCORE_BINS) - 2
    inside = (idx >= 0) & (idx < len(SCORE_BINS) - 1)
    counts: list[int] = np.bincount(idx[inside], minlength=len(SCORE_BINS) - 1).tolist()
    return counts
PROVISIONAL_REASON = (
    "provisional: the decision cache could not be read, so a resend could not be ruled out (never approves)"
)


@dataclass(frozen=True, slots=True)
class Inbound:
    """One message as read from ``transactions``."""

    value: bytes
    headers: dict[str, bytes] = field(default_factory=dict)
    timestamp: float | None = None
    """The record's timestamp (producer send time), epoch seconds."""
    partition: int | None = None
    offset: int | None = None
    key: bytes | None = None

    @property
    def correlation_id(self) -> str | None:
        for name in CORRELATION_HEADERS:
            raw = self.headers.get(name)
            if raw:
                return raw.decode("utf-8", "replace")[:128]
        return None


@dataclass
class BatchOutput:
    """Messages to produce, as (key, value) pairs per topic."""

    decisions: list[tuple[bytes, bytes, int | None, list[tuple[str, bytes]]]] = field(default_factory=list)
    """(key, value, partition, headers): each decision on the partition of
    ``decisions`` numbered as its transaction's (None: the key's, for a message
    with no partition), a new one with its index entry's header."""
    dead_letters: list[tuple[bytes | None, bytes]] = field(default_factory=list)
    feedback: list[tuple[bytes, bytes]] = field(default_factory=list)
    monitoring: dict[str, Any] | None = None
    """This batch's ``monitoring`` record (counts, stage timings, score histogram);
    serialized where it is produced, read as it is by the worker's metrics."""
    outcomes: Counter[tuple[str, bool]] = field(default_factory=Counter)
    """Decisions produced, by (action, cached)."""
    to_cache: list[tuple[Transaction, bytes]] = field(default_factory=list)
    """Each new decision with its record's bytes as sent: what the worker holds until its transaction settles."""
    indexed: list[tuple[Transaction, bytes]] = field(default_factory=list)
    """Each new decision of a partition as the resend index keeps it
    (pipeline/resend_index.py): its record in ``decisions`` is the index's
    changelog; an index entry once its transaction committed (``LocalFirstCache.committed``)."""
    rerouted: list[tuple[int, Inbound]] = field(default_factory=list)
    """Records found away from their home partition (app/placement.py), each
    with its home: produced there in the batch's transaction, not decided here."""
    extra_monitoring: list[bytes] = field(default_factory=list)
    """Drift windows and shadow summaries, produced to ``monitoring`` as well."""
    shadow: _ShadowWork | None = None
    """The shadow model's share of this batch, done by :meth:`Scorer.finish`."""

    def add(self, kind: str, key: bytes | None, value: bytes) -> None:
        """Append to ``dead_letters`` or ``feedback``."""
        getattr(self, kind).append((key, value))

    def decide(self, msg: Inbound, key: bytes, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> None:
        """Append a decision answering ``msg``, on the partition numbered as ``msg``'s."""
        self.decisions.append((key, value, msg.partition, headers or []))

    def records(self, topics: dict[str, str], sign: Signs | None = None) -> list[Record]:
        """Every record to produce on its key's partition, as (topic, key,
        value, headers), in one list: decisions of messages with no partition
        (each signed by ``sign`` here, once: its value bytes are final), dead
        letters, feedback, then the batch's monitoring records."""
        decisions, dlq, feedback, monitoring = (
            topics["decisions"], topics["dead_letters"], topics["feedback"], topics["monitoring"],
        )  # fmt: skip
        out: list[Record] = [(decisions, k, v, _signed(sign, v, h)) for k, v, p, h in self.decisions if p is None]
        out += [(dlq, k, v, []) for k, v in self.dead_letters]
        out += [(feedback, k, v, []) for k, v in self.feedback]
        if self.monitoring is not None:
            out.append((monitoring, None, orjson.dumps(self.monitoring), []))
        out += [(monitoring, None, v, []) for v in self.extra_monitoring]
        return out

    def placed(self, topics: dict[str, str], sign: Signs | None = None) -> list[Placed]:
        """The records that go to a given partition: the decisions (each on
        its transaction's partition, signed by ``sign`` here, once) and the
        re-routed transactions."""
        decisions = topics["decisions"]
        out: list[Placed] = [(decisions, p, k, v, _signed(sign, v, h)) for k, v, p, h in self.decisions if p is not None]
        transactions = topics["transactions"]
        for home, msg in self.rerouted:
            out.append((transactions, home, msg.key, msg.value, list(msg.headers.items())))
        return out


class Signs(Protocol):
    def headers(self, value: bytes) -> list[tuple[str, bytes]]: ...


def _signed(sign: Signs | None, value: bytes, headers: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """A decision's headers with its signature (by ``sign``, if any) after them."""
    return [*headers, *sign.headers(value)] if sign is not None else headers


@dataclass
class _ShadowWork:
    model: ScoringModel
    matrix: np.ndarray
    txs: list[Transaction]
    tallies: list[MerchantTally | None]
    feedback_at: list[int]
    """Index in ``BatchOutput.feedback`` of each row's record."""
    docs: list[dict[str, Any]]
    """Those feedback records, unserialised, to add the shadow's verdict to."""
    served: list[str]
    """Each row's action as served (the model's score through the rules)."""


@dataclass
class _Evidence:
    """What a batch's fresh transactions are decided on, filled in stage by stage."""

    txs: list[Transaction]
    unchecked: frozenset[str] = frozenset()
    """Ids the decision cache could not check: decided provisionally (never approved)."""
    enrichments: Sequence[Enrichment] | None = None
    """None when the feature store failed (or there was nothing to enrich)."""
    rows: list[list[float]] = field(default_factory=list)
    matrix: np.ndarray | None = None
    prediction: Prediction | None = None
    degraded_reason: str | None = None
    """Why the batch has no model scores, if it has none."""

    @property
    def scores(self) -> np.ndarray | None:
        return self.prediction.scores if self.prediction is not None else None


@dataclass(slots=True)
class _Staged:
    """A batch after its look-up: what is left to decide."""

    fresh: list[tuple[Inbound, Transaction]]
    """The admitted first copies, to be scored."""
    copies: list[tuple[Inbound, Transaction, int]]
    """Second copies within the batch, each with its first copy's index in ``fresh``."""
    evidence: _Evidence


class _Draft(NamedTuple):
    """One fresh transaction's decision before it is written out."""

    msg: Inbound
    tx: Transaction
    score: float | None
    action: str
    words: list[str]
    rule: str
    tally: MerchantTally | None


class Scorer:
    def __init__(
        self,
        *,
        model: ScoringModel | None,
        rules: RuleSet,
        store: FeatureStore,
        cache: DecisionCache,
        limits: Limits = Limits(),
        model_budget_s: float = 0.05,
        wall_clock: Callable[[], float] = time.time,
        merchant_tally: Callable[[str], MerchantTally | None] = lambda merchant_id: None,
        admission: Admission | None = None,
        shadow: ScoringModel | None = None,
        drift: DriftMonitor | None = None,
        lookup: BatchLookup | None = None,
        round_trips: RoundTrips | None = None,
        placement: Placement | None = None,
    ) -> None:
        """``lookup``: the decision cache, admission and enrichment in one Redis
        call (pipeline/redis_batch.py); None makes them the separate calls in
        turn, as does a failed one call. ``cache``, ``store``, ``admission``
        and ``lookup`` are fixed here; ``round_trips`` is told each Redis round
        trip's time (the worker's metrics). ``placement``: the home partitions
        of ``transactions`` (a record elsewhere is re-routed, not decided:
        app/placement.py); None decides every record where it is."""
        self.model = model
        #: A candidate scored on the same rows after the batch is decided; never decides.
        self.shadow = shadow
        #: PSI of served scores and top features against the model's training reference.
        self.drift = drift
        self.rules = rules
        self.limits = limits
        self.model_budget_s = model_budget_s
        self.wall_clock = wall_clock
        #: Live confirmed-fraud tally per merchant (every worker's copy, agents/tally.py).
        self.merchant_tally = merchant_tally
        self._cache, self._store, self._admission, self._one_call = cache, store, admission, lookup
        self.round_trips = round_trips
        #: Swapped by the worker when the partition count of ``transactions`` changes.
        self.placement = placement
        separate = SeparateCalls(cache, store, admission, round_trips)
        self._lookup: BatchLookup = OneCallFirst(lookup, separate, round_trips) if lookup is not None else separate
        # NOTE: one thread: a prediction that overran its budget keeps the thread
        # busy, so the next batch also misses and degrades instead of piling up
        # CPU-bound work on 2 cores.
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # The shadow has a thread of its own: a shadow prediction that overruns
        # must never queue the next batch's deciding prediction behind it.
        self._shadow_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow")
        self._shadow_running: asyncio.Future[Any] | None = None
        self.shadow_skipped = 0
        """Batches left without shadow scores because the previous shadow prediction still ran."""

    @property
    def cache(self) -> DecisionCache:
        """The decision cache (the agent stores and holds decisions in it)."""
        return self._cache

    @property
    def store(self) -> FeatureStore:
        return self._store

    @property
    def admission(self) -> Admission | None:
        """Authentication, replay guard and rate limits; None trusts every producer."""
        return self._admission

    @property
    def lookup(self) -> BatchLookup | None:
        """The one-call lookup given (None: the separate calls only)."""
        return self._one_call

    def swap(self, **parts: Any) -> None:
        """Replace ``model``, ``rules``, ``shadow`` and/or ``drift``. Call between
        batches only (the agent does): a batch reads each of them several times
        and must see one version throughout."""
        for name, value in parts.items():
            if name not in ("model", "rules", "shadow", "drift"):
                raise TypeError(f"cannot swap {name!r}")
            setattr(self, name, value)

    async def warm_up(
        self, batch_sizes: Sequence[int] = (1, 8, 32), model: ScoringModel | None = None, shadow: bool = False
    ) -> None:
        """Predict once per size on the model thread itself, so the first real
        batch does not pay for that thread's lazy setup (it missed the budget).
        ``model`` warms a model about to be swapped in instead of the served one
        (``shadow``: on the shadow's thread)."""
        model = model or self.model
        if model is None:
            return
        loop = asyncio.get_running_loop()
        for size in batch_sizes:
            matrix = np.zeros((size, len(FEATURE_NAMES)), dtype=np.float32)
            await loop.run_in_executor(self._shadow_thread if shadow else self._model_thread, model.predict, matrix)

    async def score_batch(self, batch: Sequence[Inbound]) -> BatchOutput:
        try:
            return await self._score(batch)
        except Exception as exc:  # a bug must not cost the batch: reject each message loudly
            log.exception("scoring a batch of %d failed; rejecting it to the dead-letter topic", len(batch))
            return self._reject_all(batch, exc)

    async def _score(self, batch: Sequence[Inbound]) -> BatchOutput:
        clock = StageClock()
        now = self.wall_clock()
        out = BatchOutput()
        stats: Counter[str] = Counter(batch=len(batch))

        # 1. authenticate, then validate
        valid, requests = self._validate(batch, out, now, stats)
        clock.lap("validate")

        # 2. look up: cached decisions, admission, features (pipeline/lookup.py)
        answer = await self._lookup.look_up(requests, clock) if requests else NOTHING_FOUND
        staged = self._stage(valid, answer, out, now, stats, clock)

        # 3. ensemble under its budget
        await self._predict_under_budget(staged.evidence)
        clock.lap("model")

        # 4. rules and the decision
        drafts = self._decide(staged.fresh, staged.evidence)
        clock.lap("rules")

        # 5. emit: decisions with their feedback, in-batch copies, monitoring, the shadow's share
        self._emit(out, drafts, staged, stats, clock)
        return out

    def _validate(
        self, batch: Sequence[Inbound], out: BatchOutput, now: float, stats: Counter[str]
    ) -> tuple[list[tuple[Inbound, Transaction]], list[Request]]:
        """Authenticate and validate each message; rejections go to ``out`` here.
        Returns the valid ones and, index for index, what the look-up asks about them."""
        valid: list[tuple[Inbound, Transaction]] = []
        requests: list[Request] = []
        admission = self._admission
        for msg in batch:
            auth = admission.authenticate(msg.value, msg.headers, now) if admission else UNSIGNED
            if isinstance(auth, Rejection):
                self._refuse(out, msg, auth, now, stats)
                continue
            checked = validate(msg.value, now, self.limits)
            if isinstance(checked, Rejection):
                self._refuse(out, msg, checked, now, stats)
                continue
            home = self.placement.home(checked.user_id) if self.placement is not None else None
            if home is not None and msg.partition is not None and home != msg.partition:
                # Its resends may land at its home, whose resend index must see
                # it: decided there, after this transaction commits. Not
                # admitted here: the replay guard first sees it at its home.
                out.rerouted.append((home, replace(msg, key=checked.user_id.encode())))
                stats["rerouted"] += 1
                continue
            valid.append((msg, checked))
            requests.append(Request(checked, auth, f"{msg.partition}:{msg.offset}"))
        return valid, requests

    def _stage(
        self,
        valid: list[tuple[Inbound, Transaction]],
        answer: BatchAnswer,
        out: BatchOutput,
        now: float,
        stats: Counter[str],
        clock: StageClock,
    ) -> _Staged:
        """Apply the look-up's answer: cached decisions emitted, second copies
        set aside, the refused rejected (their copies with them), the features
        of the rest turned into rows; charged to ``cache``, ``validate`` and
        ``features`` on top of what the look-up lapped of its own calls (the
        one call laps nothing: all of it is ``cache``, so compare the sum of
        the three with the separate calls')."""
        for incident in answer.incidents:
            stats[incident] += 1
        fresh: list[tuple[Inbound, Transaction]] = []
        copies: list[tuple[Inbound, Transaction, int]] = []
        answered: list[tuple[Inbound, Transaction, dict[str, Any]]] = []
        verdicts: list[Rejection | None] = []
        in_fresh: dict[int, int] = {}  # index in valid -> index in fresh
        for i, ((msg, tx), hit, first) in enumerate(zip(valid, answer.hits, answer.follows)):
            if hit is not None:
                answered.append((msg, tx, hit))
                stats["cached"] += 1
            elif first is not None:
                copies.append((msg, tx, in_fresh[first]))
            else:
                in_fresh[i] = len(fresh)
                fresh.append((msg, tx))
                verdicts.append(answer.verdicts[i])
        clock.lap("cache")
        for msg, tx, hit in answered:  # emitted after the lap, so their latency shows every stage so far
            self._emit_cached(out, msg, tx, hit, clock)
        fresh, copies = self._apply_verdicts(fresh, copies, verdicts, out, now, stats)
        clock.lap("validate")
        evidence = self._evidence([tx for _, tx in fresh], answer)
        clock.lap("features")
        return _Staged(fresh, copies, evidence)

    def _evidence(self, txs: list[Transaction], answer: BatchAnswer) -> _Evidence:
        """The admitted transactions with their features and feature rows; no
        features (the batch degrades to rules) when the store failed."""
        evidence = _Evidence(txs, answer.unchecked)
        if txs:
            evidence.enrichments = answer.enrichments
            if answer.enrich_error is not None:
                evidence.degraded_reason = "feature store unavailable"
                log.warning("feature store failed (%r): %d decisions degrade to rules", answer.enrich_error, len(txs))
        self._feature_rows(evidence)
        return evidence

    def _feature_rows(self, evidence: _Evidence) -> None:
        """The feature rows of the enriched transactions (none if not enriched)."""
        # Night and weekend on the served model's clock (its manifest's zone); a
        # shadow scores the same rows, so lifecycle refuses a shadow in another zone.
        tz = getattr(self.model, "tz", None)
        evidence.rows = [
            feature_row(tx, e.profile, e.merchant, e.velocity, tz)
            for tx, e in zip(evidence.txs, evidence.enrichments or [])
        ]

    async def _predict_under_budget(self, evidence: _Evidence) -> None:
        """The ensemble's prediction for the rows, or the reason there is none."""
        evidence.matrix = feature_matrix(evidence.rows) if evidence.rows else None
        if evidence.matrix is not None and self.model is not None:
            evidence.prediction, evidence.degraded_reason = await self._predict(evidence.matrix)
        elif evidence.txs and self.model is None:
            evidence.degraded_reason = evidence.degraded_reason or "no model loaded"

    def _decide(self, fresh: list[tuple[Inbound, Transaction]], evidence: _Evidence) -> list[_Draft]:
        """Rules over each score (or none: degraded), the action and its explanation."""
        prediction, rows, scores = evidence.prediction, evidence.rows, evidence.scores
        drafts = []
        for i, (msg, tx) in enumerate(fresh):
            score = float(scores[i]) if scores is not None else None
            tally = self._tally(tx.merchant_id)
            outcome = evaluate_rules(self.rules, tx, score, tally)
            reasons = prediction.reasons[i] if prediction is not None and prediction.reasons else []
            words = explain(reasons, rows[i], outcome.hits) if rows else list(outcome.hits)
            if score is None:
                words.append(f"degraded: {evidence.degraded_reason}")
            action = outcome.action
            if tx.transaction_id in evidence.unchecked:
                # Maybe a resend of a payment decided before: never approve what
                # might have been declined (pipeline/cache.py, LocalFirstCache).
                action = "review" if action == "approve" else action
                words.append(PROVISIONAL_REASON)
            drafts.append(_Draft(msg, tx, score, action, words, outcome.rule, tally))
        return drafts

    def _emit(
        self, out: BatchOutput, drafts: list[_Draft], staged: _Staged, stats: Counter[str], clock: StageClock
    ) -> None:
        """Decisions with their feedback, the in-batch copies, monitoring, the shadow's share."""
        evidence = staged.evidence
        records, feedback_docs = self._emit_decisions(out, drafts, evidence, clock, stats)
        for msg, tx, first in staged.copies:  # resent within this very batch
            self._emit_cached(out, msg, tx, records[first], clock)
            stats["cached"] += 1
        self._emit_monitoring(out, stats, clock, evidence)
        if self.shadow is not None and evidence.matrix is not None:
            tallies = [draft.tally for draft in drafts]
            out.shadow = _ShadowWork(
                self.shadow, evidence.matrix, evidence.txs, tallies, list(range(len(out.feedback))), feedback_docs,
                [draft.action for draft in drafts],
            )

    def _emit_decisions(
        self, out: BatchOutput, drafts: list[_Draft], evidence: _Evidence, clock: StageClock, stats: Counter[str]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Each draft's decision (also to cache) and feedback record; returns both
        documents, index for index with ``drafts``."""
        decided = self.wall_clock()
        records: list[dict[str, Any]] = []
        feedback_docs: list[dict[str, Any]] = []
        for i, draft in enumerate(drafts):
            msg, tx, score, action = draft.msg, draft.tx, draft.score, draft.action
            enrichment = evidence.enrichments[i] if evidence.enrichments else None
            decision = Decision(
                transaction_id=tx.transaction_id,
                user_id=tx.user_id,
                fraud_score=round(score, 6) if score is not None else _fallback_score(action),
                action=action,  # type: ignore[arg-type]
                explanation=draft.words,
                model_version=self.model.version if score is not None and self.model else None,
                rules_version=self.rules.version,
                degraded=score is None,
                feature_age_s=_round(enrichment.feature_age_s(tx.timestamp)) if enrichment else None,
                latency_ms=self._latency(msg, clock, decided),
                correlation_id=msg.correlation_id,
                decided_at=decided,
                provisional=tx.transaction_id in evidence.unchecked,
            )
            record = decision.to_dict()
            records.append(record)
            blob = orjson.dumps(record)
            if msg.partition is not None:
                # Its record in ``decisions`` is its index entry's changelog: the header adds the content hash.
                out.decide(msg, tx.transaction_id.encode(), blob, [ResendIndex.entry_header(tx)])
                out.indexed.append((tx, orjson.dumps(indexed_value(record))))
            else:
                out.decide(msg, tx.transaction_id.encode(), blob)
            out.outcomes[(action, False)] += 1
            out.to_cache.append((tx, blob))
            row = evidence.rows[i] if evidence.rows else None
            doc = self._feedback(tx, orjson.Fragment(blob), row, draft.rule, draft.tally)
            feedback_docs.append(doc)
            out.add("feedback", tx.transaction_id.encode(), orjson.dumps(doc))
            stats[action] += 1
            stats["degraded"] += score is None
            stats["provisional"] += tx.transaction_id in evidence.unchecked
        return records, feedback_docs

    def _emit_monitoring(self, out: BatchOutput, stats: Counter[str], clock: StageClock, evidence: _Evidence) -> None:
        """The batch's monitoring record, plus a drift window when one closes."""
        scores = evidence.scores
        out.monitoring = self._monitoring(stats, clock, scores, evidence.degraded_reason if stats["degraded"] else None)
        if self.drift is not None and scores is not None and evidence.matrix is not None:
            window = self.drift.observe(evidence.matrix, scores)
            if window is not None:
                out.extra_monitoring.append(orjson.dumps({**window, "at": self.wall_clock()}))

    async def finish(self, out: BatchOutput) -> None:
        """Score the batch with the shadow model and add its verdict to the
        feedback records (``shadow``: version, score, the action the rules would
        have taken with it) plus a ``shadow`` monitoring record.

        Called by the agent before the batch is sent, so that its verdict
        rides in the batch's transaction; it never changes a decision. It runs on its own
        thread, scores only, under the model budget; a shadow that fails or
        runs late only leaves the records without it, and while a late one is
        still running the following batches skip the shadow (counted in
        ``shadow_skipped``) rather than queue behind it.
        """
        work, out.shadow = out.shadow, None
        if work is None:
            return
        try:
            await self._shadow(out, work)
        except Exception:  # NOTE: a raise would stop the scoring loop: the shadow must never cost a batch
            log.exception("shadow model %s: batch left without shadow scores", work.model.version)

    async def _shadow(self, out: BatchOutput, work: _ShadowWork) -> None:
        loop = asyncio.get_running_loop()
        if self._shadow_running is not None and not self._shadow_running.done():
            self.shadow_skipped += 1
            return
        started = time.perf_counter()
        try:
            future = loop.run_in_executor(self._shadow_thread, _predict_scores, work.model, work.matrix)
            self._shadow_running = future
            # shield: a timeout stops the wait, not the thread; the future tells when it is free again
            scores = await asyncio.wait_for(asyncio.shield(future), self.model_budget_s)
        except Exception as exc:  # timeouts included: the shadow is optional
            log.warning("shadow model %s gave no scores for a batch (%r)", work.model.version, exc)
            return
        shadow_ms = round((time.perf_counter() - started) * 1000, 3)
        actions: Counter[str] = Counter()
        for i, (tx, tally) in enumerate(zip(work.txs, work.tallies)):
            score = float(scores[i])
            doc = work.docs[i]
            action = evaluate_rules(self.rules, tx, score, tally).action
            actions[f"{work.served[i]}->{action}"] += 1
            doc["shadow"] = {"model_version": work.model.version, "fraud_score": round(score, 6), "action": action}
            key, _ = out.feedback[work.feedback_at[i]]
            out.feedback[work.feedback_at[i]] = (key, orjson.dumps(doc))
        hist = score_histogram(scores)
        out.extra_monitoring.append(orjson.dumps({
            "kind": "shadow",
            "at": self.wall_clock(),
            "model_version": self.model.version if self.model else None,
            "shadow_version": work.model.version,
            "rows": len(work.txs),
            "shadow_ms": shadow_ms,
            "shadow_skipped_batches": self.shadow_skipped,
            "served_to_shadow_actions": dict(actions),
            "score_histogram": {"bins": _SCORE_BIN_LABELS, "counts": hist},
        }))  # fmt: skip

    def _apply_verdicts(
        self,
        fresh: list[tuple[Inbound, Transaction]],
        copies: list[tuple[Inbound, Transaction, int]],
        verdicts: list[Rejection | None],
        out: BatchOutput,
        now: float,
        stats: Counter[str],
    ) -> tuple[list[tuple[Inbound, Transaction]], list[tuple[Inbound, Transaction, int]]]:
        """Reject the refused (and their in-batch copies); the admitted, with
        their copies' first copies renumbered."""
        kept: list[tuple[Inbound, Transaction]] = []
        moved: dict[int, int] = {}
        for i, ((msg, tx), verdict) in enumerate(zip(fresh, verdicts)):
            if verdict is None:
                moved[i] = len(kept)
                kept.append((msg, tx))
            else:
                self._refuse(out, msg, verdict, now, stats)
        still: list[tuple[Inbound, Transaction, int]] = []
        for msg, tx, first in copies:
            if first in moved:
                still.append((msg, tx, moved[first]))
            else:  # its first copy was refused: so is this one
                self._reject(out, msg, verdicts[first] or Rejection("internal_error", None, "lost leader"), now)
                stats["rejected"] += 1
        return kept, still

    def _refuse(self, out: BatchOutput, msg: Inbound, why: Rejection, now: float, stats: Counter[str]) -> None:
        """Reject ``msg`` (``_reject``), counted with its code."""
        self._reject(out, msg, why, now)
        stats["rejected"] += 1
        stats[f"rejected_{why.code}"] += 1

    def _tally(self, merchant_id: str) -> MerchantTally | None:
        try:
            return self.merchant_tally(merchant_id)
        except Exception:  # a table read must never cost a decision
            log.exception("reading the merchant tally failed")
            return None

    def _emit_cached(
        self, out: BatchOutput, msg: Inbound, tx: Transaction, hit: dict[str, Any], clock: StageClock
    ) -> None:
        record = dict(hit)
        record.update(
            transaction_id=tx.transaction_id,
            cached=True,
            correlation_id=msg.correlation_id,
            latency_ms=self._latency(msg, clock, self.wall_clock()),
        )
        out.decide(msg, tx.transaction_id.encode(), orjson.dumps(record))
        out.outcomes[(str(record.get("action")), True)] += 1

    async def _predict(self, matrix: np.ndarray) -> tuple[Prediction | None, str | None]:
        assert self.model is not None
        loop = asyncio.get_running_loop()
        # Reasons for the rows the rules will not approve on score alone; an
        # approval is explained by its score under the review threshold.
        explain_above = self.rules.review_threshold
        # A model with scores cheap enough for the loop (compiled trees) answers a
        # batch that needs no reasons here: the hand-off to the model thread and
        # back (a submit, then a wake-up of the loop) cost more than the trees.
        inline = getattr(self.model, "inline_scores", None)
        if inline is not None:
            try:
                scores = inline(matrix)
            except Exception:
                log.exception("inline scores failed; predicting on the model thread")
                scores = None
            if scores is not None and not np.any(scores >= explain_above):
                return Prediction(scores, []), None
        future = loop.run_in_executor(self._model_thread, self.model.predict, matrix, explain_above)
        try:
            return await asyncio.wait_for(future, self.model_budget_s), None
        except TimeoutError:
            log.warning("ensemble missed its %.0f ms budget; batch decided by rules", self.model_budget_s * 1000)
            return None, f"model over its {self.model_budget_s * 1000:.0f} ms budget"
        except Exception as exc:
            log.exception("ensemble failed; batch decided by rules")
            return None, f"model failed: {type(exc).__name__}"

    def _latency(self, msg: Inbound, clock: StageClock, decided: float) -> dict[str, float]:
        stages = dict(clock.ms)
        queue = max(0.0, (clock.started_wall(decided) - msg.timestamp) * 1000) if msg.timestamp else 0.0
        stages["queue_wait"] = round(queue, 3)
        stages["total"] = round(queue + clock.elapsed_ms(), 3)
        return stages

    def _reject(self, out: BatchOutput, msg: Inbound, why: Rejection, now: float) -> None:
        if why.transaction_id is not None:
            decision = Decision(
                transaction_id=why.transaction_id,
                user_id=why.user_id,
                fraud_score=0.0,
                action="reject",
                explanation=[f"{why.code}: {why.reason}"],
                model_version=None,
                rules_version=self.rules.version,
                correlation_id=msg.correlation_id,
                decided_at=now,
                error=why.to_dict(),
            )
            out.decide(msg, why.transaction_id.encode(), orjson.dumps(decision.to_dict()))
            out.outcomes[("reject", False)] += 1
        out.add(
            "dead_letters",
            why.transaction_id.encode() if why.transaction_id else None,
            orjson.dumps(
                {
                    "error": why.to_dict(),
                    "transaction_id": why.transaction_id,
                    **self._kept_bytes(msg),
                    "partition": msg.partition,
                    "offset": msg.offset,
                    "rejected_at": now,
                }
            ),
        )

    def _kept_bytes(self, msg: Inbound) -> dict[str, Any]:
        """The original value and headers for the dead letter, whole when they
        are within the message limit. NOTE: a larger value is kept as a prefix
        plus its size and sha256: its base64 could exceed the producer's request
        limit, the dead letter could not be produced, and the worker would stop
        on that record again after every restart. The record itself stays in
        ``transactions`` at the partition and offset given."""
        value = msg.value
        kept: dict[str, Any] = {"value_bytes": len(value)}
        if len(value) > self.limits.max_message_bytes:
            kept["value_sha256"] = hashlib.sha256(value).hexdigest()
            kept["value_truncated"] = True
            value = value[:DLQ_PREFIX_BYTES]
        kept["value_b64"] = base64.b64encode(value).decode()
        kept["headers"] = {
            k[:MAX_HEADER_NAME]: base64.b64encode(v[:DLQ_PREFIX_BYTES]).decode()
            for k, v in list(msg.headers.items())[:MAX_DLQ_HEADERS]
        }
        return kept

    def _reject_all(self, batch: Sequence[Inbound], exc: Exception) -> BatchOutput:
        out = BatchOutput()
        now = self.wall_clock()
        for msg in batch:
            checked = validate(msg.value, now, self.limits)
            txid = checked.transaction_id if not isinstance(checked, Rejection) else checked.transaction_id
            user = checked.user_id
            why = Rejection("internal_error", None, f"scoring failed: {type(exc).__name__}", txid, user)
            self._reject(out, msg, why, now)
        return out

    def _feedback(
        self,
        tx: Transaction,
        decision: orjson.Fragment,
        row: list[float] | None,
        rule: str,
        tally: MerchantTally | None,
    ) -> dict[str, Any]:
        """Everything needed later to judge, retrain on and backtest this
        decision: the decision record as sent (``decision``: its bytes, not
        serialised again), the served vector, the transaction, the rule that
        decided and the merchant tally the rules saw."""
        return {
            "decision": decision,
            # NOTE: the dataclass itself: orjson writes its fields as an object, in C.
            "transaction": tx,
            "feature_set": FEATURE_SET_VERSION,
            # NOTE: a NaN feature (a field not sent) is written null, as JSON has no
            # NaN: orjson does that itself (a scan of each row for NaN was ~6 % of the scorer's samples).
            "features": dict(zip(FEATURE_NAMES, row)) if row is not None else None,
            "rule": rule,
            "merchant_tally": {"fraud": tally.fraud, "legit": tally.legit} if tally is not None else None,
        }

    def _monitoring(
        self, stats: Counter[str], clock: StageClock, scores: np.ndarray | None, degraded_reason: str | None
    ) -> dict[str, Any]:
        hist = score_histogram(scores) if scores is not None and len(scores) else []
        return {
            "kind": "batch",
            "at": self.wall_clock(),
            "model_version": self.model.version if self.model else None,
            "rules_version": self.rules.version,
            "shadow_version": self.shadow.version if self.shadow else None,
            "counts": dict(stats),
            "degraded_reason": degraded_reason,
            "stage_ms": clock.ms,
            "score_histogram": {"bins": _SCORE_BIN_LABELS, "counts": hist},
        }


def _predict_scores(model: ScoringModel, matrix: np.ndarray) -> np.ndarray:
    """Scores only: a shadow needs no explanations."""
    return model.predict(matrix, explain_above=None).scores


def _fallback_score(action: str) -> float:
    # Degraded decisions have no model score: report what the rules concluded.
    return {"decline": 1.0, "review": 0.5}.get(action, 0.0)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
