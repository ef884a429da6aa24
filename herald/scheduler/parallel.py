"""The scheduler's passes on ``threads`` threads (Herald §4.4, "Multi-threading").

:class:`ParallelPasses` is what :class:`herald.scheduler.Scheduler` calls instead of the
serial kernels when ``SchedulerConfig.threads > 1``: the same inputs and outputs, the
work split by :mod:`herald.scheduler.parallel_kernels` (numba ``prange`` over the
threads of numba's pool). The plans are bit-identical to ``threads = 1``; only
``lock_free_allocation`` changes the allocation (deterministically for a thread count).

Threads: numba keeps one pool of ``NUMBA_NUM_THREADS`` threads per process (default: the
cores); the number a kernel uses is set per calling thread, so :meth:`enter` sets it at
every ``submit`` (the scheduler may run on a dispatcher's thread). Why numba ``prange``
and not a Python thread pool over the ``nogil`` kernels: docs/scheduler.md, "Parallel
passes" (measured: a pool costs tens of microseconds per pass, a ``prange`` region a few).
"""

from __future__ import annotations

import numba
import numpy as np

from herald.errors import ConfigError
from herald.scheduler import keymap_kernels as KM
from herald.scheduler import parallel_kernels as PK


def check_threads(threads: int) -> None:
    """Raise :class:`ConfigError` when numba's pool cannot run ``threads`` threads."""
    pool = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # set from the environment at import
    if threads > pool:
        raise ConfigError(
            f"threads={threads} but numba's thread pool has {pool} threads (NUMBA_NUM_THREADS, "
            f"default: the {pool} cores of this host): use threads <= {pool}, or set "
            f"NUMBA_NUM_THREADS={threads} before starting (more threads than cores only adds "
            "switching)"
        )


class ParallelPasses:
    """The scheduler's passes on ``threads`` (>= 2) threads; see the module docstring.

    Raises:
        ConfigError: more threads than numba's pool (:func:`check_threads`).
    """

    def __init__(self, threads: int) -> None:
        check_threads(threads)
        self.threads = int(threads)

    def enter(self) -> None:
        """Give the calling thread's numba kernels ``threads`` threads (call before each step)."""
        numba.set_num_threads(self.threads)

    # ------------------------------------------------------------------ batch
    def lookup_and_gather(self, snap, values: tuple, offsets: tuple, B: int, nnz: int):
        """Slots of a batch's keys (read-only lookup per table on the threads, new keys
        inserted on this one in table-major order) and its sample-major CSR; the same
        arrays as :func:`herald.scheduler.batch_keys.sample_csr`."""
        starts = np.zeros(len(values) + 1, np.int64)
        np.cumsum([v.shape[0] for v in values], out=starts[1:])
        slots = np.empty(nnz, np.int32)
        found = PK.find_tables_par_jit(snap.hk_slot, snap.slot_ids, snap.slot_tab, values, starts, slots)
        done = nnz if found == nnz else 0
        while done < nnz:
            done = KM.insert_missing_tables_jit(
                snap.hk_slot, snap.slot_ids, snap.slot_tab, snap.n_slots, values, slots, done
            )
            if done < nnz:  # all slots in use
                snap.reserve(1)
        samp_off = np.empty(B + 1, np.int64)
        samp_slot = np.empty(nnz, np.int32)
        samp_tab = np.empty(nnz, np.int16)
        PK.gather_samples_tables_par_jit(offsets, slots, samp_off, samp_slot, samp_tab, self.threads)
        return samp_off, samp_slot, samp_tab

    # ------------------------------------------------------------------ allocation
    def laia(
        self, samp_off, samp_slot, samp_tab, table_on, snap, num_workers: int, per_worker: int, rng, lock_free: bool
    ) -> np.ndarray:
        """LAIA (Herald Alg. 1): scores on the threads, then the greedy choice on this thread
        (the serial allocation), or lock-free on the threads (Herald §4.4). int32 [B]."""
        B = samp_off.shape[0] - 1
        score = np.empty((B, num_workers), np.float64)
        PK.laia_scores_par_jit(samp_off, samp_slot, samp_tab, table_on, snap.valid, self.threads, score)
        snap.token[0] += B  # the serial kernel's tokens (marks are scratch: keeps the two in step)
        out = np.empty(B, np.int32)
        if lock_free:
            PK.laia_pick_lockfree_par_jit(score, per_worker, self.threads, rng, out)
        else:
            PK.laia_pick_jit(score, per_worker, rng, out, 0, B)
        return out

    # ------------------------------------------------------------------ step
    def collect_keys(self, batch, snap, count_freq: bool, clear_use: bool, plan_push: bool, out) -> int:
        """:func:`herald.scheduler.step_kernels.collect_keys_jit` on the threads (the same ``batch``
        and ``out`` tuples, the arrays of ``snap``); returns the number of plan pushes."""
        snap.token[0] += out[1].shape[0] - 1
        return PK.collect_keys_par_jit(
            batch, snap.use_mask, snap.freq, snap.owner, count_freq, clear_use, plan_push, out, self.threads
        )

    def gather_plan_keys(self, off, lists, cnts, pp, keymap, out) -> None:
        """:func:`herald.scheduler.plan_build.gather_plan_keys_jit` (the same arguments) on the threads."""
        PK.gather_plan_keys_par_jit(off, lists, cnts, pp, keymap, out, self.threads)
