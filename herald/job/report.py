"""Progress output, held-out evaluation and the end-of-job report of ``herald train``."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from herald.contracts.modes import BoundedSettings, BspSettings, GbaSettings, HybridSettings, consistency_mode
from herald.dispatch.dispatcher import StepRecord
from herald.errors import HeraldError
from herald.job import report_attempts, report_comm
from herald.job.breakdown import format_breakdown, phase_breakdown, plot_breakdown
from herald.job.metrics import log_loss, roc_auc
from herald.ps import PSClient
from herald.scheduler.plan import CAUSES

_PULLS = ("miss_pull", "update_pull")
_PUSHES = ("grad_push", "plan_push", "evict_push")


class Progress:
    """A tqdm bar over steps showing samples/s, loss, hit rate, transmissions/step and,
    once there are any, the bad records skipped so far per reason (``skipped()``:
    reason -> count, e.g. ``GlobalBatches.skipped``; NOTE [bad records])."""

    def __init__(
        self,
        cfg: Any,
        *,
        enabled: bool = True,
        total_steps: int | None = None,
        skipped: Callable[[], dict[str, int]] | None = None,
    ):
        self.cfg, self.enabled = cfg, enabled
        self._skipped = skipped
        self._bar = None
        self._t0 = time.perf_counter()
        self._samples = 0
        self._window: list[StepRecord] = []
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, unit="step", desc=f"train [{cfg.scheduling.schedule}]", dynamic_ncols=True
            )

    def update(self, rec: StepRecord) -> None:
        self._samples += self.cfg.global_batch
        self._window.append(rec)
        if len(self._window) >= self.cfg.eval_every:
            pv = progressive(self._window)
            line = (
                f"step {rec.step}: progressive validation over {pv['samples']:,} samples: "
                f"AUC {pv['auc']:.4f} logloss {pv['logloss']:.4f}"
            )
            skipped = format_skipped(self._skipped() if self._skipped else {})
            if skipped:
                line += f"  (bad records skipped: {skipped})"
            if self._bar is not None:
                self._bar.write(line)
            elif self.enabled:
                print(line)
            self._window = []
        if self._bar is None:
            return
        c = rec.counts.sum(axis=0)
        used = c[CAUSES.index("hit")] + c[CAUSES.index("miss_pull")] + c[CAUSES.index("update_pull")]
        hit = c[CAUSES.index("hit")] / used if used else float("nan")
        moved = int(sum(c[CAUSES.index(k)] for k in _PULLS + _PUSHES))
        rate = self._samples / max(1e-9, time.perf_counter() - self._t0)
        skipped = format_skipped(self._skipped() if self._skipped else {})
        self._bar.set_postfix_str(
            f"{rate:,.0f} samples/s loss {rec.loss:.4f} hit {hit:.2f} tx/step {moved}"
            + (f" skipped {skipped}" if skipped else ""),
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def format_skipped(skipped: dict[str, int]) -> str:
    """``"bad_label 3, bad_dense 1"`` (largest first), or ``""`` when nothing was skipped."""
    items = sorted(((k, v) for k, v in skipped.items() if v), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k} {v:,}" for k, v in items)


def progressive(records: list[StepRecord]) -> dict[str, float]:
    """AUC and log loss of the predictions made before each step's update (progressive
    validation: every sample is scored before the model trains on it)."""
    y = np.concatenate([r.labels for r in records]) if records else np.zeros(0)
    p = np.concatenate([r.probs for r in records]) if records else np.zeros(0)
    if y.size == 0:
        return {"samples": 0, "auc": float("nan"), "logloss": float("nan")}
    return {"samples": int(y.size), "auc": roc_auc(y, p), "logloss": log_loss(y, p)}


def evaluate(job: dict[str, Any], source, run_dir: pathlib.Path, ps_addresses, batch_rows: int = 4096) -> dict:
    """Log loss and AUC of the trained model on ``source`` (the held-out split).

    Reads rank 0's dense parameters from ``run_dir`` and the embeddings from the PS
    (after the final flush the PS holds every latest row). Also checks that every
    rank ended with identical dense parameters.

    A bounded PS (``--ps-max-rows N``, NOTE [bounded ps]) refuses a request with more than
    N new keys of a table, so the client splits the pulls (as it splits every request:
    :meth:`PSClient.declare`) at ``min(max_keys_per_request, N)`` keys a request; the rows evicted
    while evaluating, and the evicted rows it reads again (re-initialised), are counted
    (:func:`evictions` of the shards' stats before and after).

    Returns:
        ``eval_rows`` (int), and with rows: ``auc``, ``logloss`` (float), ``dense_replicas_equal``
        (bool), ``ps_evicted_rows`` and ``ps_evicted_rows_read_again`` (int, during the evaluation).

    Raises:
        HeraldError: a rank's dense parameters are missing.
    """
    # on use: torch (1.2 s to import) is not on the launcher's start-up path (its report line "start-up")
    import torch
    import torch.nn.functional as F

    from herald.worker.trainer import model_from_job

    ranks = sorted(pathlib.Path(run_dir).glob("dense-rank*.pt"))
    if not ranks:
        raise HeraldError(f"no dense-rank*.pt in {run_dir}: the workers did not save their parameters")
    states = [torch.load(p, weights_only=True) for p in ranks]
    replicas_equal = all(all(torch.equal(s[k], states[0][k]) for k in states[0]) for s in states[1:])
    model = model_from_job(job)
    model.load_state_dict(states[0])
    model.eval()
    tables = list(job.tables)
    dim = tables[0].dim
    labels, probs = [], []
    with (
        PSClient(list(ps_addresses), tables=tables, timeout_ms=job.timeout_ms, keys_dir=job.keys_dir) as client,
        torch.no_grad(),
    ):
        before = client.stats()
        while (batch := source.read(batch_rows)) is not None:
            uniq = [np.unique(v, return_inverse=True) for v in batch.values]
            got = client.pull_async({t: u for t, (u, _) in enumerate(uniq) if u.size}).wait()
            pooled = []
            for t, (u, inv) in enumerate(uniq):
                w = torch.from_numpy(
                    np.ascontiguousarray(got[t][:, :dim]) if u.size else np.zeros((0, dim), np.float32)
                )
                pooled.append(
                    F.embedding_bag(
                        torch.from_numpy(inv.astype(np.int64)), w, torch.from_numpy(batch.offsets[t][:-1]), mode="sum"
                    )
                )
            logits = model(torch.from_numpy(batch.dense), torch.stack(pooled, dim=1))
            probs.append(torch.sigmoid(logits).numpy())
            labels.append(batch.labels)
        first = evictions(before)
        during = {k: v - first[k] for k, v in evictions(client.stats()).items()}
    source.close()
    if not labels:
        return {"eval_rows": 0}
    y, p = np.concatenate(labels), np.concatenate(probs)
    return {
        "eval_rows": int(y.shape[0]),
        "auc": roc_auc(y, p),
        "logloss": log_loss(y, p),
        "dense_replicas_equal": bool(replicas_equal),
        **during,
    }


def evictions(ps_stats: list[dict] | None) -> dict[str, int]:
    """The rows a bounded PS evicted (NOTE [bounded ps]) over every shard and table of
    ``ps_stats`` (:meth:`PSClient.stats`; None: none): ``ps_evicted_rows``, and
    ``ps_evicted_rows_read_again``, the inserts of keys evicted earlier (re-initialised
    rows read again: NOTE [evictions read again] in herald/ps/evicted.py)."""
    tables = [t for st in ps_stats or () for t in st["tables"].values()]
    return {
        "ps_evicted_rows": sum(t.get("evicted_rows", 0) for t in tables),
        "ps_evicted_rows_read_again": sum(t.get("evicted_rows_read_again", 0) for t in tables),
    }


def build(
    cfg: Any,
    records: list[StepRecord],
    train_s: float,
    metrics: dict,
    *,
    batches_info: dict,
    split_info: dict,
    capacity_rows: int,
    dispatcher_s: dict[str, float] | None = None,
    ps_stats: list[dict] | None = None,
    skipped: dict[str, dict[str, int]] | None = None,
    interrupted: dict[str, Any] | None = None,
    scheduler: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report dict: throughput, metrics, transmissions by cause and in bytes, and
    where the time went (:func:`herald.job.breakdown.phase_breakdown`).

    ``skipped``: the bad records skipped per split, ``{"train": {reason: count}, "eval":
    {...}}`` (NOTE [bad records]); ``interrupted``: ``{"signal": "SIGINT", "at_step": N (steps
    trained in the job, where --resume continues), "checkpoint": its folder name or None}``
    when a signal stopped the job (None: it ran to its end). ``rejected``: the messages
    the dispatcher dropped per kind (NOTE [peer validation] in herald/dispatch/peers.py).

    ``ps_evicted_rows``, ``ps_evicted_rows_read_again``: :func:`evictions` of ``ps_stats``
    (taken after training; the evaluation's own are in ``metrics``: :func:`evaluate`).

    ``scheduler``: :meth:`herald.job.data.JobData.scheduler_stats` (threads, and with
    ``--scheduling-budget`` adaptive LAIA's k over the job: first, min, median, max,
    final, the [step, k] changes, steps where the budget was unreachable).

    ``samples_per_second`` is the steady training throughput: the samples of steps
    1..n over the time from step 0's ack to step n's (start-up, the first step's
    compilation and the evaluation are not in it); ``wall_samples_per_second`` divides
    every sample by ``train_seconds``, start-up included.

    ``ps_requests`` and ``ps_requests_per_worker_per_shard_per_step``: :func:`ps_requests`
    over ``cfg.workers`` workers and the shards (one ``ps_stats`` entry each; without
    them ``cfg.num_ps_shards``). The job's CPU time (:func:`cpu_time`) is added by the
    caller, who measured it.
    """
    counts = np.sum([r.counts.sum(axis=0) for r in records], axis=0) if records else np.zeros(len(CAUSES), np.int64)
    by_cause = {c: int(v) for c, v in zip(CAUSES, counts)}
    consistency = consistency_block(cfg, records)
    by_cause["update_pull"] -= consistency["stale_reads"]  # planned, but read from the cache (bounded)
    if not consistency_mode(consistency["mode"]).planned_transmissions:
        # hybrid: no plan runs, every row read is pulled, gradients pushed per key
        by_cause = {
            **dict.fromkeys(by_cause, 0),
            "miss_pull": consistency["reads"],
            "grad_push": consistency["gradient_rows_pushed"],
        }
    row_bytes = cfg.embedding.dim * 4
    pulls = sum(by_cause[c] for c in _PULLS)
    pushes = sum(by_cause[c] for c in _PUSHES)
    steps = len(records)
    samples = steps * cfg.global_batch
    steady_s = records[-1].acked_at - records[0].acked_at if steps > 1 else 0.0
    steady = (steps - 1) * cfg.global_batch / steady_s if steady_s > 0 else float("nan")
    return {
        "config": {k: v for k, v in cfg.flags().items() if k != "source_options"},
        "interrupted": interrupted,
        "skipped": {"train": dict((skipped or {}).get("train", {})), "eval": dict((skipped or {}).get("eval", {}))},
        "rejected": dict(records[-1].rejected) if records else {},
        **evictions(ps_stats),  # during training (the evaluation's are in metrics)
        "capacity_rows_per_worker": int(capacity_rows),
        "split": split_info,
        "data": batches_info,
        "steps": steps,
        "samples": samples,
        "train_seconds": train_s,
        "samples_per_second": steady,
        "wall_samples_per_second": samples / train_s if train_s > 0 else float("nan"),
        "startup_seconds": max(0.0, train_s - steady_s) if steps > 1 else train_s,
        "final_loss": final_loss(records),
        "metrics": metrics,
        "progressive_validation": progressive(records),
        "transmissions": {
            **by_cause,
            "pulls": pulls,
            "pushes": pushes,
            "total": pulls + pushes,
            "embedding_bytes": (pulls + pushes) * row_bytes,
        },
        "wire_bytes": {
            "pulled": int(sum(r.bytes_pulled for r in records)),
            "pushed": int(sum(r.bytes_pushed for r in records)),
            "allreduced": int(sum(r.bytes_allreduced for r in records)),
            "dense": int(sum(r.bytes_dense for r in records)),
        },
        **ps_requests(records, cfg.workers, len(ps_stats) if ps_stats else cfg.num_ps_shards),
        "compression": report_comm.compression(cfg, {c: by_cause[c] for c in _PULLS + _PUSHES}),
        "groups": report_comm.groups(cfg),
        "phases": phase_breakdown(records, steady_s or train_s, dispatcher_s, ps_stats, job_s=train_s),
        "scheduling_ms": {
            "median": float(np.median([r.schedule_ms for r in records])) if records else 0.0,
            "p99": float(np.percentile([r.schedule_ms for r in records], 99)) if records else 0.0,
        },
        "scheduler": scheduler,
        "consistency": consistency,
    }


def ps_requests(records: list[StepRecord], workers: int, shards: int) -> dict[str, Any]:
    """The report's ``ps_requests`` (int: every request the workers sent to any PS shard,
    from the acks' ``ps_requests``) and ``ps_requests_per_worker_per_shard_per_step``
    (float: that total / (``workers`` x ``shards`` x steps), ``workers`` those acking each
    record; 0.0 without steps). E.g. 2 workers, 2 shards, 3 steps of 8 requests each
    (every worker sends one request per shard, twice a step): 24 / 12 = 2.0."""
    total = int(sum(r.ps_requests for r in records))
    denominator = len(records) * workers * shards
    return {
        "ps_requests": total,
        "ps_requests_per_worker_per_shard_per_step": total / denominator if denominator else 0.0,
    }


def cpu_time(
    cpu_s: float, samples: int, scope: str, steady_s: float | None = None, steady_samples: int = 0
) -> dict[str, Any]:
    """The report's ``cpu_seconds`` (user + sys CPU seconds of the processes ``scope``
    names: :func:`herald.procs.cpu_seconds` over the job), ``cpu_us_per_sample``
    (microseconds per trained sample; nan without samples), ``cpu_scope``, and
    ``steady_cpu_us_per_sample``: ``steady_s`` seconds (NOTE [steady cpu] in
    herald/job/runner.py: the CPU from the first step to the end of serving) over the
    ``steady_samples`` of the steps after the first (nan without them)."""
    steady = 1e6 * steady_s / steady_samples if steady_s is not None and steady_samples else float("nan")
    return {
        "cpu_seconds": float(cpu_s),
        "cpu_us_per_sample": 1e6 * cpu_s / samples if samples else float("nan"),
        "cpu_scope": scope,
        "steady_cpu_us_per_sample": steady,
    }


#: the start-up milestones in order, with their words in report.txt (herald/job/runner.py StartupClock)
STARTUP_MILESTONES = (
    ("imported", "imported"),
    ("data_ready", "data ready"),
    ("ps_ready", "PS ready"),
    ("workers_ready", "workers ready"),
    ("first_step", "first step acked"),
)


def startup_line(startup: dict[str, float]) -> str:
    """report.txt's start-up line: each milestone reached, seconds after ``herald train`` started."""
    got = [f"{words} {startup[k]:.1f} s" for k, words in STARTUP_MILESTONES if k in startup]
    return "start-up (seconds after herald train started): " + (", ".join(got) if got else "not measured")


def final_loss(records: list[StepRecord]) -> float:
    """The report's ``final_loss``: the mean training loss of the last 10 acked steps (nan if none)."""
    return float(np.mean([r.loss for r in records[-10:]])) if records else float("nan")


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
    block = CONSISTENCY_BLOCKS[consistency_mode(getattr(cfg, "consistency", "bsp")).name]
    return block(cfg, records, total, settings, total.get("reads", 0))


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


#: Each mode's consistency block, by mode name (the report's registry of the modes).
CONSISTENCY_BLOCKS = {
    BspSettings.name: plan_block,
    BoundedSettings.name: bounded_block,
    HybridSettings.name: hybrid_block,
    GbaSettings.name: gba_block,
}


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


def format_adaptive(rep: dict[str, Any]) -> list[str]:
    """The report line of adaptive LAIA (Herald §4.3): the budget and k over the job."""
    ad = (rep.get("scheduler") or {}).get("adaptive")
    if not ad or not ad.get("k"):
        return []
    k = ad["k"]
    budget = "no budget yet" if ad["budget_ms"] is None else f"{ad['budget_ms']:.2f} ms"
    if ad["mode"] == "auto" and ad["period_ms_median"] is not None:
        budget += f" = {ad['fraction']:g} x step period {ad['period_ms_median']:.2f} ms"
    line = (
        f"adaptive LAIA ({ad['mode']} budget: {budget}): tables scored k first {k['first']}, min {k['min']}, "
        f"median {k['median']}, max {k['max']}, final {k['final']} of {ad['num_tables']}"
    )
    if ad["budget_unreachable"]:
        line += (
            f"; budget unreachable on {ad['budget_unreachable']:,} of {ad['steps']:,} steps (even k = 1 "
            "would not fit: k kept)"
        )
    return [line]


def format_text(rep: dict[str, Any]) -> str:
    m, tx = rep["metrics"], rep["transmissions"]
    lines = [
        f"schedule {rep['config']['schedule']}  workers {rep['config']['workers']}  batch {rep['config']['batch_size']}"
        f"  cache {rep['capacity_rows_per_worker']} rows/worker",
        f"steps {rep['steps']}  samples {rep['samples']:,}  time {rep['train_seconds']:.1f} s "
        f"(start-up {rep['startup_seconds']:.1f} s)  throughput {rep['samples_per_second']:,.0f} samples/s "
        f"(wall {rep['wall_samples_per_second']:,.0f})  (not trained, partial last batch: "
        f"{rep['data']['dropped_samples']})",
        f"final train loss {rep['final_loss']:.4f}",
        startup_line(rep.get("startup") or {})
        + (" (the job's last 10 acks, whichever group's: each group's is below)" if rep.get("group_streams") else ""),
        format_consistency(rep),
    ]
    stop = rep.get("interrupted")
    if stop:
        lines.insert(
            0,
            f"interrupted at step {stop['at_step']} by {stop['signal']} ({stop['at_step']} steps trained; "
            + (
                f"checkpoint {stop['checkpoint']} written: continue with --resume)"
                if stop.get("checkpoint") is not None
                else "no checkpoint)"
            ),
        )
    for split, counts in (rep.get("skipped") or {}).items():
        if any(counts.values()):
            name = {"train": "training", "eval": "held-out"}.get(split, split)
            lines.append(f"bad records skipped ({name} split): {sum(counts.values()):,} ({format_skipped(counts)})")
    if any((rep.get("rejected") or {}).values()):
        lines.append(
            "messages the dispatcher dropped (malformed, or from peers that are not this job's workers): "
            + ", ".join(f"{k} {n:,}" for k, n in rep["rejected"].items() if n)
            + " (docs/operations.md)"
        )
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
    lines.extend(report_attempts.format_lines(rep))
    if rep.get("ps_evicted_rows") or m.get("ps_evicted_rows"):
        lines.append(
            "PS rows evicted by --ps-max-rows (least recently used; an evicted row read again is "
            "re-initialised): "
            + "; ".join(
                f"{name} {d.get('ps_evicted_rows', 0):,} evicted, {d.get('ps_evicted_rows_read_again', 0):,} read again"
                for name, d in (("training", rep), ("evaluation", m))
            )
        )
    if m.get("eval_rows"):
        lines.append(
            f"held-out ({m['eval_rows']:,} rows): AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  "
            f"dense replicas equal: {m['dense_replicas_equal']}"
        )
    pv = rep["progressive_validation"]
    if pv["samples"]:
        lines.append(
            f"progressive validation ({pv['samples']:,} training samples, scored before each update): "
            f"AUC {pv['auc']:.4f}  logloss {pv['logloss']:.4f}"
        )
    lines.append("transmissions: " + "  ".join(f"{c} {tx[c]:,}" for c in CAUSES))
    lines.append(
        f"  pulls {tx['pulls']:,}  pushes {tx['pushes']:,}  total {tx['total']:,}  "
        f"({tx['embedding_bytes'] / 2**20:.1f} MiB of embeddings); on the wire: pulled "
        f"{rep['wire_bytes']['pulled'] / 2**20:.1f} MiB, pushed {rep['wire_bytes']['pushed'] / 2**20:.1f} MiB"
        + (
            f" (each with {rep['wire_bytes']['dense'] / 2**20:.1f} MiB of dense gradients, summed on the shards)"
            if rep["wire_bytes"]["dense"]
            else ""
        )
        + (
            f"; replicated tables all-reduced {rep['wire_bytes']['allreduced'] / 2**20:.1f} MiB"
            if rep["wire_bytes"]["allreduced"]
            else ""
        )
    )
    lines.append(
        f"PS requests {rep['ps_requests']:,}: {rep['ps_requests_per_worker_per_shard_per_step']:.2f} "
        "per worker per shard per step"
    )
    if "cpu_seconds" in rep:
        steady = rep.get("steady_cpu_us_per_sample", float("nan"))
        lines.append(
            f"CPU time {rep['cpu_seconds']:.1f} s, {rep['cpu_us_per_sample']:.1f} us per trained sample"
            + (f" ({steady:.1f} in steady training: start-up, evaluation and report out)" if steady == steady else "")
            + f": {rep['cpu_scope']}"
        )
    lines.extend(report_comm.format_lines(rep))
    lines.extend(format_adaptive(rep))
    lines.extend(format_breakdown(rep.get("phases", {})))
    return "\n".join(lines)


def write(rep: dict[str, Any], records: list[StepRecord], run_dir: pathlib.Path) -> None:
    """Write ``report.json``, ``report.txt`` and ``report.png`` (loss and transmissions per step)."""
    run_dir = pathlib.Path(run_dir)
    (run_dir / "report.json").write_text(json.dumps(rep, indent=2, default=float))
    text = format_text(rep)
    (run_dir / "report.txt").write_text(text + "\n")
    print(text)
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 1, 0.7]})
    losses = np.array([r.loss for r in records])
    ax1.plot(steps, losses, lw=0.5, alpha=0.4, label="per step")
    window = max(1, len(losses) // 50)
    if window > 1:
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax1.plot(steps[window - 1 :], smooth, lw=1.5, label=f"mean of {window} steps")
    ax1.legend(fontsize=8)
    ax1.set(xlabel="step", ylabel="train loss (mean over workers)", title="loss")
    per_cause = np.array([r.counts.sum(axis=0) for r in records])
    for c in ("miss_pull", "update_pull", "grad_push", "plan_push", "evict_push"):
        ax2.plot(steps, per_cause[:, CAUSES.index(c)], lw=0.8, label=c)
    ax2.set(xlabel="step", ylabel="embeddings moved", title=f"transmissions per step [{rep['config']['schedule']}]")
    ax2.legend(fontsize=8)
    plot_breakdown(ax3, rep.get("phases", {}))
    fig.tight_layout()
    fig.savefig(run_dir / "report.png", dpi=110)
    plt.close(fig)
    print(f"report: {run_dir / 'report.txt'}, {run_dir / 'report.json'}, {run_dir / 'report.png'}")
