"""What any model could reach on a simulated test week (``python -m bench.model_ceiling``).

On the simulator's Handbook scenarios, a compromised terminal's fraud looks like
legitimate traffic in every column (customer, amount, time: the simulator draws
them as for any transaction); only the terminal's labels tell it apart, and those
arrive a label delay later. A fraud on a terminal whose compromise has **no
fraud known yet** when the row is scored (none of the terminal's
compromised-terminal frauds labelled in the merchant features' 30-day window,
which ends ``MERCHANT_LABEL_DELAY_DAYS`` before the row's day) cannot be ranked
above legitimate rows by any model built on information available at decision
time. (A known fraud there by a compromised *customer* says nothing about the
terminal: the simulator draws the two independently.) This tool reads a registered version's saved test scores
(``report/test_scores.parquet``) and the simulated file (its ``scenario``
column: the simulator's names, or the integer codes of the Handbook's
``TX_FRAUD_SCENARIO`` as its files hold them, :func:`scenario_names`), and prints, on the rows the version was evaluated on (the Handbook's):

* each saved model's AUC / AP / CP@100, and its AUC on detectable and on
  undetectable frauds separately (each against all legitimate rows);
* two oracles: ranking by the label (the metrics' own maximum) and ranking by
  the label with undetectable frauds scored as legitimate (the **attainable**
  maximum: a perfect model of everything knowable);
* a bootstrap (legitimate rows and frauds resampled, stratified) of the
  ensemble's AUC and AP minus each member's: how often the ensemble comes out
  ahead, i.e. whether a difference is larger than one test week's noise.

Writes ``bench/results/model-ceiling.json`` with the machine beside it.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import average_precision_score, roc_auc_score

from bench.procs import machine_info
from models.evaluation import evaluate_scores
from pipeline.feature_defs import PROFILE_WINDOWS_DAYS
from pipeline.features import DAY_S, MERCHANT_LABEL_DELAY_DAYS, prepare_history
from tools.simulator import SCENARIOS

__all__ = ["ceiling_report", "main", "scenario_names", "undetectable"]

TERMINAL = "compromised_terminal"
NOT_MODELS = frozenset({"transaction_id", "user_id", "ts", "label", "evaluated"})


def undetectable(rows: pd.DataFrame, frauds: pd.DataFrame) -> np.ndarray:
    """Per row of ``rows`` (``merchant_id``, ``ts``, ``scenario``): a
    compromised-terminal fraud whose terminal has none of ``frauds``
    (``merchant_id``, ``ts``: the compromised-terminal frauds) inside the window
    the merchant features see (``[day - delay - 30 d, day - delay)`` for the
    row's UTC day)."""
    day = np.floor(rows["ts"].to_numpy(np.float64) / DAY_S) * DAY_S
    hi = day - MERCHANT_LABEL_DELAY_DAYS * DAY_S
    lo = hi - max(PROFILE_WINDOWS_DAYS) * DAY_S
    by_merchant = {m: np.sort(g.to_numpy(np.float64)) for m, g in frauds.groupby("merchant_id")["ts"]}
    empty = np.empty(0)
    seen = np.array([
        int(np.searchsorted(t, b, side="left")) > int(np.searchsorted(t, a, side="left"))
        for t, a, b in ((by_merchant.get(m, empty), a, b) for m, a, b in zip(rows["merchant_id"], lo, hi))
    ], dtype=bool)  # fmt: skip
    missed: np.ndarray = (rows["scenario"].to_numpy() == TERMINAL) & ~seen
    return missed


def scenario_names(column: pd.Series) -> pd.Series:
    """The ``scenario`` column as names (:data:`tools.simulator.SCENARIOS`).

    The simulator writes names; the Handbook's files hold ``TX_FRAUD_SCENARIO``
    codes, 0 legitimate, 1 amount over 220, 2 compromised terminal, 3
    compromised customer, which are the simulator's codes in the same order
    (its extra scenarios are 4 and 5). Anything else is refused: a value read
    as no known scenario would make every fraud "detectable" without a word.
    """
    if pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
        codes = column.to_numpy()
        valid = np.isfinite(codes) & (codes == np.round(codes)) & (codes >= 0) & (codes < len(SCENARIOS))
        if not valid.all():
            raise ValueError(f"scenario codes must be 0-{len(SCENARIOS) - 1}; found {sorted(set(codes[~valid]))[:5]}")
        return pd.Series(np.asarray(SCENARIOS, dtype=object)[codes.astype(np.int64)], index=column.index)
    names = column.astype(str)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown[:5]}: expected {list(SCENARIOS)} or their codes 0-{len(SCENARIOS) - 1}")
    return names


def _model_columns(scores: pd.DataFrame) -> list[str]:
    return [c for c in scores.columns if c not in NOT_MODELS and c not in ("merchant_id", "scenario", "undetectable")]


def ceiling_report(scores: pd.DataFrame, data: pd.DataFrame, *, bootstrap: int = 200, seed: int = 0) -> dict[str, Any]:
    """``scores``: a version's ``test_scores.parquet``; ``data``: the simulated
    file it was trained on (``scenario`` column). Figures on the evaluated rows."""
    if "scenario" not in data:
        raise ValueError("the data file has no 'scenario' column: only simulated data says which fraud is which")
    named = pd.DataFrame({"transaction_id": data["transaction_id"].astype(str), "scenario": scenario_names(data["scenario"])})
    history = prepare_history(data.drop(columns=["scenario"])).merge(named, on="transaction_id", how="left")
    frame = scores.merge(history[["transaction_id", "merchant_id", "scenario"]], on="transaction_id", how="left")
    if frame["scenario"].isna().any():
        raise ValueError("the test scores name transactions the data file does not hold: not the file this version was trained on")
    terminal_frauds = history.loc[(history["label"] > 0) & (history["scenario"] == TERMINAL), ["merchant_id", "ts"]]
    frame["undetectable"] = undetectable(frame, terminal_frauds)
    keep = frame["evaluated"].to_numpy(bool)
    labels = frame["label"].to_numpy(np.int8)
    hidden = frame["undetectable"].to_numpy(bool)
    ev = frame[keep]
    legit = ev["label"].to_numpy() == 0
    models: dict[str, Any] = {}
    for name in _model_columns(frame):
        s = frame[name].to_numpy(np.float64)
        m = evaluate_scores(labels, s, frame, keep)
        es = ev[name].to_numpy(np.float64)
        split = {}
        for part, mask in (("detectable", (ev["label"] > 0).to_numpy() & ~ev["undetectable"].to_numpy()),
                           ("undetectable", ev["undetectable"].to_numpy())):  # fmt: skip
            y = np.r_[np.ones(int(mask.sum())), np.zeros(int(legit.sum()))]
            split[f"auc_{part}"] = float(roc_auc_score(y, np.r_[es[mask], es[legit]])) if mask.any() else None
        models[name] = {"auc": m["auc"], "ap": m["ap"], "cp_at_100": m["cp_at_100"], **split}
    rng = np.random.default_rng(seed)
    oracles = {}
    for name, s in (("label", labels.astype(np.float64)), ("attainable", np.where(hidden, 0.0, labels).astype(np.float64))):
        # Ties broken at random, as a model with no information would.
        m = evaluate_scores(labels, s + rng.random(len(s)) * 1e-6, frame, keep)
        oracles[name] = {"auc": m["auc"], "ap": m["ap"], "cp_at_100": m["cp_at_100"]}
    frauds_ev = int((~legit).sum())
    return {
        "evaluated_rows": int(keep.sum()),
        "frauds": frauds_ev,
        "undetectable_frauds": int(ev["undetectable"].sum()),
        "by_scenario": {k: int(v) for k, v in ev.loc[~legit, "scenario"].value_counts().items()},
        "models": models,
        "oracles": oracles,
        "bootstrap": _bootstrap(ev, bootstrap, rng) if "ensemble" in models else {},
    }


def _bootstrap(ev: pd.DataFrame, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    """Ensemble minus each member, AUC and AP, over stratified resamples of the evaluated rows."""
    y = ev["label"].to_numpy()
    pos, neg = np.flatnonzero(y > 0), np.flatnonzero(y == 0)
    names = [n for n in _model_columns(ev) if n != "ensemble"]
    cols = {n: ev[n].to_numpy(np.float64) for n in [*names, "ensemble"]}
    diffs: dict[str, dict[str, list[float]]] = {n: {"auc": [], "ap": []} for n in names}
    for _ in range(reps):
        idx = np.r_[rng.choice(pos, len(pos)), rng.choice(neg, len(neg))]
        yy = y[idx]
        base = {n: (roc_auc_score(yy, cols[n][idx]), average_precision_score(yy, cols[n][idx])) for n in cols}
        for n in names:
            diffs[n]["auc"].append(base["ensemble"][0] - base[n][0])
            diffs[n]["ap"].append(base["ensemble"][1] - base[n][1])
    out: dict[str, Any] = {"reps": reps}
    for n, d in diffs.items():
        out[n] = {
            metric: {
                "mean": float(np.mean(v)), "p05": float(np.percentile(v, 5)), "p95": float(np.percentile(v, 95)),
                "ensemble_ahead": float(np.mean(np.asarray(v) >= 0)),
            }
            for metric, v in d.items()
        }  # fmt: skip
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"evaluated rows {report['evaluated_rows']:,}, frauds {report['frauds']:,} "
        f"({', '.join(f'{k} {v}' for k, v in report['by_scenario'].items())}); "
        f"undetectable (its terminal's compromise not known when scored): {report['undetectable_frauds']}",
        f"{'model':24s} {'AUC':>7s} {'AP':>7s} {'CP@100':>7s} {'AUC det.':>9s} {'AUC undet.':>10s}",
    ]
    for name, m in report["models"].items():
        und = "-" if m["auc_undetectable"] is None else f"{m['auc_undetectable']:.3f}"
        lines.append(f"{name:24s} {m['auc']:7.3f} {m['ap']:7.3f} {m['cp_at_100']:7.3f} {m['auc_detectable']:9.3f} {und:>10s}")
    for name, m in report["oracles"].items():
        lines.append(f"{'oracle: ' + name:24s} {m['auc']:7.3f} {m['ap']:7.3f} {m['cp_at_100']:7.3f}")
    boot = report.get("bootstrap") or {}
    if boot:
        lines.append(f"ensemble minus member, {boot['reps']} stratified resamples (mean [5%, 95%], share with the ensemble ahead):")
        for name, d in boot.items():
            if name == "reps":
                continue
            lines.append(
                f"  {name:12s} AUC {d['auc']['mean']:+.4f} [{d['auc']['p05']:+.4f}, {d['auc']['p95']:+.4f}] "
                f"{d['auc']['ensemble_ahead']:.0%}   AP {d['ap']['mean']:+.4f} [{d['ap']['p05']:+.4f}, {d['ap']['p95']:+.4f}] "
                f"{d['ap']['ensemble_ahead']:.0%}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_ceiling", description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="the simulated file the version was trained on")
    parser.add_argument("--version", type=Path, required=True, help="the registered version's folder")
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/results/model-ceiling.json"))
    args = parser.parse_args(argv)
    scores = pd.read_parquet(args.version / "report" / "test_scores.parquet")
    report = ceiling_report(scores, pd.read_parquet(args.data), bootstrap=args.bootstrap)
    print(format_report(report))
    record = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "data": args.data.name,
        "version": args.version.name,
        **report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
