"""Consistency benchmark: the same data under each consistency mode, with and without a straggler.

Trains the same model on the same data (default: the Criteo sample) under ``bsp``,
``bounded`` with s = 1, 4, 16 (HET §4.1), ``hybrid`` (Persia §3-4; its staleness is in
steps, not updates; docs/consistency.md) and ``gba`` with iota = 0 and 4 (GBA §4.1, M =
workers; its staleness is in global steps), each once as it is and once with one worker
slowed (``--slow-worker RANK:MS``), in one run, and prints held-out AUC and log loss,
samples/s and its ratio to bsp's, embeddings moved (rows pulled and pushed, by the plan),
the pulls the bound saved and the observed staleness side by side. ``--out FILE.json``
keeps every figure.

The straggler's MS (``--straggler``; docs/consistency.md, "Benchmark"):

* ``own`` (default): each mode's straggler sleeps that mode's own mean step time, measured
  in this run's pass without a straggler, so every straggler takes about twice its own step
  time ("one worker slowed by 2x its step time", docs/consistency.md, "Straggler
  injection"). The ratio to bsp + straggler then measures how a mode keeps its own speed
  when one worker is twice as slow.
* ``bsp``: every mode's straggler sleeps BSP's mean step time (more than 2x the step of a
  mode faster than BSP): the same absolute delay for every mode.

``--slow-ms`` overrides both. Every row records the MS its straggler slept (``slow_ms``).

Run as ``herald bench consistency``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from herald.bench.options import BASELINE, CONSISTENCY_MODES
from herald.bench.table import print_head
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job.launcher import run_train

NOT_BUILT: tuple[str, ...] = ()


def summarize(rep: dict) -> dict:
    """The figures compared, from a ``herald train`` report dict."""
    m, c, tx = rep["metrics"], rep["consistency"], rep["transmissions"]
    return {
        "auc": m.get("auc", float("nan")),
        "logloss": m.get("logloss", float("nan")),
        "samples_per_second": rep["samples_per_second"],
        "embeddings_moved": tx["total"],
        "update_pulls": tx["update_pull"],
        "pulls_saved": c["stale_reads"],
        "rereads": c["rereads"],
        "max_staleness": c["max_staleness_observed"],
        "mean_staleness": c["mean_staleness"],
        "dropped_or_decayed": c["dropped_or_decayed"],
        "wire_bytes": rep["wire_bytes"]["pulled"] + rep["wire_bytes"]["pushed"],
        "steps": rep["steps"],
    }


def _config(args: argparse.Namespace, mode: str, flags: dict, slow: str | None, name: str):
    return TrainConfig.from_flags(
        source=args.source,
        steps=getattr(args, "steps", None),
        workers=args.workers,
        batch_size=args.batch_size,
        epochs=args.epochs,
        cache_ratio=args.cache_ratio,
        embedding_dim=args.embedding_dim,
        consistency=mode,
        slow_worker=slow,
        run_dir=str(pathlib.Path(args.run_dir) / name),
        **flags,
    )


def mean_step_ms(args: argparse.Namespace, row: dict) -> int:
    """A run's mean step time in ms (one global batch of ``workers x batch_size`` samples)
    from its samples/s; at least 1."""
    return max(1, round(1000 * args.workers * args.batch_size / row["samples_per_second"]))


def straggler_ms(args: argparse.Namespace, label: str, results: dict) -> int:
    """The straggler's sleep per step for mode ``label``: ``--slow-ms`` if given, else the
    mean step time of ``label``'s (``--straggler own``) or bsp's (``bsp``) run without a
    straggler, from ``results`` (label -> :func:`summarize` row)."""
    if args.slow_ms is not None:
        return int(args.slow_ms)
    return mean_step_ms(args, results[label if getattr(args, "straggler", "own") == "own" else BASELINE])


def run(args: argparse.Namespace) -> dict:
    """Every chosen mode without, then with a straggler; returns ``{row key: summarize row +
    mode, straggler, slow_ms, vs_bsp}`` (also printed, and written to ``--out``).

    Raises:
        ConfigError: an unknown label in ``--modes``, or no bsp.
    """
    results: dict = {}
    chosen = [m.strip() for m in getattr(args, "modes", "bsp").split(",") if m.strip()]
    unknown = sorted(set(chosen) - {label for label, _, _ in CONSISTENCY_MODES})
    if unknown or BASELINE not in chosen:
        raise ConfigError(
            f"--modes: unknown {unknown} or no bsp (the baseline); choose among "
            f"{[label for label, _, _ in CONSISTENCY_MODES]}"
        )
    plain: dict = {}  # label -> its row without a straggler
    for straggler in (False, True):
        for label, mode, flags in (m for m in CONSISTENCY_MODES if m[0] in chosen):
            slow_ms = straggler_ms(args, label, plain) if straggler else None
            slow = f"{args.slow_rank}:{slow_ms}" if straggler else None
            key = label + (f" + slow {slow}" if straggler else "")
            print(f"--- {key}", flush=True)
            rep = run_train(
                _config(args, mode, flags, slow, key.replace(" ", "_").replace(":", "-").replace("=", "")),
                progress=False,
            )
            row = {**summarize(rep), "mode": label, "straggler": straggler, "slow_ms": slow_ms}
            results[key] = row
            if not straggler:
                plain[label] = row
    add_ratios(results)
    print_table(results)
    if NOT_BUILT:
        print(f"not built yet (not run): {', '.join(NOT_BUILT)}")
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        definition = "slow-ms" if args.slow_ms is not None else getattr(args, "straggler", "own")
        pathlib.Path(args.out).write_text(
            json.dumps(
                {
                    "results": results,
                    "not_built": list(NOT_BUILT),
                    "straggler": definition,
                    "slow_ms": {r["mode"]: r["slow_ms"] for r in results.values() if r["straggler"]},
                },
                indent=2,
            )
        )
        print(f"written {args.out}")
    return results


def add_ratios(results: dict) -> None:
    """Set each row's ``vs_bsp``: its samples/s over the bsp row of the same pass (rows
    without a straggler over bsp, rows with one over bsp + straggler); NaN if none."""
    base = {r["straggler"]: r["samples_per_second"] for r in results.values() if r["mode"] == BASELINE}
    for r in results.values():
        b = base.get(r["straggler"])
        r["vs_bsp"] = r["samples_per_second"] / b if b else float("nan")


def print_table(results: dict) -> None:
    """A markdown table of :func:`summarize` rows (with ``vs_bsp`` and ``slow_ms``), keyed by the run's label."""
    print_head(
        "mode | straggler ms | AUC | log loss | samples/s | vs bsp | embeddings moved | update pulls | pulls saved "
        "| rereads | staleness max / mean | worker<->PS MiB"
    )
    for key, r in results.items():
        slow = "-" if r.get("slow_ms") is None else str(r["slow_ms"])
        print(
            f"| {key} | {slow} | {r['auc']:.4f} | {r['logloss']:.4f} | {r['samples_per_second']:,.0f} | "
            f"{r.get('vs_bsp', float('nan')):.2f}x | {r['embeddings_moved']:,} | {r['update_pulls']:,} | "
            f"{r['pulls_saved']:,} | {r['rereads']:,} | {r['max_staleness']} / {r['mean_staleness']:.3f} | "
            f"{r['wire_bytes'] / 2**20:.2f} |"
        )
