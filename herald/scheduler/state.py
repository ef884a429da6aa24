"""Cache snapshots: the scheduler's mirror of every worker cache (Herald §5), and the key map.

One object holds, for every tracked key (slot):

==================  =====================  ==========================================
array               dtype [shape]          meaning
==================  =====================  ==========================================
``hk_slot``         int32 [H]              buckets of the key map -> slot (H >= 2 S)
``slot_ids``        uint64 [S]             id of the slot's key (never narrowed)
``slot_tab``        int16 [S]              table of the slot's key
``cached``          uint64 [S]             bit w: worker w caches the key
``valid``           uint64 [S]             bit w: worker w's copy is latest
``owner``           int32 [S]              worker with the only latest copy, -1 = PS
``use_mask``        uint64 [S]             bit w: w uses the key in the current step
``mark``            int32 [S]              dedup scratch (tokens, reset before 2**30)
``freq``            int32 [S] (aux[:, 0])  accesses so far (table profiler, adaptive only)
``bcount``          int32 [S] (aux[:, 1])  samples of the batch using the key (costaware)
``pos``             int32 [S, W]           LRU log / LFU heap index of the key in w
==================  =====================  ==========================================

``cached``, ``valid``, ``use_mask``, ``owner``, ``mark`` and ``pos`` are strided views of one
record array ``rec`` uint64 [S, 8 * ceil((4 + ceil(W / 2)) / 8)]: the state of a key is
one 64-byte line for W <= 8.

plus per-worker structures sized by the capacity ``C`` (LRU: an append-only log of slots
int32 [W, 3C + 16], stale entries -1; LFU: heap slot int32 and priority int64 [W, C]).

Memory per tracked key: ``18 + 64 * ceil((4 + ceil(W / 2)) / 8)`` bytes of per-key arrays
(ids 8, table 2, record 64 for W <= 8, aux 8: 82 B at W = 8, 338 B at W = 64), plus the
hash table (4 B entries, 2-4 per key: 8-16 B), plus the per-worker cache structures,
``12 W C`` bytes (LRU log, 3C entries: staggered compactions, see
``snapshot_lru_step_jit``) or ``12 W C`` (LFU heap), i.e. 9.6 B per key for W = 8 and 10%
caches. Measured with W = 8, 10% LRU caches: 105.0 B per key at 10M keys; 99.1 B at 100M
keys with the former 2C-entry log, i.e. 102.3 B now (docs/scheduler.md).
"""

from __future__ import annotations

import numpy as np

from herald import keymap
from herald.errors import DataError
from herald.scheduler import parallel_kernels as PK
from herald.scheduler import snapshot_kernels as SK
from herald.scheduler import step_kernels as STK


def step_outputs(n: int, num_workers: int, counts: np.ndarray) -> tuple:
    """The outputs of a step's before-forward kernels for ``n`` keys
    (:data:`herald.scheduler.snapshot_kernels.STEP_OUTPUTS`): ``(ev_slot int32 [n], ev_wb
    bool [n], ev_cnt int64 [W], pull_slot int32 [n], pull_cnt int64 [W], counts)``."""
    W = num_workers
    return (
        np.empty(n, np.int32),
        np.zeros(n, np.bool_),
        np.zeros(W, np.int64),
        np.empty(n, np.int32),
        np.zeros(W, np.int64),
        counts,
    )


class Snapshots:
    """Cache snapshots of ``num_workers`` workers with ``capacity_rows`` rows each.

    Args:
        num_workers: W (1..64). capacity_rows: C >= 1. policy: ``"lru"`` or ``"lfu"``.
        initial_slots: slots reserved up front (grows by doubling).
    """

    def __init__(self, num_workers: int, capacity_rows: int, policy: str, initial_slots: int = 1 << 14) -> None:
        self.num_workers = W = num_workers
        self.capacity_rows = C = capacity_rows
        self.policy = policy
        self.n_slots = np.zeros(1, np.int64)
        self.token = np.zeros(1, np.int64)
        S = max(16, int(initial_slots))
        self.hk_slot = np.full(keymap.bucket_count(S), -1, np.int32)
        self.slot_ids = np.zeros(S, np.uint64)
        self.slot_tab = np.zeros(S, np.int16)
        self.rec = self._new_records(S)
        self._record_views()
        self.aux = np.zeros((S, 2), np.int32)
        self._aux_views()
        self.size = np.zeros(W, np.int64)
        if policy == "lru":
            # LRU order: append-only log of slots per worker, compacted when full; worker w
            # uses 3C + 16 - wC/W entries (staggered compactions, snapshot_lru_step_jit)
            self.log = np.zeros((W, 3 * C + 16), np.int32)
            self.head = np.zeros(W, np.int64)
            self.tail = np.zeros(W, np.int64)
        else:
            self.hslot = np.zeros((W, C), np.int32)
            self.hprio = np.zeros((W, C), np.int64)
            self.seq = np.zeros(W, np.int64)

    _PER_SLOT = ("slot_ids", "slot_tab", "aux")
    _VIEWS = ("cached", "valid", "owner", "use_mask", "pos", "mark", "freq", "bcount")

    def _new_records(self, S: int) -> np.ndarray:
        # One record per key: cached, valid, use_mask (uint64 each), owner and mark (int32
        # each), then pos int32 [W], padded to whole 64-byte lines (one line for W <= 8):
        # the per-key state a step touches is one cache line.
        words = 4 + (self.num_workers + 1) // 2
        template = np.zeros(-(-words // 8) * 8, np.uint64)
        template.view(np.int32)[6] = -1  # owner -1
        template.view(np.int32)[8 : 8 + self.num_workers] = -1  # pos -1
        rec = np.empty((S, template.shape[0]), np.uint64)
        rec[:] = template
        return rec

    def _record_views(self) -> None:
        rec = self.rec
        r32 = rec.view(np.int32)
        self.cached = rec[:, 0]
        self.valid = rec[:, 1]
        self.use_mask = rec[:, 2]
        self.owner = r32[:, 6]
        self.mark = r32[:, 7]
        self.pos = r32[:, 8 : 8 + self.num_workers]

    def _aux_views(self) -> None:
        # popularity (table profiler) and batch count (costaware): strided views of aux
        self.freq = self.aux[:, 0]
        self.bcount = self.aux[:, 1]

    # ------------------------------------------------------------------ key map
    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more keys (slot arrays double; the hash table stays >= 2x)."""
        need = int(self.n_slots[0]) + int(extra)
        S = self.slot_ids.shape[0]
        if need > S:
            newS = max(need, 2 * S)
            for name in self._PER_SLOT:
                old = getattr(self, name)
                new = np.zeros((newS,) + old.shape[1:], old.dtype)
                new[:S] = old
                setattr(self, name, new)
            self._aux_views()
            rec = self._new_records(newS)
            rec[:S] = self.rec
            self.rec = rec
            self._record_views()
            if 2 * newS > self.hk_slot.shape[0]:
                self.hk_slot = keymap.new_buckets(newS, self.slot_ids, self.slot_tab, int(self.n_slots[0]))

    def renew_tokens(self) -> None:
        """Keep dedup tokens within int32 (call between steps; O(S) once per ~10**6 steps)."""
        if self.token[0] > (1 << 30):
            self.mark[:] = 0
            self.token[0] = 0

    def lookup(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Slots (int32 [n]) of keys ``(tables int16 [n], ids uint64 [n])``, inserting new ones."""
        out = np.empty(ids.shape[0], np.int32)
        done = 0
        while done < ids.shape[0]:
            done += keymap.find_or_insert_many_jit(
                self.hk_slot, self.slot_ids, self.slot_tab, self.n_slots, tables[done:], ids[done:], out[done:]
            )
            if done < ids.shape[0]:
                self.reserve(1)
        return out

    def lookup_tables(self, values: tuple, nnz: int) -> np.ndarray:
        """Slots (int32 [nnz]) of a batch's keys, table-major, from ``values``: a tuple of
        T uint64 C-contiguous arrays (``nnz`` ids in all), inserting new ones; the same
        slots as :meth:`lookup` of the concatenation, without building it."""
        out = np.empty(nnz, np.int32)
        done = keymap.find_or_insert_tables_jit(self.hk_slot, self.slot_ids, self.slot_tab, self.n_slots, values, out)
        if done < nnz:  # all slots in use: grow and finish the rest one table-major key list
            T = len(values)
            tabs = np.repeat(np.arange(T, dtype=np.int16), [v.shape[0] for v in values])
            out[done:] = self.lookup(tabs[done:], np.concatenate(values)[done:])
        return out

    @property
    def num_keys(self) -> int:
        """Distinct keys tracked so far."""
        return int(self.n_slots[0])

    # ------------------------------------------------------------------ step
    def before_forward(self, keys: np.ndarray, off: np.ndarray, counts: np.ndarray, threads: int = 1):
        """Touch / evict / pull for every worker (NOTE [step protocol], steps 1-2); see the kernels. With
        ``threads > 1`` the workers are split over that many threads (the same result,
        :mod:`herald.scheduler.parallel_kernels`; the caller set numba's thread count).

        Returns ``(ev_slot, ev_wb, ev_cnt, pull_slot, pull_cnt, err)`` laid out at ``off[w]``.
        """
        out = step_outputs(keys.shape[0], self.num_workers, counts)
        err = np.zeros(2, np.int64)
        par = (threads,) if threads > 1 else ()
        cap = self.capacity_rows
        if self.policy == "lru":
            lru = (self.cached, self.valid, self.owner, self.pos, self.log, self.head, self.tail, self.size)
            (PK.snapshot_lru_par_jit if par else SK.snapshot_lru_step_jit)(keys, off, cap, lru, out, err, *par)
        else:
            lfu = (self.cached, self.valid, self.owner, self.pos, self.hslot, self.hprio, self.size, self.seq)
            kernel = PK.snapshot_lfu_par_jit if par else SK.snapshot_lfu_step_jit
            kernel(keys, off, self.use_mask, cap, lfu, out, err, *par)
        return out[:5] + (err,)

    def after_backward(self, keys: np.ndarray, off: np.ndarray, full_sync: bool, threads: int = 1) -> tuple:
        """Gradient pushes and local updates of every worker (NOTE [step protocol], steps
        3-4), on ``threads`` threads when > 1 (the same result, as :meth:`before_forward`).

        Returns ``(gp_slot int32, gp_contrib uint16, ul_slot int32, gp_cnt int64 [W],
        ul_cnt int64 [W])``, the slot lists laid out at ``off[w]``.
        """
        n, W = keys.shape[0], self.num_workers
        upd = (
            np.empty(n, np.int32),
            np.empty(n, np.uint16),
            np.empty(n, np.int32),
            np.zeros(W, np.int64),
            np.zeros(W, np.int64),
        )
        par = (threads,) if threads > 1 else ()
        kernel = PK.update_after_step_par_jit if par else STK.update_after_step_jit
        kernel(keys, off, self.use_mask, self.valid, self.owner, full_sync, upd, *par)
        return upd

    # ------------------------------------------------------------------ warm state
    def arrays(self) -> dict[str, np.ndarray]:
        """Every array of the snapshots by attribute name, copies (the views of ``rec`` and
        ``aux`` left out): what :meth:`load_arrays` takes back (herald/scheduler/warm.py)."""
        return {k: v.copy() for k, v in vars(self).items() if isinstance(v, np.ndarray) and k not in self._VIEWS}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace every array by those of :meth:`arrays` of snapshots with the same workers,
        capacity and policy.

        Raises:
            DataError: other names, dtypes, or per-worker shapes (another layout).
        """
        mine = self.arrays()
        slots = arrays.get("slot_ids", np.empty(0))
        fits = set(arrays) == set(mine) and all(
            isinstance(arrays[k], np.ndarray) and arrays[k].dtype == v.dtype and arrays[k].ndim == v.ndim
            for k, v in mine.items()
        )
        fits = fits and all(
            arrays[k].shape == v.shape for k, v in mine.items() if k not in ("hk_slot", *self._PER_SLOT, "rec")
        )
        fits = fits and all(arrays[k].shape[0] == slots.shape[0] for k in (*self._PER_SLOT, "rec"))
        fits = fits and arrays["rec"].shape[1] == self.rec.shape[1] and int(arrays["n_slots"][0]) <= slots.shape[0]
        if not fits:
            raise DataError(
                "scheduler warm state: the cache snapshots do not fit these snapshots "
                f"({self.num_workers} workers, {self.capacity_rows} rows, {self.policy}); resume with the same settings"
            )
        for k, v in arrays.items():
            setattr(self, k, np.ascontiguousarray(v).copy())
        self._record_views()
        self._aux_views()

    def cached_slots(self, w: int) -> np.ndarray:
        """Slots cached by worker ``w`` (int32, unordered; for tests and debugging)."""
        n = self.num_keys
        return np.flatnonzero(self.pos[:n, w] >= 0).astype(np.int32)

    def nbytes(self) -> int:
        """Bytes held by all snapshot arrays."""
        return int(sum(v.nbytes for k, v in vars(self).items() if isinstance(v, np.ndarray) and k not in self._VIEWS))
