"""When each rank's step message reached a shard: NOTE [step arrivals].

NOTE [step arrivals]
~~~~~~~~~~~~~~~~~~~~
NOTE [step barrier timing] (herald/ps/stepped.py) gives a shard's mean spread of a step's
messages and which rank came last how often. To find *why* ranks reach the barrier apart,
the shard also keeps, for each of its last :data:`ARRIVAL_STEPS` released steps, every
rank's arrival: ``time.monotonic()`` when the shard took its step message up, before its
writes were applied (one timestamp per message, kept in the message's held entry, copied at
the release into preallocated arrays: no allocation on the hot path). From them:

- a rank's **lag** at step t: its arrival minus the first rank's arrival of step t;
  per step, the rank that came last, its lag (the step's spread) and its **margin** over
  the rank before it (how long the barrier waited for that rank alone);
- a rank's **own work** at step t: its arrival minus the end of this shard's release of step
  t - 1 (the shard packed every rank's reply then). It is what the worker did between the
  barrier's replies: the rest of its step t - 1 (the replies of the other shards, the
  ack, the local updates, the plan executor) and step t's compute up to its message. So
  within a step the lags are exactly the differences of the ranks' own work, and its
  spread splits into a persistent part (one rank slower on every step: a shared core, a
  busier micro-batch; the standard deviation of the ranks' mean own work) and jitter
  (the mean of each rank's own standard deviation). A step whose predecessor this shard
  did not release (the first, or one after a restore) has no own work.

The figures ride in the shard's ``stats`` (``step_barrier["arrivals"]``: :meth:`Arrivals.summary`),
so a job's report and ``herald bench step`` / ``herald bench device`` carry them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: released steps whose arrivals a shard keeps (the latest ones)
ARRIVAL_STEPS = 256
#: ranks whose arrivals a shard keeps (a larger job's higher ranks are left out)
ARRIVAL_RANKS = 64


class Arrivals:
    """The last :data:`ARRIVAL_STEPS` released steps' arrival times per rank (NOTE [step arrivals])."""

    def __init__(self, steps: int = ARRIVAL_STEPS, ranks: int = ARRIVAL_RANKS):
        self._step = np.full(steps, -1, np.int64)
        self._lag = np.full((steps, ranks), np.nan)  # s after the step's first message
        self._own = np.full((steps, ranks), np.nan)  # s after this shard released the step before
        self._recorded = 0
        self._before: tuple[int, float] | None = None  # (step, when its release ended)

    def record(self, step: int, arrived: list[float], released_at: float) -> None:
        """Keep released step ``step``: ``arrived[r]``, rank r's ``time.monotonic()`` on arrival;
        ``released_at``: when its release ended (the next step's own work counts from it)."""
        i = self._recorded % self._step.shape[0]
        lag, own = self._lag[i], self._own[i]
        lag.fill(np.nan)
        own.fill(np.nan)
        n = min(len(arrived), lag.shape[0])
        first = min(arrived)
        before = self._before[1] if self._before is not None and self._before[0] == step - 1 else None
        for r in range(n):
            lag[r] = arrived[r] - first
            if before is not None:
                own[r] = arrived[r] - before
        self._step[i] = step
        self._recorded += 1
        self._before = (step, released_at)

    def forget(self) -> None:
        """A ``restore``: the next step has no predecessor here (its own work is not counted)."""
        self._before = None

    def summary(self) -> dict[str, Any]:
        """The kept steps' figures (plain types; ms rounded to 3 decimals).

        Returns:
            ``{"steps": k}`` and, when k > 0: ``"per_step"``: ``[step, last rank, its lag ms,
            its margin ms]`` per kept step, oldest first; ``"by_rank"``: per rank
            ``{"rank", "lag_ms_mean", "last" (steps it came last), "own_ms_mean",
            "own_ms_std"}``; ``"own_ms_std"`` (every rank's own work of every step),
            ``"own_ms_std_within"`` (mean of the ranks' own std: jitter) and
            ``"own_ms_std_between"`` (std of the ranks' mean own work: a persistently
            slower rank); the own-work figures are None without a step that has one.
        """
        cap = self._step.shape[0]
        k = min(self._recorded, cap)
        if k == 0:
            return {"steps": 0}
        rows = (self._recorded - k + np.arange(k)) % cap
        seen = np.isfinite(self._lag[rows])
        width = int(np.flatnonzero(seen.any(axis=0)).max()) + 1
        lag = self._lag[rows, :width]
        own = self._own[rows, :width]
        filled = np.where(np.isfinite(lag), lag, -np.inf)
        last = np.argmax(filled, axis=1)
        ordered = np.sort(filled, axis=1)
        lag_max = ordered[:, -1]
        margin = lag_max - ordered[:, -2] if width > 1 else np.zeros(k)
        margin = np.where(np.isfinite(margin), margin, 0.0)
        per_step = [[int(s), int(r), _ms(x), _ms(m)] for s, r, x, m in zip(self._step[rows], last, lag_max, margin)]
        by_rank: list[dict] = []
        means: list[float] = []
        stds: list[float] = []
        for r in range(width):
            lr, orr = lag[:, r], own[:, r]
            lr, orr = lr[np.isfinite(lr)], orr[np.isfinite(orr)]
            mean_own = float(orr.mean()) if orr.size else None
            std_own = float(orr.std()) if orr.size else None
            if mean_own is not None and std_own is not None:
                means.append(mean_own)
                stds.append(std_own)
            by_rank.append(
                {
                    "rank": r,
                    "lag_ms_mean": _ms(float(lr.mean())) if lr.size else None,
                    "last": int(np.count_nonzero(last == r)),
                    "own_ms_mean": None if mean_own is None else _ms(mean_own),
                    "own_ms_std": None if std_own is None else _ms(std_own),
                }
            )
        every = own[np.isfinite(own)]
        return {
            "steps": k,
            "per_step": per_step,
            "by_rank": by_rank,
            "own_ms_std": _ms(float(every.std())) if every.size else None,
            "own_ms_std_within": _ms(float(np.mean(stds))) if stds else None,
            "own_ms_std_between": _ms(float(np.std(means))) if means else None,
        }


def _ms(seconds: float) -> float:
    return round(1e3 * float(seconds), 3)
