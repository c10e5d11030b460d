"""Hot reload: follow the registry's pointers and the rules file without a restart.

A worker watches ``<registry>/CURRENT`` (unless ``FRAUD_MODEL_VERSION`` pins a
version), ``<registry>/SHADOW`` and the rules file (see
:mod:`models.lifecycle`). Every ``reload_check_s`` a faust timer calls
:meth:`Reloader.poll`, which reads the pointers and starts loading what
changed on a thread of its own (verifying checksums and warming up take
seconds; batches go on with what is served meanwhile). The scoring agent calls
:meth:`Reloader.apply` before each batch: whatever has finished loading is
swapped in there, between two batches, so a batch sees one model and one rules
version throughout and no batch waits for a load or is dropped.

A version that fails to load or to predict (bad checksum, other feature set)
is logged and not tried again by this worker (versions are immutable: fix it
under a new version); a rules file that fails validation is logged and skipped
until the file changes again. Either way what is served stays served.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.errors import FraudPipelineError
from models.lifecycle import shadow_version
from models.registry import current_version, load_ensemble
from pipeline.drift import DriftMonitor, load_reference
from pipeline.model import ScoringModel
from pipeline.rules import RuleSet, load_rules

__all__ = ["Reloader"]

log = logging.getLogger(__name__)

#: Loaded versions kept in memory, so a rollback to one of them is immediate.
KEEP_LOADED = 3


class Reloader:
    def __init__(
        self,
        *,
        registry: Path,
        rules_path: Path,
        pinned_version: str | None = None,
        model: ScoringModel | None = None,
        rules: RuleSet | None = None,
        check_every_s: float = 1.0,
        drift_window_rows: int = 2000,
        drift_warn_psi: float = 0.25,
        load: Callable[[Path, str], ScoringModel] = lambda registry, version: load_ensemble(registry, version),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = Path(registry)
        self.rules_path = Path(rules_path)
        self.pinned = pinned_version
        self.check_every_s = check_every_s
        self.drift_window_rows = drift_window_rows
        self.drift_warn_psi = drift_warn_psi
        self._load = load
        self._clock = clock
        self._last_check = -float("inf")
        self._loaded: OrderedDict[str, ScoringModel] = OrderedDict()
        if model is not None:
            self._loaded[model.version] = model
        self._loading: dict[str, asyncio.Task[ScoringModel]] = {}
        self._failed: set[str] = set()
        self.want_model: str | None = model.version if model is not None else None
        self.want_shadow: str | None = None
        self._rules_stamp = self._stamp()
        self._rules_ready: RuleSet | None = None
        self._rules_version = rules.version if rules is not None else None
        self._drift_for: str | None = None

    # --- watching ---------------------------------------------------------------------------

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.rules_path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    async def poll(self, *, force: bool = False) -> None:
        """Read the pointers and the rules file; start loading what changed."""
        now = self._clock()
        if not force and now - self._last_check < self.check_every_s:
            return
        self._last_check = now
        try:
            model = self.pinned or current_version(self.registry)
            shadow = shadow_version(self.registry)
        except (OSError, FraudPipelineError) as exc:
            log.warning("reading the registry pointers failed (%s); serving as before", exc)
            return
        if model != self.want_model and model not in self._failed:
            log.info("registry: model %s requested (serving %s)", model, self.want_model)
        self.want_model = model
        self.want_shadow = shadow if shadow != model else None
        for version in (self.want_model, self.want_shadow):
            if version and version not in self._loaded and version not in self._loading and version not in self._failed:
                self._loading[version] = asyncio.create_task(asyncio.to_thread(self._load, self.registry, version))
        stamp = self._stamp()
        if stamp is not None and stamp != self._rules_stamp:
            self._rules_stamp = stamp
            try:
                rules = load_rules(self.rules_path)
            except FraudPipelineError as exc:
                log.error("rules file changed but is refused, rules %s stay in force: %s", self._rules_version, exc)
            else:
                self._rules_ready = rules

    def _collect(self) -> None:
        for version, task in list(self._loading.items()):
            if not task.done():
                continue
            del self._loading[version]
            try:
                self._loaded[version] = task.result()
            except Exception as exc:
                self._failed.add(version)
                log.error("model %s cannot be loaded; serving what was served (%s)", version, exc)
                continue
            while len(self._loaded) > KEEP_LOADED:
                oldest = next(iter(self._loaded))
                if oldest in (self.want_model, self.want_shadow):
                    self._loaded.move_to_end(oldest)
                    break
                self._loaded.popitem(last=False)

    # --- applying, between batches --------------------------------------------------------------

    async def apply(self, scorer: Any) -> list[str]:
        """Swap into ``scorer`` whatever is loaded and wanted; returns what changed, in words.

        Never raises: it runs inside the scoring agent's batch loop, where an
        exception would cost the batch (faust acks it)."""
        try:
            return await self._apply(scorer)
        except Exception:
            log.exception("hot reload failed; serving as before")
            return []

    async def _apply(self, scorer: Any) -> list[str]:
        await self.poll()
        self._collect()
        changes: list[str] = []
        parts: dict[str, Any] = {}
        current = scorer.model.version if scorer.model is not None else None
        if self.want_model and self.want_model != current and self.want_model in self._loaded:
            model = self._loaded[self.want_model]
            if await self._warmed(scorer, model):
                parts["model"] = model
                changes.append(f"model {current} -> {model.version}")
                current = model.version
        if current is not None and current != self._drift_for:
            self._drift_for = current
            parts["drift"] = self._drift(current)
        shadow_now = scorer.shadow.version if scorer.shadow is not None else None
        if self.want_shadow != shadow_now:
            if self.want_shadow is None:
                parts["shadow"] = None
                changes.append(f"shadow {shadow_now} -> none")
            elif self.want_shadow in self._loaded:
                shadow = self._loaded[self.want_shadow]
                if await self._warmed(scorer, shadow, shadow=True):
                    parts["shadow"] = shadow
                    changes.append(f"shadow {shadow_now} -> {shadow.version}")
        if self._rules_ready is not None:
            rules, self._rules_ready = self._rules_ready, None
            parts["rules"] = rules
            changes.append(f"rules {self._rules_version} -> {rules.version}")
            self._rules_version = rules.version
        if parts:
            scorer.swap(**parts)
        if changes:
            log.info("now serving: %s (swapped between batches)", "; ".join(changes))
        return changes

    async def _warmed(self, scorer: Any, model: ScoringModel, shadow: bool = False) -> bool:
        """Warm ``model`` up on the thread that will run it; a model that cannot
        predict is dropped and not tried again."""
        try:
            await scorer.warm_up(model=model, shadow=shadow)
        except Exception as exc:
            self._loaded.pop(model.version, None)
            self._failed.add(model.version)
            log.error("model %s fails to predict; serving what was served (%r)", model.version, exc)
            return False
        return True

    def _drift(self, version: str) -> DriftMonitor | None:
        reference = load_reference(self.registry / version)
        if reference is None:
            log.info("model %s has no drift reference (trained before it existed): no drift records", version)
            return None
        return DriftMonitor(version, reference, window_rows=self.drift_window_rows, warn_psi=self.drift_warn_psi)
