"""A stream's lag over a job, sampled after every global batch (NOTE [lag] in
herald/loader/kafka/source.py), in bounded memory: at most :data:`MAX_POINTS` samples,
thinned to every other one (and the stride doubled) each time the history is full, so a
days-long stream keeps an even sketch of its whole run."""

from __future__ import annotations

#: the most samples a :class:`LagHistory` keeps
MAX_POINTS = 2048


class LagHistory:
    """``add(step, lag)`` after each global batch (``lag``: :meth:`Source.lag`'s dict or
    None); ``last`` is the newest lag dict, ``points`` the kept ``(step, records,
    event_time_s)`` samples (records: summed over the partitions; event_time_s: None
    without timestamps), ``peak_records`` / ``peak_event_time_s`` the largest seen."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be >= 2, got {max_points}")
        self.max_points = max_points
        self.points: list[tuple[int, int, float | None]] = []
        self.last: dict | None = None
        self.peak_records = 0
        self.peak_event_time_s: float | None = None
        self._stride, self._seen = 1, 0

    def add(self, step: int, lag: dict | None) -> None:
        if lag is None:
            return
        self.last = lag
        records, event_s = int(sum(lag["records"].values())), lag["event_time_s"]
        self.peak_records = max(self.peak_records, records)
        if event_s is not None:
            self.peak_event_time_s = max(event_s, self.peak_event_time_s or 0.0)
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        self.points.append((step, records, event_s))
        if len(self.points) >= self.max_points:
            self.points = self.points[::2]
            self._stride *= 2

    def summary(self) -> dict | None:
        """The report's ``lag`` (None: the source has no lag): ``records`` (``final``: per
        partition, ``final_total``, ``peak``), ``event_time_s`` (``final``, ``peak``; None
        without timestamps) and ``series`` (``[step, records, event_time_s]`` lists)."""
        if self.last is None:
            return None
        return {
            "records": {
                "final": {str(p): n for p, n in self.last["records"].items()},
                "final_total": int(sum(self.last["records"].values())),
                "peak": self.peak_records,
            },
            "event_time_s": {"final": self.last["event_time_s"], "peak": self.peak_event_time_s},
            "series": [list(p) for p in self.points],
        }
