"""The sections of ``herald bench device`` (:mod:`herald.bench.device`): the two it runs
itself in a child (``gpu``, ``profile``), what each child's files become in device.json,
and the ``arrivals`` analysis of the largest ``scale`` run (NOTE [step arrivals] in
herald/ps/arrivals.py)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import tempfile
import xml.etree.ElementTree as ET

import torch

from herald.bench import gpu
from herald.bench.common import WARMUP_STEPS, PlainBatches, PlainDLRM, load_plain_batches, train_loop
from herald.bench.options import cores
from herald.bench.torchrec_baseline import torchrec_import_error
from herald.errors import ConfigError

#: ops of the profile kept in device.json (the rest is in the trace)
PROFILE_TOP_OPS = 12


def kill_group(p: subprocess.Popen) -> None:
    """Kill a section's child and everything it started (its own process group)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def machine() -> dict:
    """What the figures ran on: cores, torch, CUDA and its device, TorchRec."""
    cuda = torch.cuda.is_available()
    return {
        "cores": cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "device_name": torch.cuda.get_device_name() if cuda else None,
        "torchrec": torchrec_import_error() or "ok",
    }


# ------------------------------------------------------------------ the children


def run_section(args: argparse.Namespace) -> dict:
    """``herald bench device --section gpu|profile --part FILE``: one section, its JSON to FILE.

    Raises:
        ConfigError: an unknown section or no ``--part``.
    """
    if args.section not in ("gpu", "profile") or not args.part:
        raise ConfigError(f"--section must be gpu or profile with --part FILE, got {args.section!r}")
    part = pathlib.Path(args.part)
    got = gpu_part(args) if args.section == "gpu" else profile_part(args, part.parent)
    part.write_text(json.dumps(got, indent=1))
    return got


def _source(rows: int) -> str:
    return f"synthetic://criteo?rows={rows}&seed=1"


def gpu_part(args: argparse.Namespace) -> dict:
    """herald on the GPU vs plain PyTorch on the GPU (:func:`herald.bench.gpu.gpu_section`);
    without CUDA, plain PyTorch's GPU path on the CPU."""
    source = _source(args.rows)
    if torch.cuda.is_available():
        ns = argparse.Namespace(gpu_batch_sizes=args.gpu_batch_sizes, repeats=1, seed=0)
        with tempfile.TemporaryDirectory(prefix="herald-bench-device-gpu-") as tmp:
            rows = gpu.gpu_section(source, ns, tmp)
        return {"status": f"ran on {torch.cuda.get_device_name()}", "rows": rows}
    rows = []
    for batch in args.gpu_batch_sizes:
        data = load_plain_batches(source, batch)
        got = gpu.train_plain_torch_on(
            data, torch.device("cpu"), warmup_steps=min(WARMUP_STEPS, len(data.batches) // 2)
        )
        rows.append({"batch_size": batch, "plain_torch_cpu_samples_per_s": got["samples_per_s"]})
    return {"status": "no CUDA: plain PyTorch's GPU code path ran on the CPU; herald on the GPU not run", "rows": rows}


def profile_part(args: argparse.Namespace, folder: pathlib.Path) -> dict:
    """``args.steps`` training steps of the plain baseline's model under ``torch.profiler``
    (after 3 untimed ones), on the GPU (on the CPU without CUDA); the Chrome trace gzipped
    to ``folder/../profile_trace.json.gz``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    data = load_plain_batches(_source(args.rows), args.batch_size, max_steps=args.steps + 3)
    if len(data.batches) < args.steps + 3:
        raise ConfigError(f"{len(data.batches)} batches of {args.batch_size}: raise --rows for {args.steps} steps")
    moved = [
        (d.to(device), y.to(device), [i.to(device) for i in ids], [o.to(device) for o in offs])
        for d, y, ids, offs in data.batches
    ]
    warm = PlainBatches(moved[:3], data.table_rows, data.dense_dim, 0.0, 0.0)
    timed = PlainBatches(moved[3:], data.table_rows, data.dense_dim, 0.0, 0.0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        model = PlainDLRM(data.dense_dim, data.table_rows, 16, 0).to(device)
        train_loop(model, warm, 0)
        with profile(activities=activities) as prof:
            _, seconds = train_loop(model, timed, 0)
            if cuda:
                torch.cuda.synchronize()
    trace = folder.parent / "profile_trace.json.gz"
    with tempfile.TemporaryDirectory(prefix="herald-bench-profile-") as tmp:
        raw = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return {
        "status": "on the GPU" if cuda else "no CUDA: on the CPU",
        "steps": len(timed.batches),
        "batch_size": args.batch_size,
        "ms_per_step": round(1e3 * seconds / len(timed.batches), 3),
        "trace": trace.name,
        "top_ops": _top_ops(prof, cuda),
    }


def _top_ops(prof, cuda: bool) -> list[dict]:
    """The ops taking most self time (device time on CUDA, else CPU time)."""

    def dev(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    events = sorted(prof.key_averages(), key=lambda e: -(dev(e) if cuda else e.self_cpu_time_total))
    return [
        {
            "op": e.key,
            "calls": int(e.count),
            "self_device_us": round(dev(e), 1),
            "self_cpu_us": round(float(e.self_cpu_time_total), 1),
        }
        for e in events[:PROFILE_TOP_OPS]
    ]


# ------------------------------------------------------------------ what the children wrote


def collect(name: str, parts: pathlib.Path, child: dict, plan: dict) -> dict:
    """A section's entry: what its child wrote (its JSON, or the test counts), its plan,
    and ``child`` (exit status, seconds, log; ``error`` when it failed)."""
    base = {"child": child, "plan": plan}
    if name == "tests":
        return {**_test_counts(parts / "tests.xml", child), **base}
    path = parts / f"{name}.json"
    if not path.is_file():
        return {"error": child.get("error") or f"{name}: wrote no {path.name}", **base}
    got = json.loads(path.read_text())
    if child.get("error"):
        got["error"] = child["error"]
    return {**got, **base}


def _test_counts(xml: pathlib.Path, child: dict) -> dict:
    """Counts of the junit XML (tests, failures, errors, skipped, passed, the failing ones)
    and a ``status``: ``skipped: no CUDA`` on a machine without it."""
    if not xml.is_file():
        return {"status": "error", "error": child.get("error") or "pytest wrote no junit XML"}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for suite in ET.parse(xml).getroot().iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    if not torch.cuda.is_available():
        status = "skipped: no CUDA"
    elif counts["failures"] or counts["errors"] or child.get("rc") not in (0, None):
        status = "failed"
    else:
        status = "passed"
    return {"status": status, **counts, "failed": failed}


# ------------------------------------------------------------------ arrivals


def arrivals_section(scale: dict | None) -> dict:
    """NOTE [step arrivals] of the ``scale`` section's run with the most workers: per shard
    who came last how often and the ranks' own work; shard 0's per-step table; a verdict."""
    runs = [r for r in (scale or {}).get("runs", []) if any(r.get("arrivals") or [])]
    if not runs:
        return {"error": "no scale run with step messages (the scale section failed or ran no herald job)"}
    run = max(runs, key=lambda r: (r["workers"], r["samples_per_s"]))
    shards = [a for a in run["arrivals"] if a and a.get("steps")]
    out = {
        "workers": run["workers"],
        "schedule": run["schedule"],
        "shards": [_shard_view(i, a, run["workers"]) for i, a in enumerate(shards)],
        "per_step": shards[0]["per_step"] if shards else [],
        "per_step_columns": ["step", "last rank", "its lag behind the first rank (ms)", "its margin (ms)"],
    }
    out["verdict"] = _verdict(out["shards"], run["workers"])
    return out


def _shard_view(shard: int, a: dict, workers: int) -> dict:
    steps = a["steps"]
    lags = [p[2] for p in a["per_step"]]
    margins = [p[3] for p in a["per_step"]]
    return {
        "shard": shard,
        "steps": steps,
        "lag_ms_mean": round(statistics.mean(lags), 3),
        "lag_ms_median": round(statistics.median(lags), 3),
        "margin_ms_mean": round(statistics.mean(margins), 3),
        "last_share": {str(r["rank"]): round(r["last"] / steps, 3) for r in a["by_rank"]},
        "own_ms_mean": {str(r["rank"]): r["own_ms_mean"] for r in a["by_rank"]},
        "own_ms_std": {str(r["rank"]): r["own_ms_std"] for r in a["by_rank"]},
        "own_ms_std_within": a.get("own_ms_std_within"),
        "own_ms_std_between": a.get("own_ms_std_between"),
    }


def _verdict(shards: list[dict], workers: int) -> str:
    """One line: is the spread one rank persistently slower, or jitter of every rank's own work?"""
    if not shards:
        return "no released step kept"
    s = shards[0]
    rank, share = max(s["last_share"].items(), key=lambda kv: kv[1])
    within, between = s["own_ms_std_within"], s["own_ms_std_between"]
    head = (
        f"{workers} workers: the last rank came {s['lag_ms_mean']:.2f} ms after the first (mean; "
        f"{s['margin_ms_mean']:.2f} ms after the one before it); rank {rank} came last in {100 * share:.0f}% "
        f"of the steps ({100 / workers:.0f}% if none is special)"
    )
    if within is None or between is None:
        return head + "; no own work measured (no consecutive released steps)"
    means = {r: m for r, m in s["own_ms_mean"].items() if m is not None}
    slow = max(means, key=means.get)
    others = [m for r, m in means.items() if r != slow]
    extra = means[slow] - statistics.median(others) if others else 0.0
    # one rank persistently slower: it comes last far more often than 1/N, and its mean own
    # work stands out by at least half a step-to-step deviation; else the ranks take turns
    persistent = share >= 1.5 / workers and slow == rank and between >= within / 2
    kind = (
        f"persistent: rank {slow}'s own work is {extra:.2f} ms longer than the other ranks' median (a shared "
        "core, a busier micro-batch)"
        if persistent
        else "jitter: the ranks take turns being last; their own work varies from step to step more than "
        "their means differ"
    )
    return f"{head}; own work std {within:.2f} ms within a rank, {between:.2f} ms between ranks: {kind}"
