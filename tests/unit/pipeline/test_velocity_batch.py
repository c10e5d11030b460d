"""The batch velocity code returns, row for row, what the per-row definition does.

The reference below is the definition written the plainest way (sort, keep the
newest ``VELOCITY_MAX_EVENTS`` up to the transaction, count and sum per window);
:func:`pipeline.features.velocity_batch` computes a whole batch with array
operations, and the training path's vectorised columns apply the same cap
(tests/unit/pipeline/test_batch_features.py holds training and serving equal).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.feature_defs import VELOCITY_MAX_EVENTS, VELOCITY_WINDOWS_S
from pipeline.features import velocity_batch, velocity_from_events

NOW = 1_800_000_000.0


def reference(times: list[float], amounts: list[float], now: float) -> tuple[float, ...]:
    events = sorted(((t, a) for t, a in zip(times, amounts) if t <= now), key=lambda e: -e[0])
    kept = events[:VELOCITY_MAX_EVENTS]
    counts = [float(sum(1 for t, _ in kept if t > now - w)) for w in VELOCITY_WINDOWS_S]
    sums = [float(sum(a for t, a in kept if t > now - w)) for w in VELOCITY_WINDOWS_S]
    return (*counts, *sums)


# Offsets from "now": whole seconds, so that no two events tie at the cap's edge
# unless drawn equal (ties are broken differently by sorts; the values are not).
offsets = st.lists(st.integers(min_value=-90_000, max_value=600), unique=True, max_size=80)
row = offsets.flatmap(
    lambda offs: st.tuples(
        st.just(offs), st.lists(st.integers(1, 5000), min_size=len(offs), max_size=len(offs))
    )
)


@settings(max_examples=150, deadline=None)
@given(st.lists(row, min_size=1, max_size=12))
def test_a_batch_is_each_row_computed_alone(rows: list[tuple[list[int], list[int]]]) -> None:
    times = np.array([NOW + o for offs, _ in rows for o in offs], dtype=np.float64)
    amounts = np.array([a / 100 for _, amts in rows for a in amts], dtype=np.float64)
    lengths = np.array([len(offs) for offs, _ in rows])
    nows = np.full(len(rows), NOW)
    got = velocity_batch(times, amounts, lengths, nows)
    for i, (offs, amts) in enumerate(rows):
        want = reference([NOW + o for o in offs], [a / 100 for a in amts], NOW)
        assert np.allclose(got[i], want), (i, got[i], want)
        assert np.allclose(velocity_from_events(np.array([NOW + o for o in offs]), np.array([a / 100 for a in amts]), NOW), want)


def test_a_hammered_card_counts_its_newest_events_only() -> None:
    # 100 payments in the last 100 s: the 10-minute count stops at the cap, and
    # the sum is of the newest ones (amount = seconds ago + 1).
    times = NOW - np.arange(100, dtype=np.float64)
    amounts = np.arange(100, dtype=np.float64) + 1
    counts_and_sums = velocity_from_events(times, amounts, NOW)
    assert counts_and_sums[0] == VELOCITY_MAX_EVENTS
    assert counts_and_sums[len(VELOCITY_WINDOWS_S)] == sum(range(1, VELOCITY_MAX_EVENTS + 1))


def test_events_after_the_transaction_do_not_count_nor_take_a_place_under_the_cap() -> None:
    later = NOW + np.arange(1, 50, dtype=np.float64)
    earlier = np.array([NOW - 5.0])
    times = np.concatenate([later, earlier])
    result = velocity_from_events(times, np.ones(len(times)), NOW)
    assert result[0] == 1.0
