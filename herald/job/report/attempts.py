"""The report's blocks of a job that failed over (NOTE [ps failover] in herald/job/launcher.py,
NOTE [worker failover] in herald/job/recovery/rollback.py): every attempt's steps and samples
counted, the steps trained again named (``attempts``), and each rollback (``failovers``).

A failover rolls the job back to its latest checkpoint, so the steps the lost attempt
trained after it are trained again by the next attempt. The report counts what was
trained: ``steps`` and ``samples`` of every attempt (the retrained ones included),
``train_seconds`` of every attempt, ``attempts`` (each one's steps) and
``retrained_steps`` (``[[first, last], ...]``, the job steps trained by more than one
attempt). The rest of the report (throughput in steady state, transmissions, phases,
progressive validation) is the last attempt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from herald.job.report.inputs import Attempt, ReportInputs


def retrained_steps(attempts: Sequence[Sequence[int]]) -> list[list[int]]:
    """``[[first, last], ...]`` (ascending, inclusive): the job steps acked in more than one of
    ``attempts`` (each a sequence of int steps). E.g. ``[[0..12], [9..23]]`` -> ``[[9, 12]]``."""
    per_attempt = [np.unique(np.asarray(a, np.int64)) for a in attempts]
    if not per_attempt:
        return []
    steps, counts = np.unique(np.concatenate(per_attempt), return_counts=True)
    again = steps[counts > 1]
    if not again.size:
        return []
    runs = np.split(again, np.flatnonzero(np.diff(again) != 1) + 1)
    return [[int(r[0]), int(r[-1])] for r in runs]


def attempts_block(
    rep: dict[str, Any], last_steps: Sequence[int], earlier: Sequence[Attempt], global_batch: int
) -> dict[str, Any]:
    """What the report of the last attempt (``rep``, built from its steps ``last_steps``)
    becomes with the ``earlier`` attempts a failover ended: ``steps``, ``samples``
    (``global_batch`` samples a step of an earlier attempt), ``train_seconds`` and
    ``wall_samples_per_second`` over every attempt; ``attempts`` (one dict each, in order:
    ``steps``, ``first_step``, ``last_step`` (None without steps), ``samples``,
    ``train_seconds``) and ``retrained_steps`` (:func:`retrained_steps`; ``[]`` without
    failovers)."""

    def entry(steps: Sequence[int], samples: int, seconds: float) -> dict[str, Any]:
        return {
            "steps": len(steps),
            "first_step": min(steps, default=None),
            "last_step": max(steps, default=None),
            "samples": samples,
            "train_seconds": seconds,
        }

    attempts = [entry(a.steps, len(a.steps) * global_batch, a.seconds) for a in earlier]
    attempts.append(entry(last_steps, rep["samples"], rep["train_seconds"]))
    samples = sum(a["samples"] for a in attempts)
    seconds = sum(a["train_seconds"] for a in attempts)
    return {
        "steps": sum(a["steps"] for a in attempts),
        "samples": samples,
        "train_seconds": seconds,
        "wall_samples_per_second": samples / seconds if seconds > 0 else float("nan"),
        "attempts": attempts,
        "retrained_steps": retrained_steps([a.steps for a in earlier] + [last_steps]),
    }


def format_lines(rep: dict[str, Any]) -> list[str]:
    """The report.txt line of a job with more than one attempt (none otherwise)."""
    attempts = rep.get("attempts") or ()
    if len(attempts) < 2:
        return []
    spans = ", ".join(
        "no steps" if a["first_step"] is None else f"steps {a['first_step']}-{a['last_step']}" for a in attempts
    )
    again = rep.get("retrained_steps") or []
    twice = ", ".join(f"{a}-{b}" for a, b in again) if again else "none"
    n_again = sum(b - a + 1 for a, b in again)
    return [
        f"{len(attempts)} attempts (failover), every one counted in steps and samples: {spans}; steps "
        f"trained again: {twice} ({n_again} steps)"
    ]


def totals(inp: ReportInputs) -> dict[str, Any]:
    """:func:`attempts_block` of the report built from ``inp`` (this attempt's samples and seconds,
    the earlier attempts')."""
    this = {"samples": inp.samples, "train_seconds": inp.train_s}
    return attempts_block(this, [r.step for r in inp.records], inp.earlier, inp.cfg.global_batch)


def attempts_fields(inp: ReportInputs) -> dict[str, Any]:
    """The ``attempts`` block: ``attempts`` and ``retrained_steps`` (:func:`attempts_block`; the
    totals over every attempt are the throughput block's)."""
    block = totals(inp)
    return {"attempts": block["attempts"], "retrained_steps": block["retrained_steps"]}


def failovers_fields(inp: ReportInputs) -> dict[str, Any]:
    """The ``failovers`` block: one dict per rollback (NOTE [failover policy] in
    herald/job/recovery/policy.py; the test bed's supervisor writes its own)."""
    return {"failovers": list(inp.failovers)}


def failover_lines(rep: dict[str, Any]) -> list[str]:
    """One report.txt line per failover: its cause, the checkpoint, the steps rolled back and
    the time to training again."""
    lines = []
    for i, f in enumerate(rep.get("failovers") or (), 1):
        acked = (
            f" from step {f['last_acked_step']} ({f['steps_rolled_back']} steps rolled back)"
            if f.get("last_acked_step") is not None
            else ""
        )
        again = (
            f", training again {f['recovered_s']:.1f} s after the loss was seen"
            if f.get("recovered_s") is not None
            else ""
        )
        lines.append(
            f"failover {i}: {f['cause']}; rolled back to checkpoint {f['rolled_back_to']}{acked}{again} "
            "(NOTE [ps failover])"
        )
    return lines
