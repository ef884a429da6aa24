"""Communication benchmarks (docs/compression.md), each against its baseline in the same run.

``herald bench compression``: one ``herald train`` job per ``--wire-dtype`` (fp32, the
baseline, then fp16, bf16, int8) on the Criteo sample and on MovieLens: embedding bytes
per cause as fp32 and on the wire (NOTE [wire compression]), the ratio, worker<->PS bytes
counted by the workers, steady samples/s and held-out AUC (and its difference to fp32).

``herald bench groups``: 4 workers with ``--groups`` 1 (the baseline) and 2 (HT groups,
background EASGD, NOTE [training groups]), without and with a straggler (``--slow-worker
RANK:MS``), under each ``--consistencies`` mode: ``bsp`` (one dispatcher, groups in
lockstep) and ``hybrid`` (one dispatcher and data stream per group, NOTE [independent
groups] in herald/job/group_dispatch.py): samples/s, speed-up over G = 1 under the same
consistency and straggler, held-out AUC and its difference to that G = 1, the groups'
averaging lag and (hybrid) each group's share of the steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from herald.bench.options import DATASETS
from herald.bench.table import print_head
from herald.contracts.train import TrainConfig
from herald.job.launcher import run_train


def _job(args, dataset: str, run_dir: pathlib.Path, **kw) -> dict:
    cfg = TrainConfig.from_flags(
        source=str(pathlib.Path(args.data_dir) / DATASETS[dataset]),
        workers=args.workers,
        batch_size=args.batch_size,
        steps=args.steps,
        eval_fraction=0.1,
        run_dir=str(run_dir),
        **kw,
    )
    print(f"--- {dataset} {kw}", flush=True)
    return run_train(cfg, progress=False)


def run_compression(args: argparse.Namespace) -> dict:
    out = pathlib.Path(args.out)
    results: dict = {}
    for dataset in args.datasets:
        for wire in args.wire_dtypes:
            rep = _job(args, dataset, out / f"{dataset}-{wire}", wire_dtype=wire, embedding_dim=args.embedding_dim)
            comp = rep["compression"]
            results[f"{dataset}-{wire}"] = {
                "embedding_bytes_fp32": comp["fp32_bytes"],
                "embedding_bytes_wire": comp["wire_bytes"],
                "ratio": comp["ratio"],
                "per_cause": comp["per_cause"],
                "worker_ps_bytes": rep["wire_bytes"]["pulled"] + rep["wire_bytes"]["pushed"],
                "samples_per_second": rep["samples_per_second"],
                "auc": rep["metrics"].get("auc", float("nan")),
                "steps": rep["steps"],
            }
    print_head(
        "dataset | wire | embedding MiB fp32 | on the wire MiB | fewer bytes | samples/s | held-out AUC | AUC - fp32"
    )
    for dataset in args.datasets:
        base = results.get(f"{dataset}-fp32")
        for wire in args.wire_dtypes:
            r = results[f"{dataset}-{wire}"]
            r["auc_delta"] = r["auc"] - base["auc"] if base else float("nan")
            print(
                f"| {dataset} | {wire} | {r['embedding_bytes_fp32'] / 2**20:.2f} | "
                f"{r['embedding_bytes_wire'] / 2**20:.2f} | {r['ratio']:.2f}x | {r['samples_per_second']:,.0f} | "
                f"{r['auc']:.4f} | {r['auc_delta']:+.4f} |"
            )
    _write(out, "bench_compression.json", results)
    return results


def _groups_row(rep: dict, g: int, slow: str | None, mode: str) -> dict:
    leaders = (rep.get("groups") or {}).get("leaders", [])
    streams = (rep.get("group_streams") or {}).get("groups", [])
    return {
        "groups": g,
        "slow_worker": slow,
        "consistency": mode,
        "samples_per_second": rep["samples_per_second"],
        "auc": rep["metrics"].get("auc", float("nan")),
        "steps": rep["steps"],
        "group_steps": [s["steps"] for s in streams],
        "lag_steps_mean": max((s["lag_steps_mean"] for s in leaders), default=0.0),
        "lag_steps_max": max((s["lag_steps_max"] for s in leaders), default=0),
    }


def run_groups(args: argparse.Namespace) -> dict:
    out = pathlib.Path(args.out)
    results: dict = {}
    for mode in args.consistencies:
        for slow in (None, args.slow_worker):
            for g in args.groups:
                name = f"{mode}-G{g}-" + ("straggler" if slow else "even")
                rep = _job(
                    args,
                    args.dataset,
                    out / name,
                    groups=g,
                    slow_worker=slow,
                    consistency=mode,
                    average_every=args.average_every,
                    easgd_alpha=args.easgd_alpha,
                )
                results[name] = _groups_row(rep, g, slow, mode)
    print_head(
        "consistency | straggler | G | samples/s | speed-up vs G=1 | held-out AUC | AUC - G=1 "
        "| averaging lag mean / max (steps) | steps per group"
    )
    for mode in args.consistencies:
        for slow in (None, args.slow_worker):
            tag = "straggler" if slow else "even"
            base = results.get(f"{mode}-G{args.groups[0]}-{tag}")
            for g in args.groups:
                r = results[f"{mode}-G{g}-{tag}"]
                r["speedup"] = r["samples_per_second"] / base["samples_per_second"]
                r["auc_delta"] = r["auc"] - base["auc"]
                shares = " / ".join(str(n) for n in r["group_steps"]) or "-"
                print(
                    f"| {mode} | {slow or 'none'} | {g} | {r['samples_per_second']:,.0f} | {r['speedup']:.2f}x | "
                    f"{r['auc']:.4f} | {r['auc_delta']:+.4f} | {r['lag_steps_mean']:.1f} / {r['lag_steps_max']} | "
                    f"{shares} |"
                )
    _write(out, "bench_groups.json", results)
    return results


def _write(out: pathlib.Path, name: str, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(results, indent=2, default=float))
    print(f"\nwritten {out / name}")
