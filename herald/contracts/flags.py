"""Checking and wording ``herald train``'s flags: value checks that name the flag, and
internal configs' errors re-worded in the flags' terms (:func:`flag_errors`).

Imports no numba/torch/zmq package (see herald/contracts/train.py).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from collections.abc import Iterator
from typing import Any

from herald.config import require
from herald.errors import ConfigError
from herald.inputs import INT64_MAX


def scheduling_budget_value(text: str) -> str | float:
    """argparse type of ``--scheduling-budget auto|MS``: ``"auto"`` or a float (milliseconds)."""
    import argparse

    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a number of milliseconds, got {text!r}") from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _integer(
    cfg: Any, name: str, low: int, high: int | None = None, *, optional: bool = False, flag: str | None = None
) -> None:
    """Check that ``cfg.name`` is an integer in ``low..high`` (``flag``: its option, default ``--name``;
    no ``high``: a signed 64-bit int, :data:`herald.inputs.INT64_MAX`)."""
    value = getattr(cfg, name)
    if optional and value is None:
        return
    ok = (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and low <= int(value) <= (INT64_MAX if high is None else high)
    )
    span = f"in {low}..{high}" if high is not None else f">= {low}"
    if high is None and isinstance(value, numbers.Integral) and int(value) > INT64_MAX:
        span += " and at most 2**63 - 1"
    require(ok, f"{flag or _flag(name)} must be an integer {span}{' (or unset)' if optional else ''}, got {value!r}")


def _number(cfg: Any, name: str, span: str, check, *, flag: str | None = None) -> None:
    """Check that ``cfg.name`` is a finite number passing ``check`` (``flag``: its option, default ``--name``)."""
    value = getattr(cfg, name)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and check(value)
    require(ok, f"{flag or _flag(name)} must be a finite number {span}, got {value!r}")


def _choice(cfg: Any, name: str, choices: tuple[str, ...], *, flag: str | None = None) -> None:
    """Check that ``cfg.name`` is one of ``choices`` (``flag``: its option, default ``--name``)."""
    value = getattr(cfg, name)
    require(value in choices, f"{flag or _flag(name)} must be one of {', '.join(choices)}, got {value!r}")


#: Where an internal config's setting comes from: (pattern in its error message, the
#: ``herald train`` flag). Errors raised while a job is built from a TrainConfig
#: (SchedulerConfig, TableConfig, OptimizerConfig, DispatcherConfig, PSClient) are
#: re-worded with it (:func:`flag_errors`), so the user reads the option to change.
FLAG_OF = (
    (r"table '[^']*': dim\b", "--embedding-dim"),
    (r"\boptimizer lr\b", "--lr"),
    (r"\bcache_capacity_rows\b", "--cache-rows"),
    (r"\bcache_ratio\b", "--cache-ratio"),
    (r"\bcache_policy\b", "--cache-policy"),
    (r"\bbatch_size_per_worker(=|\b)", "--batch-size "),
    (r"\bnum_workers(=|\b)", "--workers "),
    (r"\bschedule '", "--schedule '"),
    (r"\bseed\b", "--seed"),
    (r"\btimeout_ms must be > 0 and retries >= 0, got (\S+), \S+", r"--timeout-ms must be > 0, got \1"),
    (r"\b(peer_)?timeout_ms\b", "--timeout-ms"),
    (r"\bmax_inflight_steps\b", "--max-inflight-steps"),
    (r"\bcheckpoint_every_steps\b", "--checkpoint-every"),
    (r"\bnum_shards\b", "--ps-shards"),
    (r"\bscheduling_budget_ms\b", "--scheduling-budget"),
    (r"\bthreads( ?<?=)", r"--scheduler-threads\1"),
    (r"\bkeys_dir\b", "--keys"),
    (r"\bdispatcher_rank\b", "--dispatcher-rank"),
)


def in_flag_terms(message: str) -> str:
    """``message`` (from an internal config) with its setting names replaced by the flags (:data:`FLAG_OF`)."""
    for pattern, flag in FLAG_OF:
        message = re.sub(pattern, flag, message)
    return re.sub(r"  +", " ", message)


@contextlib.contextmanager
def flag_errors() -> Iterator[None]:
    """Re-raise a :class:`ConfigError` of an internal config in the words of ``herald train``'s flags."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(in_flag_terms(str(exc))) from exc
