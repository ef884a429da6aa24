"""``herald bench kernels``: the worker cache's hot path against FBGEMM's table-batched
embeddings, one thread, both in the same process run (the caches: docs/worker.md, "The two
caches").

One step of one micro-batch (``--batch`` samples, ``--tables`` Criteo-shaped tables, bags
of ``--bags`` ids: 1 is one-hot, L > 1 draws lengths in [1, 2L - 1]; ids skewed to the
head of each table, as Criteo's are) = lookup (sum-pooled per bag) + backward (upstream
gradient given) + fused sparse-optimizer update, timed three ways, interleaved rep by rep:

- ``ours``: the executor's path today (herald/worker/executor.py ``_lookup``,
  ``gradients``, ``update_local``): uint64 ids -> slots (:meth:`SlotMap.slots`), gather,
  ``F.embedding_bag`` + autograd backward, divide by the worker count, the PS's numba
  optimizer kernel in place (:meth:`EmbeddingCache.apply_gradients`).
- ``ours_fused``: ids -> slots, then NOTE [fused bag kernels] (herald/worker/kernels.py,
  :meth:`EmbeddingCache.lookup_pooled`): pooling and gradient scatter in numba straight
  on the cache slots, then the same optimizer kernel.
- ``fbgemm``: ``SplitTableBatchedEmbeddingBagsCodegen`` (``EmbeddingLocation.HOST``,
  ``ComputeDevice.CPU``), forward + backward with the optimizer fused into backward
  (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD; FBGEMM has no CPU Adam). It gets the
  row index in each table directly (no uint64 id -> slot map: a TorchRec user hashes ids
  into the table first), so ``ours`` does strictly more work.

Times are medians over ``--reps`` steps after ``--warmup`` untimed ones: ``*_ms`` the
thread's CPU time (``time.thread_time``: one thread does all the work, and on a shared
machine CPU time is what other processes disturb least), ``*_wall_ms`` wall time. The
``arithmetic`` section checks whether FBGEMM reproduces our optimizer arithmetic: the same
rows, state and upstream gradient through both, then the largest relative difference of
the updated embeddings and optimizer state, ``|a - b| / max(1, |b|)`` as
tests/integration/test_train_exact.py measures rows (its exactness tolerance: 1e-6).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F

from herald.bench.options import FBGEMM_OPTIMIZERS
from herald.contracts.plan import KeySet
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import ConfigError
from herald.worker.cache import BagLayout, EmbeddingCache

INSTALL_HINT = "pip install torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 (the pair that loads on torch 2.13)"
LR = {"sgd": 0.1, "adagrad": 0.01, "rowwise_adagrad": 0.01, "adam": 0.001}
ADAGRAD_INITIAL = 0.1


def fbgemm_modules():
    """FBGEMM's TBE classes, or None when fbgemm-gpu(-cpu) is not installed."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        return None
    return EmbOptimType, EmbeddingLocation, ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen


# --------------------------------------------------------------------------- inputs
def table_config(optimizer: str, dim: int) -> TableConfig:
    """The bench's table: ``optimizer`` at its :data:`LR`, Adagrad accumulators at 0.1."""
    return TableConfig(
        name="bench",
        dim=dim,
        optimizer=OptimizerConfig(name=optimizer, lr=LR[optimizer], eps=1e-8, initial_accumulator=ADAGRAD_INITIAL),
    )


def make_step(rng: np.random.Generator, tables: int, batch: int, bag: int, rows_per_table: int) -> dict:
    """One micro-batch: per table, row indices ``idx`` (skewed to the head), bags, and the
    MicroBatch layout of its uint64 ids (``table_ids(t)[idx]``): distinct ids + inverse."""
    idx, offs = [], []
    for _ in range(tables):
        lens = np.ones(batch, np.int64) if bag == 1 else rng.integers(1, 2 * bag, batch)
        off = np.zeros(batch + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        idx.append(np.minimum((rows_per_table * rng.random(off[-1]) ** 3).astype(np.int64), rows_per_table - 1))
        offs.append(off)
    uniq, inv = zip(*(np.unique(i, return_inverse=True) for i in idx))
    id_bounds = np.zeros(tables + 1, np.int64)
    np.cumsum([u.shape[0] for u in uniq], out=id_bounds[1:])
    inverse_bounds = np.zeros(tables + 1, np.int64)
    np.cumsum([i.shape[0] for i in idx], out=inverse_bounds[1:])
    keys = KeySet(
        np.repeat(np.arange(tables, dtype=np.int32), np.diff(id_bounds)),
        np.concatenate([table_ids(t, rows_per_table)[u] for t, u in enumerate(uniq)]),
    )
    flat_off = np.concatenate([o[:-1] + inverse_bounds[t] for t, o in enumerate(offs)] + [inverse_bounds[-1:]])
    return {
        "keys": keys,
        "bags": BagLayout(id_bounds, np.concatenate(inv).astype(np.int32), inverse_bounds, np.stack(offs)),
        "fb_indices": torch.from_numpy(np.concatenate(idx)),
        "fb_offsets": torch.from_numpy(flat_off),
    }


def table_ids(t: int, rows: int) -> np.ndarray:
    """uint64 [rows]: the ids cached for table ``t`` (spread over 64 bits, like hashed ids)."""
    base = np.arange(rows, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return base ^ np.uint64((t * 0xBF58476D1CE4E5B9) & (2**64 - 1))


def initial_rows(rng: np.random.Generator, n: int, tcfg: TableConfig) -> np.ndarray:
    """float32 [n, row_width]: embeddings in [-0.05, 0.05), optimizer state as a trained table's."""
    rows = np.zeros((n, tcfg.row_width), np.float32)
    rows[:, : tcfg.dim] = rng.random((n, tcfg.dim), np.float32) * np.float32(0.1) - np.float32(0.05)
    if tcfg.optimizer.name in ("adagrad", "rowwise_adagrad"):
        rows[:, tcfg.dim :] = rng.random((n, tcfg.row_width - tcfg.dim), np.float32) * np.float32(0.95) + np.float32(
            0.05
        )
    return rows


class Sides:
    """The three implementations of one case, on equal starting rows."""

    def __init__(self, rng, tables: int, rows_per_table: int, tcfg: TableConfig, use_fbgemm: bool):
        self.tcfg, self.T, self.dim = tcfg, tables, tcfg.dim
        init = initial_rows(rng, tables * rows_per_table, tcfg)
        keys = KeySet(
            np.repeat(np.arange(tables, dtype=np.int32), rows_per_table),
            np.concatenate([table_ids(t, rows_per_table) for t in range(tables)]),
        )
        self.ours = EmbeddingCache(len(keys), tcfg.row_width)
        self.ours.put(keys, init)
        self.fused = EmbeddingCache(len(keys), tcfg.row_width)
        self.fused.put(keys, init)
        self.fbgemm = make_fbgemm(tables, rows_per_table, tcfg, init) if use_fbgemm else None
        self.divisor = torch.tensor(1.0)

    def step_ours(self, s: dict, grad_out: torch.Tensor) -> None:
        """The executor's lookup / gradients / update_local today (one worker, all hits)."""
        keys, bags, cache, T = s["keys"], s["bags"], self.ours, self.T
        slots = cache.slots(keys)
        rows = cache.gather(slots, self.dim, torch.device("cpu")).requires_grad_(True)
        nnz = np.diff(bags.inverse_bounds)
        inputs = bags.inverse.astype(np.int64) + np.repeat(bags.id_bounds[:-1], nnz)
        b = bags.offsets.shape[1] - 1
        starts = (bags.offsets[:, :-1] + bags.inverse_bounds[:-1, None]).reshape(-1)
        pooled = F.embedding_bag(torch.from_numpy(inputs), rows, torch.from_numpy(starts), mode="sum")
        pooled.view(T, b, self.dim).transpose(0, 1).backward(grad_out)
        g = (rows.grad.detach() / self.divisor).numpy()
        cache.apply_gradients(slots, g, np.arange(slots.shape[0]), self.tcfg)

    def step_fused(self, s: dict, grad_out: torch.Tensor) -> None:
        """ids -> slots, NOTE [fused bag kernels], the same optimizer kernel."""
        slots = self.fused.slots(s["keys"])
        pooled, grads = self.fused.lookup_pooled(slots, s["bags"], self.dim, 1.0)
        pooled.backward(grad_out)
        self.fused.apply_gradients(slots, grads.rows, np.arange(slots.shape[0]), self.tcfg)

    def step_fbgemm(self, s: dict, grad_out: torch.Tensor) -> None:
        """FBGEMM TBE forward + backward (optimizer fused into backward)."""
        out = self.fbgemm(s["fb_indices"], s["fb_offsets"])
        out.backward(grad_out.reshape(out.shape))


def make_fbgemm(tables: int, rows_per_table: int, tcfg: TableConfig, init: np.ndarray):
    """A CPU TBE of ``tables`` x ``rows_per_table`` rows holding ``init``'s embeddings and
    optimizer state (table t's row i is ``init[t * rows_per_table + i]``)."""
    EmbOptimType, EmbeddingLocation, ComputeDevice, TBE = fbgemm_modules()
    o = tcfg.optimizer
    tbe = TBE(
        [(rows_per_table, tcfg.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
        optimizer=getattr(EmbOptimType, FBGEMM_OPTIMIZERS[o.name]),
        learning_rate=o.lr,
        eps=o.eps,
    )
    with torch.no_grad():
        states = tbe.split_optimizer_states()
        for t, w in enumerate(tbe.split_embedding_weights()):
            part = torch.from_numpy(init[t * rows_per_table : (t + 1) * rows_per_table])
            w.copy_(part[:, : tcfg.dim])
            if states:
                states[t][0].copy_(part[:, tcfg.dim :].reshape(states[t][0].shape))
    return tbe


# --------------------------------------------------------------------------- arithmetic
def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max(1, |b|): the measure of tests/integration/test_train_exact.py."""
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1.0))) if a.size else 0.0


def compare_arithmetic(optimizer: str, dim: int, seed: int = 0, steps: int = 3) -> dict:
    """``steps`` updates of the same rows with the same upstream gradients through ours and
    FBGEMM; the largest relative difference of embeddings and state, and whether it is
    within 1e-6 and bit-identical. Two tables of 500 rows, batch 64, bags of 4."""
    if FBGEMM_OPTIMIZERS[optimizer] is None:
        return {"supported": False, "why": f"FBGEMM has no CPU kernel for {optimizer}"}
    rng = np.random.default_rng(seed)
    tcfg, tables, n = table_config(optimizer, dim), 2, 500
    sides = Sides(rng, tables, n, tcfg, use_fbgemm=True)
    for _ in range(steps):
        s = make_step(rng, tables, 64, 4, n)
        g = torch.from_numpy(rng.standard_normal((64, tables, dim)).astype(np.float32) * 0.1)
        sides.step_ours(s, g)
        sides.step_fbgemm(s, g)
    keys = KeySet(
        np.repeat(np.arange(tables, dtype=np.int32), n), np.concatenate([table_ids(t, n) for t in range(tables)])
    )
    ours = sides.ours.read(sides.ours.slots(keys))
    fb_w = torch.cat([w.detach() for w in sides.fbgemm.split_embedding_weights()]).numpy()
    states = sides.fbgemm.split_optimizer_states()
    fb_s = torch.cat([st[0].detach().reshape(n, -1) for st in states]).numpy() if states else ours[:, dim:]
    emb, state = _rel(fb_w, ours[:, :dim]), _rel(fb_s, ours[:, dim:])
    return {
        "supported": True,
        "max_rel_diff_embedding": emb,
        "max_rel_diff_state": state,
        "within_1e-6": emb <= 1e-6 and state <= 1e-6,
        "bit_identical": bool(np.array_equal(fb_w, ours[:, :dim]) and np.array_equal(fb_s, ours[:, dim:])),
    }


# --------------------------------------------------------------------------- timing
def time_case(args, dim: int, bag: int, rows_per_table: int, optimizer: str, have_fbgemm: bool) -> dict:
    """Median ms per step of each side for one shape (interleaved, rotating order)."""
    rng = np.random.default_rng(args.seed)
    tcfg = table_config(optimizer, dim)
    use_fb = have_fbgemm and FBGEMM_OPTIMIZERS[optimizer] is not None
    sides = Sides(rng, args.tables, rows_per_table, tcfg, use_fb)
    runs = {"ours": sides.step_ours, "ours_fused": sides.step_fused}
    if use_fb:
        runs["fbgemm"] = sides.step_fbgemm
    pool = [make_step(rng, args.tables, args.batch, bag, rows_per_table) for _ in range(4)]
    grads = [torch.from_numpy(rng.standard_normal((args.batch, args.tables, dim)).astype(np.float32)) for _ in range(4)]
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    wall: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(args.warmup + args.reps):
        s, g = pool[r % 4], grads[r % 4]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0, c0 = time.perf_counter(), time.thread_time()
            runs[name](s, g)
            if r >= args.warmup:
                cpu[name].append((time.thread_time() - c0) * 1e3)
                wall[name].append((time.perf_counter() - t0) * 1e3)
    out = {
        "dim": dim,
        "bag": bag,
        "rows_per_table": rows_per_table,
        "optimizer": optimizer,
        "nnz": int(pool[0]["bags"].inverse.shape[0]),
        "distinct_rows": len(pool[0]["keys"]),
    }
    for name in ("ours", "ours_fused", "fbgemm"):
        out[f"{name}_ms"] = statistics.median(cpu[name]) if name in cpu else None
        out[f"{name}_wall_ms"] = statistics.median(wall[name]) if name in wall else None
    if not use_fb:
        out["fbgemm_why"] = "fbgemm-gpu not installed" if not have_fbgemm else f"no CPU {optimizer} in FBGEMM"
    return out


def run(args: argparse.Namespace) -> dict:
    """Check the sizes (:func:`check_arguments`), run every case and the arithmetic check;
    print a table; write ``--out`` JSON."""
    check_arguments(args)
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    have_fb = fbgemm_modules() is not None
    result: dict = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "threads": 1,
        "fbgemm": {"available": have_fb, **({} if have_fb else {"install": INSTALL_HINT})},
        "arithmetic": {},
        "cases": [],
    }
    if have_fb:
        for opt in args.optimizers:
            result["arithmetic"][opt] = {str(d): compare_arithmetic(opt, d) for d in args.dims}
    print(f"{'opt':>16} {'dim':>4} {'bag':>4} {'rows/table':>10} {'ours ms':>9} {'fused ms':>9} {'fbgemm ms':>9}")
    for dim in args.dims:
        for bag in args.bags:
            for rows in args.rows_per_table:
                for opt in args.optimizers:
                    c = time_case(args, dim, bag, rows, opt, have_fb)
                    result["cases"].append(c)
                    fb = f"{c['fbgemm_ms']:9.3f}" if c["fbgemm_ms"] is not None else f"{'n/a':>9}"
                    print(
                        f"{opt:>16} {dim:>4} {bag:>4} {rows:>10} {c['ours_ms']:9.3f} {c['ours_fused_ms']:9.3f} {fb}",
                        flush=True,
                    )
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    return result


def check_arguments(args: argparse.Namespace) -> None:
    """Raise :class:`~herald.errors.ConfigError` on sizes that cannot run."""
    if min(args.batch, args.tables, args.reps, *args.dims, *args.bags, *args.rows_per_table) < 1 or args.warmup < 0:
        raise ConfigError(
            "bench kernels needs --batch, --tables, --reps, --dims, --bags, --rows-per-table >= 1 and --warmup >= 0"
        )
