"""``summary.txt`` of ``herald bench device`` (:mod:`herald.bench.device`): one readable
table per section of device.json."""

from __future__ import annotations

from collections.abc import Callable


def _num(x, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def _head(name: str, entry: dict) -> list[str]:
    child = entry.get("child", {})
    line = f"\n== {name} ({child.get('seconds', '-')} s)"
    return [line] + ([f"   ERROR: {entry['error']}"] if entry.get("error") else [])


def _tests(e: dict) -> list[str]:
    if "tests" not in e:
        return []
    head = (
        f"   {e['status']}: {e['tests']} collected, {e['passed']} passed, {e['failures']} failed, "
        f"{e['errors']} errors, {e['skipped']} skipped"
    )
    return [head] + [f"   failed: {f}" for f in e.get("failed", [])]


def _scale(e: dict) -> list[str]:
    plain = e.get("plain_torch")
    if not plain:
        return []
    out = [f"   plain PyTorch (1 process): {plain['samples_per_s']:,.0f} samples/s"]
    trec = {t.get("workers"): t for t in e.get("torchrec_runs") or []}
    out.append("   | N | herald samples/s | vs plain | scaling | TorchRec at N | herald vs TorchRec | TorchRec mode |")
    out.append("   |---|---|---|---|---|---|---|")
    for r in e.get("runs", []):
        t = trec.get(r["workers"], {})
        out.append(
            f"   | {r['workers']} | {r['samples_per_s']:,.0f} | {r['ratio_vs_plain_torch']:.2f}x | "
            f"{r['scaling_factor']:.2f} | {_num(t.get('samples_per_s'))} | "
            f"{_num(r.get('ratio_vs_torchrec_same_workers'), '.2f')} | {t.get('mode', t.get('error', '-'))} |"
        )
    return out


def _step(e: dict) -> list[str]:
    if "shard_ms_per_step" not in e:
        return []
    s = e["settings"]
    return [
        f"   {s['workers']} workers, {s['shards']} shards: {e['shard_ms_per_step']:.3f} ms per step, "
        f"{e['shard_ns_per_row']:.0f} ns/row ({e['ratio_vs_numba_limit']:.2f}x the numba limit)"
    ]


def _gpu(e: dict) -> list[str]:
    out = [f"   {e['status']}"] if "status" in e else []
    for r in e.get("rows", []):
        if "herald_gpu_samples_per_s" in r:
            out.append(
                f"   batch {r['batch_size']:,}: plain PyTorch GPU {r['plain_torch_gpu_samples_per_s']:,.0f}, "
                f"herald GPU {r['herald_gpu_samples_per_s']:,.0f} ({r['herald_gpu_vs_plain_gpu']:.2f}x), "
                f"herald CPU {r['herald_cpu_samples_per_s']:,.0f} samples/s"
            )
        else:
            cpu = r["plain_torch_cpu_samples_per_s"]
            out.append(f"   batch {r['batch_size']:,}: plain PyTorch on the CPU {cpu:,.0f} samples/s")
    return out


def _profile(e: dict) -> list[str]:
    if "top_ops" not in e:
        return []
    out = [
        f"   {e['status']}, {e['steps']} steps of {e['batch_size']:,}: {e['ms_per_step']:.2f} ms/step; "
        f"trace {e['trace']}"
    ]
    for op in e["top_ops"][:8]:
        name, dev, cpu = op["op"][:48], op["self_device_us"], op["self_cpu_us"]
        out.append(f"   {name:48s} {op['calls']:6d} calls  device {dev:10.0f} us  cpu {cpu:10.0f} us")
    return out


def _arrivals(e: dict) -> list[str]:
    out = ["\n== arrivals: the shards' per-rank arrival times (NOTE [step arrivals])"]
    if e.get("error"):
        return out + [f"   {e['error']}"]
    out.append(f"   {e['verdict']}")
    for s in e["shards"]:
        out.append(
            f"   shard {s['shard']}: {s['steps']} steps, lag {s['lag_ms_mean']:.2f} ms mean ({s['lag_ms_median']:.2f} "
            f"median), margin {s['margin_ms_mean']:.2f} ms; came last: "
            + ", ".join(f"rank {r} {100 * v:.0f}%" for r, v in s["last_share"].items())
        )
        out.append(
            "      own work ms (mean +- std): "
            + ", ".join(
                f"rank {r} {_num(m, '.2f')} +- {_num(s['own_ms_std'][r], '.2f')}" for r, m in s["own_ms_mean"].items()
            )
        )
    tail = e["per_step"][-10:]
    if tail:
        out.append("   last steps (shard 0): " + "; ".join(f"step {p[0]}: rank {p[1]} +{p[2]:.2f} ms" for p in tail))
    return out


#: The sections of ``summary.txt`` after the machine's line: (device.json key, title, body lines of
#: its entry); each under the head of :func:`_head` (the title, the seconds, the entry's error).
SECTIONS: tuple[tuple[str, str, Callable[[dict], list[str]]], ...] = (
    ("tests", "CUDA exactness (pytest -k cuda)", _tests),
    ("scale", "herald at N pinned workers vs plain PyTorch and TorchRec", _scale),
    ("step", "one PS shard's CPU time per global step", _step),
    ("gpu", "herald on the GPU vs plain PyTorch on the GPU", _gpu),
    ("profile", "torch.profiler over the plain baseline's training steps", _profile),
)


def summary_text(results: dict) -> str:
    """The text of ``summary.txt`` for :func:`herald.bench.device.run`'s results."""
    m = results["machine"]
    lines = [
        f"herald bench device{' --smoke' if results.get('smoke') else ''}: {m['cores']} cores, torch {m['torch']}, "
        f"CUDA {'yes: ' + m['device_name'] if m['cuda'] else 'no'}, TorchRec {m['torchrec']}; "
        f"{results.get('seconds', '-')} s in all"
    ]
    for name, title, body in SECTIONS:
        entry = results.get(name) or {"error": "not run"}
        lines += _head(f"{name}: {title}", entry) + body(entry)
    lines += _arrivals(results.get("arrivals") or {"error": "not run"})
    return "\n".join(lines) + "\n"
