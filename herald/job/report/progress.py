"""What ``herald train`` shows while it trains: a progress bar over steps and, every
``--eval-every`` steps, progressive validation (AUC and log loss of the predictions made before
each update)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from herald.contracts.plan import CAUSES
from herald.dispatch.records import StepRecord
from herald.job.report.metrics import log_loss, roc_auc

PULLS = ("miss_pull", "update_pull")
PUSHES = ("grad_push", "plan_push", "evict_push")


class Progress:
    """A tqdm bar over steps showing samples/s, loss, hit rate, transmissions/step, a
    stream's lag (``lag()``: :meth:`herald.loader.source.Source.lag`'s dict or None, e.g.
    ``GlobalBatches.lag.last``; NOTE [lag] in herald/loader/kafka/source.py) and, once there
    are any, the bad records skipped so far per reason (``skipped()``: reason -> count, e.g.
    ``GlobalBatches.skipped``; NOTE [bad records])."""

    def __init__(
        self,
        cfg: Any,
        *,
        enabled: bool = True,
        total_steps: int | None = None,
        skipped: Callable[[], dict[str, int]] | None = None,
        lag: Callable[[], dict | None] | None = None,
    ):
        self.cfg, self.enabled = cfg, enabled
        self._skipped, self._lag = skipped, lag
        self._bar = None
        self._t0 = time.perf_counter()
        self._samples = 0
        self._window: list[StepRecord] = []
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, unit="step", desc=f"train [{cfg.scheduling.schedule}]", dynamic_ncols=True
            )

    def update(self, rec: StepRecord) -> None:
        self._samples += self.cfg.global_batch
        self._window.append(rec)
        if len(self._window) >= self.cfg.eval_every:
            pv = progressive(self._window)
            line = (
                f"step {rec.step}: progressive validation over {pv['samples']:,} samples: "
                f"AUC {pv['auc']:.4f} logloss {pv['logloss']:.4f}"
            )
            skipped = format_skipped(self._skipped() if self._skipped else {})
            if skipped:
                line += f"  (bad records skipped: {skipped})"
            if self._bar is not None:
                self._bar.write(line)
            elif self.enabled:
                print(line)
            self._window = []
        if self._bar is None:
            return
        c = rec.counts.sum(axis=0)
        used = c[CAUSES.index("hit")] + c[CAUSES.index("miss_pull")] + c[CAUSES.index("update_pull")]
        hit = c[CAUSES.index("hit")] / used if used else float("nan")
        moved = int(sum(c[CAUSES.index(k)] for k in PULLS + PUSHES))
        rate = self._samples / max(1e-9, time.perf_counter() - self._t0)
        skipped = format_skipped(self._skipped() if self._skipped else {})
        self._bar.set_postfix_str(
            f"{rate:,.0f} samples/s loss {rec.loss:.4f} hit {hit:.2f} tx/step {moved}"
            + format_lag(self._lag() if self._lag else None)
            + (f" skipped {skipped}" if skipped else ""),
            refresh=False,
        )
        self._bar.update(1)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the bar; returns at once (``timeout_s``: nothing here waits; docs/design.md, "Timeouts and units")."""
        if self._bar is not None:
            self._bar.close()


def format_lag(lag: dict | None) -> str:
    """``" lag 1,234 rec 3.2 s"`` (records behind the stream's end, event-time lag where
    known), or ``""`` for a source without one."""
    if not lag or not lag["records"]:
        return ""
    event = lag["event_time_s"]
    return f" lag {sum(lag['records'].values()):,} rec" + (f" {event:.1f} s" if event is not None else "")


def format_skipped(skipped: dict[str, int]) -> str:
    """``"bad_label 3, bad_dense 1"`` (largest first), or ``""`` when nothing was skipped."""
    items = sorted(((k, v) for k, v in skipped.items() if v), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k} {v:,}" for k, v in items)


def progressive(records: list[StepRecord]) -> dict[str, float]:
    """AUC and log loss of the predictions made before each step's update (progressive
    validation: every sample is scored before the model trains on it)."""
    y = np.concatenate([r.labels for r in records]) if records else np.zeros(0)
    p = np.concatenate([r.probs for r in records]) if records else np.zeros(0)
    if y.size == 0:
        return {"samples": 0, "auc": float("nan"), "logloss": float("nan")}
    return {"samples": int(y.size), "auc": roc_auc(y, p), "logloss": log_loss(y, p)}
