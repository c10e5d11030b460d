"""The XGBoost ensemble (implements :class:`pipeline.model.ScoringModel`).

A model is loaded once (checksums verified, warmed up) and then called with the
batch's float32 feature matrix in :data:`pipeline.features.FEATURE_NAMES` order.
It returns one fraud probability per row and, per row, the features that
pushed the score up most. Contributions use XGBoost's *approximate* per-tree
attribution: exact TreeSHAP costs ~170 ms per batch of 32 here, the approximate
one ~2 ms (measured on the 2-core development machine).

The members' margins are combined by the version's :class:`models.combination.Combination`
(stacked logistic regression; versions from before stacking: the weighted mean
of probabilities they were trained as). A stacked version is served from one
booster holding every member's trees, weighted (:func:`merge_members`): one
predict call per batch instead of one per member.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import tzinfo
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import xgboost as xgb

from models.combination import MEAN, STACKED, Combination
from models.compiled import CompiledTrees
from pipeline.features import FEATURE_NAMES
from pipeline.model import Prediction, ScoringModel

__all__ = ["Member", "Prediction", "ScoringModel", "XGBoostEnsemble"]

TOP_K = 3


@dataclass
class Member:
    name: str
    booster: xgb.Booster
    weight: float
    feature_names: tuple[str, ...]

    def __post_init__(self) -> None:
        self.columns = np.array([FEATURE_NAMES.index(n) for n in self.feature_names], dtype=np.intp)


class XGBoostEnsemble:
    """The members' margins, combined."""

    def __init__(
        self,
        version: str,
        members: Sequence[Member],
        threads: int = 1,
        thresholds: dict[str, float] | None = None,
        timezone: str = "UTC",
        combination: Combination | None = None,
    ) -> None:
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.version = version
        #: The zone whose wall clock the model's night/weekend features were
        #: trained on; the scorer computes them on it too (None: UTC).
        self.timezone = timezone
        self.tz: tzinfo | None = None if timezone == "UTC" else ZoneInfo(timezone)
        self.members = list(members)
        #: Thresholds the evaluation suggested; the rules file has the final say.
        self.thresholds = dict(thresholds or {})
        self.combination = combination or Combination(MEAN, tuple(m.weight for m in self.members))
        if len(self.combination.weights) != len(self.members):
            raise ValueError(f"{len(self.members)} members, {len(self.combination.weights)} combination weights")
        # A member the combination gives no weight is never run: it would cost a
        # predict call per batch for nothing.
        self.active = [i for i, w in enumerate(self.combination.weights) if w > 0]
        weights = np.array(self.combination.weights, dtype=np.float64)
        #: Each member's say on the log-odds scale (stacked) or in the mean (legacy).
        self.weights = weights if self.combination.kind != MEAN else weights / weights.sum()
        for member in self.members:
            # NOTE: one thread per predict: on 2 cores the worker's event loop
            # needs the other one, and batches of 32 do not parallelise well.
            member.booster.set_param({"nthread": threads})
        #: Stacked versions: every member's trees in one booster (see merge_members).
        self.merged: xgb.Booster | None = None
        if self.combination.kind == STACKED and self.active:
            self.merged = merge_members(self.members, self.active, self.weights, self.combination.intercept)
            self.merged.set_param({"nthread": threads})
        #: The merged booster compiled to C (models/compiled.py), once attached.
        self.compiled: CompiledTrees | None = None

    def use_compiled(self, compiled: CompiledTrees) -> None:
        """Score with ``compiled`` from now on (it was checked against the merged
        booster). Any thread may call it: the next prediction picks it up."""
        self.compiled = compiled

    def inline_scores(self, features: np.ndarray) -> np.ndarray | None:
        """Scores cheap enough to compute on the caller's thread (the compiled
        trees: ~0.025 ms for a row, ~0.25 ms for 64), or None until they are
        attached: the caller then uses :meth:`predict` on its model thread."""
        compiled = self.compiled
        if compiled is None:
            return None
        return _probabilities(compiled.margin(np.ascontiguousarray(features, dtype=np.float32)))

    def predict(self, features: np.ndarray, explain_above: float | None = 0.0) -> Prediction:
        """Scores for every row; reasons for the rows scoring at least
        ``explain_above`` (0.0: every row, None: none).

        NOTE: each XGBoost call costs ~0.3-0.5 ms however few rows it has
        (Python wrapper, DMatrix, OpenMP), and approximate contributions cost
        ~3x a plain margin at 32 rows. So scores come from the compiled trees
        once attached (models/compiled.py), else from one ``inplace_predict``
        margin (no DMatrix) of the merged booster (:func:`merge_members`; a
        version from before stacking: one per member), and contributions are
        computed only for the rows that need reasons: the worker asks for those
        at or above the review threshold (an approval's explanation is the score
        under it). Merging took the scoring stage's model time at one row from
        2.6-3.1 to 1.6-1.7 ms and at 32 rows from 3.8-4.7 to 2.7-2.8 ms
        (``python -m bench.scorer --paths members merged --rounds 2``).
        A batch of 32 went from 7.2 ms (contributions for every row) to 1.6 ms
        with no row flagged and 3.0 ms with one (2 cores, 3 members of 300-400
        trees, quiet machine). The stacked 4 members (150-tree boosters and a
        50-tree forest): median 2.5 ms with no row flagged, 5.6 ms with one,
        against 3.5 and 7.1 ms for those 3 members measured beside them
        (load average 1.4).
        """
        features = np.ascontiguousarray(features, dtype=np.float32)
        n = features.shape[0]
        compiled = self.compiled
        if compiled is not None:
            scores = _probabilities(compiled.margin(features))
        elif self.merged is not None:
            scores = _probabilities(self.merged.inplace_predict(features, missing=np.nan, predict_type="margin"))
        else:
            scores = np.clip(self.combination.score(self.member_margins(features)), 0.0, 1.0)
        if explain_above is None:
            return Prediction(scores, [])
        rows = np.flatnonzero(scores >= explain_above)
        reasons: list[list[tuple[str, float]]] = [[] for _ in range(n)]
        if len(rows):
            for row, why in zip(rows, _top_reasons(self.contributions(features[rows]))):
                reasons[row] = why
        return Prediction(scores, reasons)

    def member_margins(self, features: np.ndarray) -> np.ndarray:
        """Each member's margin (log-odds), one column per member (0 for an inactive one)."""
        margins = np.zeros((features.shape[0], len(self.members)), dtype=np.float64)
        for i in self.active:
            member = self.members[i]
            margins[:, i] = member.booster.inplace_predict(
                np.ascontiguousarray(features[:, member.columns]), missing=np.nan, predict_type="margin"
            )
        return margins

    def contributions(self, features: np.ndarray, *, merged: bool = True) -> np.ndarray:
        """Per row and feature, its approximate contribution to the combined score
        (stacked: to the log-odds; they add up to it, less the bias)."""
        if merged and self.merged is not None:
            matrix = xgb.DMatrix(features, missing=np.nan, nthread=1)
            return np.asarray(self.merged.predict(matrix, pred_contribs=True, approx_contribs=True))[:, :-1]
        out = np.zeros((features.shape[0], len(FEATURE_NAMES)), dtype=np.float64)
        for i in self.active:
            member, weight = self.members[i], self.weights[i]
            matrix = xgb.DMatrix(np.ascontiguousarray(features[:, member.columns]), missing=np.nan, nthread=1)
            contrib = member.booster.predict(matrix, pred_contribs=True, approx_contribs=True)
            # Stacked: the ensemble's log-odds are sum(w_i * margin_i), so these add up to it exactly.
            out[:, member.columns] += weight * contrib[:, :-1]  # last column: the bias
        return out

    def warm_up(self, batch_sizes: Sequence[int] = (1, 8, 32, 64), rounds: int = 3) -> None:
        """Run predictions once so the first real batch does not pay for lazy setup."""
        rng = np.random.default_rng(0)
        for size in batch_sizes:
            for _ in range(rounds):
                self.predict(rng.random((size, len(FEATURE_NAMES)), dtype=np.float32))


def merge_members(members: Sequence[Member], active: Sequence[int], weights: np.ndarray, intercept: float) -> xgb.Booster:
    """A stacked ensemble as one XGBoost booster: each member's trees, their
    split features mapped from the member's columns to :data:`FEATURE_NAMES`
    and their leaf values scaled by the member's weight, the base margin
    ``intercept + sum(w_i * base_i)``. Its margin is the combination's log-odds,
    and its approximate contributions are the weighted members' (both linear in
    the leaf values).

    Why: each XGBoost predict call costs ~0.3-0.5 ms however few rows it has, so
    four members cost four of them per batch; merged, the scoring stage's model
    time fell from 2.6-3.1 to 1.6-1.7 ms at one row (``python -m bench.scorer
    --paths members merged``). Built at load time from the registered UBJSON,
    which stays the source of truth; ``tests/unit/models/test_registry.py`` holds its
    scores to the members' combination within 1e-5.
    """
    doc: dict[str, Any] | None = None
    trees: list[dict[str, Any]] = []
    base = float(intercept)
    for i in active:
        member, weight = members[i], float(weights[i])
        model = json.loads(bytes(member.booster.save_raw("json")))
        learner = model["learner"]
        if learner["objective"]["name"] != "binary:logistic" or learner["gradient_booster"]["name"] != "gbtree":
            raise ValueError(f"member {member.name}: only binary:logistic gbtree members can be merged")
        doc = doc or model
        base_score = float(str(learner["learner_model_param"]["base_score"]).strip("[]"))
        base += weight * math.log(base_score / (1.0 - base_score))
        for tree in learner["gradient_booster"]["model"]["trees"]:
            left = tree["left_children"]
            if tree.get("categories_nodes"):
                raise ValueError(f"member {member.name}: categorical splits cannot be merged")
            leaf = [child == -1 for child in left]
            trees.append({
                **tree,
                "split_indices": [0 if is_leaf else int(member.columns[f]) for f, is_leaf in zip(tree["split_indices"], leaf)],
                "split_conditions": [v * weight if is_leaf else v for v, is_leaf in zip(tree["split_conditions"], leaf)],
                "base_weights": [v * weight for v in tree["base_weights"]],
                "tree_param": {**tree["tree_param"], "num_feature": str(len(FEATURE_NAMES))},
            })  # fmt: skip
    assert doc is not None, "no active member"
    for k, tree in enumerate(trees):
        tree["id"] = k
    learner = doc["learner"]
    gbtree = learner["gradient_booster"]["model"]
    # One tree per boosting round: a forest member's parallel trees add up the same way.
    gbtree.update(
        trees=trees, tree_info=[0] * len(trees), iteration_indptr=list(range(len(trees) + 1)),
        gbtree_model_param={"num_parallel_tree": "1", "num_trees": str(len(trees))},
    )  # fmt: skip
    learner["learner_model_param"]["num_feature"] = str(len(FEATURE_NAMES))
    learner["learner_model_param"]["base_score"] = f"[{1.0 / (1.0 + math.exp(-base)):.9E}]"
    learner["feature_names"], learner["feature_types"] = [], []
    learner["attributes"] = {}  # e.g. a best_iteration of the first member would cut the others' trees
    return xgb.Booster(model_file=bytearray(json.dumps(doc).encode()))


def _probabilities(margin: np.ndarray) -> np.ndarray:
    return np.clip(1.0 / (1.0 + np.exp(-np.asarray(margin, dtype=np.float64))), 0.0, 1.0)


def _top_reasons(contributions: np.ndarray) -> list[list[tuple[str, float]]]:
    order = np.argsort(-contributions, axis=1)[:, :TOP_K]
    out = []
    for row, idx in zip(contributions, order):
        out.append([(FEATURE_NAMES[i], float(row[i])) for i in idx if row[i] > 0])
    return out
