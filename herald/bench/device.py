"""``herald bench device --out DIR``: every GPU-machine figure in one prepared run.

Made for one call of at most 8 minutes on a 16-core GPU machine that reaches no package
registry (docs/bench.md, "One device run"). Its sections, in this order, each a child
process with its own time budget (a section that fails or runs out of time records its
error, its exit status and the tail of its log, and the run goes on):

1. ``tests``: the CUDA exactness tests (``pytest -k cuda`` over
   tests/integration/test_train_exact.py and tests/worker/test_device_cache.py: BSP jobs on
   the GPU against the single-process reference, the device cache against the host cache);
   without CUDA they are collected and skip, and the section says ``skipped: no CUDA``.
2. ``scale``: ``herald bench scale`` at 1, 2, 4, 8 workers, pinned (``--pin-cores``), with
   the plain PyTorch and TorchRec baselines (TorchRec at every N: ``torchrec_runs``).
3. ``step``: ``herald bench step --workers 8 --shards 4``, one shard's CPU time per step.
4. ``gpu``: herald with 1 worker on the GPU (the device-resident cache) against plain
   PyTorch on the GPU at batch 4,096 and 16,384 (:func:`herald.bench.gpu.gpu_section`);
   without CUDA, plain PyTorch's step runs on the CPU (the same code path) and the section
   says ``no CUDA``.
5. ``profile``: a ``torch.profiler`` trace of 20 training steps of the plain baseline's model
   (herald's DLRM over ``nn.EmbeddingBag``) on the GPU at batch 4,096, written as a Chrome
   trace (``profile_trace.json``) beside the JSON, with the ops taking most device time;
   on the CPU without CUDA. A herald worker is a process of its own that the profiler does
   not reach: its GPU phases are the ``gpu`` section's ``herald_gpu_phases_ms``.
6. ``arrivals``: the shards' per-rank arrival times of the largest ``scale`` run (NOTE [step
   arrivals] in herald/ps/arrivals.py): per step the rank that came last and by how much,
   per rank its own work (mean, standard deviation), and whether the spread is one rank
   persistently slower or jitter.

Output: ``DIR/device.json`` (top-level ``tests``, ``scale``, ``step``, ``gpu``, ``profile``,
``arrivals``, and ``machine``), ``DIR/summary.txt`` (readable tables) and ``DIR/logs/``
(each section's output). ``--wheels DIR`` first installs the wheels of
``scripts/device_wheels.sh`` (``pip install --no-index --no-deps --find-links``) into
``DIR/site``, on every section's ``PYTHONPATH``, and points ``HERALD_DATA`` at ``DIR/data``.
``--smoke``: the same sections and code paths at tiny sizes (1 and 2 workers, TorchRec at
2, a few steps), about a minute on 2 cores, run by ``tests/bench/test_device.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from herald.bench import device_sections
from herald.bench.device_summary import summary_text
from herald.bench.options_device import add_device_arguments
from herald.errors import ConfigError

#: the sections, in their order
SECTIONS = ("tests", "scale", "step", "gpu", "profile", "arrivals")
#: seconds of a whole run (the 8 minutes of one device call) and of a --smoke run
BUDGET_S, SMOKE_BUDGET_S = 480.0, 1200.0
#: the CUDA exactness tests (``-k cuda`` selects their CUDA cases)
CUDA_TESTS = ("tests/integration/test_train_exact.py", "tests/worker/test_device_cache.py")


def _plans(smoke: bool) -> dict[str, dict]:
    """Per section: its budget (s) and its sizes, full or ``--smoke``."""
    if smoke:  # bounds for a hang, not targets: a shared 2-core CI machine can be 5x slower than idle
        return {
            "tests": {"budget_s": 240},
            "scale": {"budget_s": 480, "rows": 8_000, "max_workers": 2, "batch_size": 64, "torchrec_workers": [2]},
            "step": {
                "budget_s": 180,
                "workers": 2,
                "shards": 2,
                "batch_size": 32,
                "steps": 3,
                "warmup": 2,
                "cache_ratio": 0.5,
            },
            "gpu": {"budget_s": 180, "rows": 4_000, "batch_sizes": [256]},
            "profile": {"budget_s": 180, "rows": 2_000, "batch_size": 64, "steps": 20},
        }
    return {
        "tests": {"budget_s": 100},
        "scale": {"budget_s": 200, "rows": 200_000, "max_workers": 8, "batch_size": 256, "torchrec_workers": None},
        "step": {
            "budget_s": 45,
            "workers": 8,
            "shards": 4,
            "batch_size": 256,
            "steps": 20,
            "warmup": 10,
            "cache_ratio": 0.1,
        },
        "gpu": {"budget_s": 100, "rows": 400_000, "batch_sizes": [4096, 16384]},
        "profile": {"budget_s": 30, "rows": 140_000, "batch_size": 4096, "steps": 20},
    }


def _herald(*argv: str) -> list[str]:
    return [sys.executable, "-m", "herald", *argv]


def _commands(plans: dict, parts: pathlib.Path, smoke: bool) -> dict[str, list[str]]:
    """Each section's child command line."""
    sc, st, g, pr = plans["scale"], plans["step"], plans["gpu"], plans["profile"]
    scale = [
        "bench", "scale", "--rows", str(sc["rows"]), "--max-workers", str(sc["max_workers"]),
        "--batch-size", str(sc["batch_size"]), "--schedules", "herald", "--pin-cores", "--no-gpu",
        "--out", str(parts / "scale.json"),
    ]  # fmt: skip
    scale += ["--no-capacity"] if smoke else ["--capacity-seconds", "2"]
    if sc["torchrec_workers"]:
        scale += ["--torchrec-workers", *map(str, sc["torchrec_workers"])]
    step = [
        "bench", "step", "--workers", str(st["workers"]), "--shards", str(st["shards"]),
        "--batch-size", str(st["batch_size"]), "--steps", str(st["steps"]), "--warmup", str(st["warmup"]),
        "--cache-ratio", str(st["cache_ratio"]), "--repeats", "1" if smoke else "3",
        "--out", str(parts / "step.json"),
    ]  # fmt: skip
    tests = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=300", "-k", "cuda",
        f"--junitxml={parts / 'tests.xml'}", *CUDA_TESTS,
    ]  # fmt: skip
    gpu = ["bench", "device", "--section", "gpu", "--part", str(parts / "gpu.json"), "--rows", str(g["rows"])]
    gpu += ["--gpu-batch-sizes", *map(str, g["batch_sizes"])]
    profile = ["bench", "device", "--section", "profile", "--part", str(parts / "profile.json")]
    profile += ["--rows", str(pr["rows"]), "--batch-size", str(pr["batch_size"]), "--steps", str(pr["steps"])]
    return {
        "tests": tests,
        "scale": _herald(*scale),
        "step": _herald(*step),
        "gpu": _herald(*gpu),
        "profile": _herald(*profile),
    }


def _child_env(site: pathlib.Path | None, data: pathlib.Path | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(pathlib.Path(__file__).resolve().parents[2])
    paths = [str(site)] if site is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, root, *filter(None, [os.environ.get("PYTHONPATH")])])
    if data is not None:
        env["HERALD_DATA"] = str(data)
    return env


def install_wheels(wheels: pathlib.Path, timeout_s: float = 120.0) -> pathlib.Path:
    """Install every wheel in ``wheels`` into ``wheels/site`` from that folder alone; the site folder.

    Raises:
        ConfigError: no such folder, no wheel in it, or pip failed (its last lines named).
    """
    if not wheels.is_dir() or not list(wheels.glob("*.whl")):
        raise ConfigError(f"--wheels {wheels}: no .whl files there; fetch them with scripts/device_wheels.sh {wheels}")
    site = wheels / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    cmd += ["--find-links", str(wheels), "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))]
    try:
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--wheels {wheels}: pip install took over {timeout_s:.0f} s") from None
    if got.returncode != 0:
        raise ConfigError(f"--wheels {wheels}: pip install failed: {(got.stderr or got.stdout).strip()[-400:]}")
    return site


def run_child(name: str, cmd: list[str], budget_s: float, logs: pathlib.Path, env: dict) -> dict:
    """Run one section's ``cmd`` in its own process group, at most ``budget_s`` s (then the
    group is killed); ``{"rc", "seconds", "log"}`` and, when it failed, ``"error"`` with the
    log's last lines."""
    log = logs / f"{name}.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=max(1.0, budget_s))
        except subprocess.TimeoutExpired:
            device_sections.kill_group(p)
            rc = None
    got = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "log": str(log)}
    tail = log.read_text(errors="replace").strip().splitlines()[-12:]
    if rc is None:
        got["error"] = f"{name}: stopped after its budget of {budget_s:.0f} s; last lines: " + " | ".join(tail[-4:])
    elif rc != 0:
        got["error"] = f"{name}: exit status {rc}; last lines: " + " | ".join(tail[-6:])
    return got


def run(args: argparse.Namespace) -> dict:
    """Entry of ``herald bench device`` (``--section``: one section's child, internal).

    Raises:
        ConfigError: no ``--out``, or a bad ``--wheels`` folder.
    """
    if args.section:
        return device_sections.run_section(args)
    if not args.out:
        raise ConfigError("herald bench device needs --out DIR (where device.json and summary.txt go)")
    out = pathlib.Path(args.out)
    parts, logs = out / "parts", out / "logs"
    parts.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    t_start = time.monotonic()
    site = install_wheels(pathlib.Path(args.wheels)) if args.wheels else None
    data = pathlib.Path(args.wheels) / "data" if args.wheels and (pathlib.Path(args.wheels) / "data").is_dir() else None
    env = _child_env(site, data)
    plans = _plans(args.smoke)
    commands = _commands(plans, parts, args.smoke)
    results: dict = {"machine": device_sections.machine(), "smoke": bool(args.smoke)}
    total_s = args.budget_s if args.budget_s is not None else (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    for name in SECTIONS[:-1]:
        left = total_s - (time.monotonic() - t_start)
        budget = min(plans[name]["budget_s"], left)
        if budget < 5:
            results[name] = {"error": f"{name}: not run, the run's budget of {total_s:.0f} s is spent"}
            continue
        print(f"herald bench device: {name} (budget {budget:.0f} s)", flush=True)
        child = run_child(name, commands[name], budget, logs, env)
        results[name] = device_sections.collect(name, parts, child, plans[name])
    results["arrivals"] = device_sections.arrivals_section(results.get("scale"))
    for r in (results.get("scale") or {}).get("runs", []):
        r.pop("arrivals", None)  # in the arrivals section (the largest run's) and in parts/scale.json
    results["seconds"] = round(time.monotonic() - t_start, 1)
    (out / "device.json").write_text(json.dumps(results, indent=1, default=str))
    text = summary_text(results)
    (out / "summary.txt").write_text(text)
    print(text)
    print(f"written {out / 'device.json'} and {out / 'summary.txt'}")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="herald bench device", description=__doc__)
    add_device_arguments(p)
    run(p.parse_args(argv))
    return 0
