"""The Fraud Detection Handbook's 15 baseline features, as its own code defines them.

The in-run baseline (:func:`models.training.fit_and_register`) is the Handbook's
plain XGBoost on these features, so the ensemble's gain is measured against the
Handbook's model and not against a weaker copy of it. The Handbook
(Le Borgne et al., chapter 3, "Baseline feature transformation") computes, per
transaction at time ``t``:

* ``TX_AMOUNT``; ``TX_DURING_WEEKEND`` (Saturday, Sunday); ``TX_DURING_NIGHT``
  (hour <= 6, i.e. before 07:00);
* per customer, for w = 1, 7, 30 days: the number of transactions and their
  average amount over ``(t - w, t]``: ``rolling('<w>d')`` on the transaction
  datetime, so the window *ends at and includes* the transaction itself;
* per terminal, for w = 1, 7, 30 days, shifted back by a delay d = 7 days (the
  labels of the last week are not known yet): the number of transactions and
  the fraud rate over ``(t - d - w, t - d]``, computed as ``rolling('<d+w>d')``
  minus ``rolling('<d>d')``; a window without transactions has risk 0
  (``fillna(0)``).

Here the customer is ``user_id``, the terminal ``merchant_id``, the amount
``amount_usd`` and the fraud flag ``label`` (:func:`pipeline.features.prepare_history`
rows). Computed vectorised: per entity, rows sorted by time, each window's left
edge found with one ``searchsorted`` over a key that orders entity, then time.
"""

from __future__ import annotations

from datetime import tzinfo

import numpy as np
import pandas as pd

__all__ = ["HANDBOOK_FEATURE_NAMES", "TERMINAL_DELAY_DAYS", "WINDOWS_DAYS", "handbook_features"]

DAY_S = 86400.0
#: The Handbook's windows and its terminal delay (``delay_period=7``).
WINDOWS_DAYS = (1, 7, 30)
TERMINAL_DELAY_DAYS = 7

HANDBOOK_FEATURE_NAMES: tuple[str, ...] = (
    "TX_AMOUNT", "TX_DURING_WEEKEND", "TX_DURING_NIGHT",
    *(f"CUSTOMER_ID_{kind}_{w}DAY_WINDOW" for w in WINDOWS_DAYS for kind in ("NB_TX", "AVG_AMOUNT")),
    *(f"TERMINAL_ID_{kind}_{w}DAY_WINDOW" for w in WINDOWS_DAYS for kind in ("NB_TX", "RISK")),
)  # fmt: skip


def handbook_features(
    history: pd.DataFrame, start: float, end: float, tz: tzinfo | None = None
) -> np.ndarray:
    """The 15 features (:data:`HANDBOOK_FEATURE_NAMES` order) of the ``history``
    rows with ``start <= ts < end``, in their order (as
    :func:`pipeline.features.training_matrix` returns its rows). Windows reach
    back into the rows before ``start``; nothing at or after ``end`` is read.
    ``tz``: the wall clock of weekend and night (None: UTC)."""
    ts_all = history["ts"].to_numpy(dtype=np.float64)
    stop = int(np.searchsorted(ts_all, end, side="left"))
    first = int(np.searchsorted(ts_all, start, side="left"))
    upto = history.iloc[:stop]
    ts = ts_all[:stop]
    amount = upto["amount_usd"].to_numpy(dtype=np.float64)
    fraud = (upto["label"].to_numpy() > 0).astype(np.float64) if "label" in upto else np.zeros(stop)
    out = np.empty((stop - first, len(HANDBOOK_FEATURE_NAMES)), dtype=np.float64)
    out[:, 0] = amount[first:]
    local = pd.to_datetime(ts[first:], unit="s", utc=True)
    if tz is not None:
        local = local.tz_convert(tz)
    out[:, 1] = np.asarray(local.dayofweek >= 5, dtype=np.float64)
    out[:, 2] = np.asarray(local.hour <= 6, dtype=np.float64)
    column = 3
    customer = _Rolling(upto["user_id"], ts)
    for w in WINDOWS_DAYS:
        count, total = customer.trailing(w * DAY_S, amount)
        out[:, column] = count[first:]
        out[:, column + 1] = (total / count)[first:]  # count >= 1: the transaction itself
        column += 2
    terminal = _Rolling(upto["merchant_id"], ts)
    delay = TERMINAL_DELAY_DAYS * DAY_S
    count_delay, frauds_delay = terminal.trailing(delay, fraud)
    for w in WINDOWS_DAYS:
        count_all, frauds_all = terminal.trailing(delay + w * DAY_S, fraud)
        count, frauds = count_all - count_delay, frauds_all - frauds_delay
        with np.errstate(invalid="ignore", divide="ignore"):
            risk = np.where(count > 0, frauds / np.where(count > 0, count, 1.0), 0.0)
        out[:, column] = count[first:]
        out[:, column + 1] = risk[first:]
        column += 2
    return out


class _Rolling:
    """Rows grouped by an entity, each group in time order, for trailing windows."""

    def __init__(self, entity: pd.Series, ts: np.ndarray) -> None:
        codes = pd.factorize(entity, sort=False)[0].astype(np.int64)
        # NOTE: stable: rows with the same time keep their order, and pandas'
        # rolling counts a row's window up to the row itself, not past its ties.
        self.order = np.lexsort((np.arange(len(ts)), ts, codes))
        self.codes = codes[self.order]
        self.ts = ts[self.order]
        # Entity first, then time: one sorted key for all entities. The span
        # leaves room below the earliest window's left edge.
        span = (float(ts.max() - ts.min()) if len(ts) else 0.0) + 40 * DAY_S
        self.base = float(ts.min()) if len(ts) else 0.0
        self.span = span
        self.keys = self.codes * span + (self.ts - self.base)

    def trailing(self, window_s: float, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row (original order): the count of its entity's rows in
        ``(t - window_s, t]`` up to the row itself, and the sum of ``values`` over them."""
        n = len(self.ts)
        position = np.arange(n)
        left = np.searchsorted(self.keys, self.codes * self.span + (self.ts - window_s - self.base), side="right")
        sums = np.concatenate(([0.0], np.cumsum(values[self.order])))
        count_sorted = (position + 1 - left).astype(np.float64)
        sum_sorted = sums[position + 1] - sums[left]
        count, total = np.empty(n), np.empty(n)
        count[self.order], total[self.order] = count_sorted, sum_sorted
        return count, total
