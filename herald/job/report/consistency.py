"""The report's ``consistency`` block (docs/consistency.md): each mode's counters of the rows
read, their staleness and what was dropped, built by that mode's function, chosen by mode name
from :data:`CONSISTENCY_BLOCKS` (the report's registry of the modes; adding a mode adds its
block here and nowhere else in the report)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from herald.dispatch.records import StepRecord
from herald.errors import ConfigError
from herald.job.report.inputs import ReportInputs


def consistency_block(cfg: Any, records: list[StepRecord]) -> dict[str, Any]:
    """The report's ``consistency``: ``mode``, ``settings``, ``max_staleness_observed`` and
    ``mean_staleness`` (clock gap of the rows read, in updates, over every row read),
    ``dropped_or_decayed``, ``rereads`` (copies re-fetched because the bound was reached),
    ``reads``, ``stale_reads`` (the pulls saved); docs/consistency.md. Built by the mode's
    block function (its entry in :data:`CONSISTENCY_BLOCKS`: :func:`plan_block`,
    :func:`bounded_block`, :func:`hybrid_block`, :func:`gba_block`)."""
    total: dict[str, int] = {}
    for r in records:
        for k, v in r.consistency.items():
            total[k] = max(total.get(k, 0), v) if k == "gap_max" else total.get(k, 0) + v
    settings = {"slow_worker": cfg.slow_worker} if getattr(cfg, "slow_worker", None) else {}
    mode = getattr(cfg, "consistency", "bsp")
    if mode not in CONSISTENCY_BLOCKS:
        raise ConfigError(
            f"--consistency {mode}: the report has no consistency block for it; known: {', '.join(CONSISTENCY_BLOCKS)} "
            "(add the mode's block to CONSISTENCY_BLOCKS in herald/job/report/consistency.py)"
        )
    return CONSISTENCY_BLOCKS[mode](cfg, records, total, settings, total.get("reads", 0))


def plan_block(
    cfg: Any, records: list[StepRecord], total: dict[str, int], settings: dict, reads: int
) -> dict[str, Any]:
    """The consistency block of a mode reading through the plan (bsp): the summed ack counters
    (``total``) as they are; ``settings``: the shared ones (``slow_worker``)."""
    return {
        "mode": getattr(cfg, "consistency", "bsp"),
        "settings": settings,
        "max_staleness_observed": total.get("gap_max", 0),
        "mean_staleness": total.get("gap_sum", 0) / reads if reads else 0.0,
        "dropped_or_decayed": total.get("dropped", 0),
        "rereads": total.get("rereads", 0),
        "reads": reads,
        "stale_reads": total.get("stale_reads", 0),
    }


def bounded_block(
    cfg: Any, records: list[StepRecord], total: dict[str, int], settings: dict, reads: int
) -> dict[str, Any]:
    """HET's (NOTE [bounded reads] in herald/worker/consistency_bounded.py): :func:`plan_block`
    with the bound ``staleness`` first in the settings."""
    return plan_block(cfg, records, total, {"staleness": cfg.mode.staleness, **settings}, reads)


def hybrid_block(
    cfg: Any, records: list[StepRecord], total: dict[str, int], settings: dict, reads: int
) -> dict[str, Any]:
    """Hybrid's (NOTE [hybrid training] in herald/dispatch/hybrid.py): staleness in steps per
    step (``per_step_staleness``), ``dropped_or_decayed`` the samples whose gradients expired,
    ``gradient_rows_pushed`` (the report's ``grad_push``: no plan runs)."""
    per_step = [int(r.consistency.get("staleness", 0)) for r in records]
    settings = {
        "max_inflight_steps": getattr(cfg, "inflight_steps", None),
        "hybrid_expiry": cfg.mode.expiry_steps,
        **settings,
    }
    return {
        "mode": "hybrid",
        "settings": settings,
        "max_staleness_observed": max(per_step, default=0),
        "mean_staleness": float(np.mean(per_step)) if per_step else 0.0,
        "dropped_or_decayed": sum(int(r.consistency.get("dropped", 0)) for r in records),
        "rereads": 0,
        "reads": reads,
        "stale_reads": 0,
        "staleness_unit": "steps",
        "per_step_staleness": per_step,
        "gradient_rows_pushed": sum(int(r.consistency.get("hybrid_rows", 0)) for r in records),
    }


def gba_block(cfg: Any, records: list[StepRecord], total: dict[str, int], settings: dict, reads: int) -> dict[str, Any]:
    """GBA (NOTE [gba tokens] in herald/ps/gba.py): staleness = global steps between a
    micro-batch's token and the step its gradient is applied at, over every contribution;
    ``dropped_or_decayed``: contributions eq. (1) dropped (shard 0's count)."""
    settings = {"gba_buffer": cfg.mode.buffer or cfg.workers, "gba_threshold": cfg.mode.threshold, **settings}
    n = total.get("contributions", 0)
    return {
        "mode": "gba",
        "settings": settings,
        "max_staleness_observed": total.get("gap_max", 0),
        "mean_staleness": total.get("gap_sum", 0) / n if n else 0.0,
        "dropped_or_decayed": total.get("dropped", 0),
        "rereads": 0,
        "reads": reads,
        "stale_reads": 0,
        "staleness_unit": "global steps",
        "contributions": n,
    }


#: Each consistency mode's block by mode name (exactly the modes of
#: :data:`herald.contracts.vocab.CONSISTENCY_MODES`: tests/job/test_report_blocks.py):
#: ``block(cfg, records, total, settings, reads) -> dict`` with ``total`` the summed ack
#: counters, ``settings`` the shared ones (``slow_worker``), ``reads`` the rows read.
CONSISTENCY_BLOCKS: dict[str, Callable[[Any, Sequence[StepRecord], dict[str, int], dict, int], dict[str, Any]]] = {
    "bsp": plan_block,
    "bounded": bounded_block,
    "hybrid": hybrid_block,
    "gba": gba_block,
}


def fields(inp: ReportInputs) -> dict[str, Any]:
    """The ``consistency`` block of the report built from ``inp``: :func:`consistency_block`, and
    ``switched_from`` (the mode of the checkpoint a ``--resume`` under another mode continued
    from: NOTE [gba checkpoints] in herald/dispatch/gba.py; None: none)."""
    return {"consistency": {**consistency_block(inp.cfg, inp.records), "switched_from": inp.switched_from}}


def format_consistency(rep: dict[str, Any]) -> str:
    """The report's consistency line."""
    c = rep["consistency"]
    settings = " ".join(f"{k}={v}" for k, v in c["settings"].items())
    return (
        f"consistency {c['mode']}{' (' + settings + ')' if settings else ''}: rows read {c['reads']:,}, "
        f"stale {c['stale_reads']:,} (pulls saved), staleness max {c['max_staleness_observed']} mean "
        f"{c['mean_staleness']:.4f} {c.get('staleness_unit', 'updates')}; rereads {c['rereads']:,}; dropped or decayed "
        f"{c['dropped_or_decayed']:,}"
        + (f"; switched from {c['switched_from']} at the resumed checkpoint" if c.get("switched_from") else "")
    )


def lines(rep: dict[str, Any]) -> list[str]:
    """The block's report.txt line."""
    return [format_consistency(rep)]
