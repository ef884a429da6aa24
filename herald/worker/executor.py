"""The plan executor: one worker's embedding cache, PS I/O and replicated tables.

It carries out the operations of a :class:`~herald.contracts.plan.CachePlan` (evict
with write-back, pull, gradient push, local sparse update, plan push) and the
embedding lookup of a micro-batch; it decides nothing. The order of the calls is the
consistency protocol's (:mod:`herald.worker.protocol`, NOTE [step protocol] in
``herald/contracts/plan.py``). A protocol that sends more with the rows (HET's clocks:
herald/worker/clocks.py) passes its own :data:`~herald.worker.rows.Fetch` and
:data:`~herald.worker.rows.Write` functions; the executor only moves rows (the types it
moves: :mod:`herald.worker.rows`). Two parts have collaborators of their own: the pulls
started before their step (:class:`~herald.worker.early_pulls.EarlyPulls`) and the BSP
step message (:class:`~herald.worker.step_message.StepMessage`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from herald.contracts.job import JobSpec
from herald.contracts.microbatch import MicroBatch
from herald.contracts.plan import CachePlan, KeySet
from herald.phases import PhaseTimer
from herald.ps import PSClient
from herald.worker import psio
from herald.worker.device_cache import DeviceCache, make_cache
from herald.worker.devices import resolve_cache_device
from herald.worker.early_pulls import EarlyPulls
from herald.worker.replicas import ReplicaStore
from herald.worker.rows import Fetch, Pulled, StepGrads, StepRows, Write, pool_bags, step_keys
from herald.worker.step_message import StepMessage


class PlanExecutor:
    """Worker ``rank``'s embedding state and its traffic with the PS.

    Args:
        job: the :class:`JobSpec` the dispatcher sent.
        rank, world_size: this worker and the number of workers (gradients are divided
            by ``world_size``: docs/design.md, "Loss scaling").
        device: where :meth:`lookup` puts the rows (the model's device).
        cache_device: ``auto``, ``cpu`` or ``torch``: which cache (NOTE [worker devices] in
            herald/worker/devices.py; :func:`~herald.worker.devices.resolve_cache_device`).

    Attributes:
        cache: the worker cache (rows = embedding + optimizer state), behind NOTE [cache
            interface] (herald/worker/cache.py): the host :class:`~herald.worker.cache.
            EmbeddingCache` or the :class:`~herald.worker.device_cache.DeviceCache`.
        ps: the :class:`PSClient` of the job's shards.
        replicas: the :class:`ReplicaStore` of replicated tables, or None.
        early: the :class:`~herald.worker.early_pulls.EarlyPulls`: pulls started before
            their step (NOTE [early pulls], NOTE [own write-backs]).
        step_message: the :class:`~herald.worker.step_message.StepMessage` (NOTE [step
            messages] in herald/ps/stepped.py).
        bytes_pulled, bytes_pushed, bytes_allreduced: traffic not through :attr:`ps` since
            :meth:`take_traffic` (which adds the PS client's own count).
        timer: a :class:`~herald.phases.PhaseTimer`; each operation adds its time under
            its phase name (``evict``, ``pull``, ``lookup``, ``grad_push``, ...).

    Raises:
        ConfigError: the tables differ in dim or optimizer state width, or an unknown
            ``cache_device``.
    """

    def __init__(self, job: JobSpec, rank: int, world_size: int, device: torch.device, cache_device: str = "auto"):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tables = list(job.tables)
        # the widest table's: rows and gradients are padded to it (NOTE [mixed widths] in herald/ps/router.py)
        self.dim = job.max_dim
        #: the table of each feature, or None when feature t reads table t (NOTE [tables and features])
        shared = job.shared_feature_tables
        self.feature_tables = None if shared is None else np.array(shared, np.int64)
        self._one_optimizer = len({(t.optimizer, t.dim) for t in self.tables}) == 1
        row_width = job.max_row_width
        self.cache = make_cache(resolve_cache_device(cache_device, device), job.capacity_rows, row_width, device)
        self._divisor = torch.tensor(float(world_size), dtype=torch.float32, device=device)
        self.ps = PSClient(
            list(job.ps),
            tables=self.tables,
            timeout_ms=job.timeout_ms,
            keys_dir=job.keys_dir,
            wire_dtype=job.comm.wire_dtype,
        )  # NOTE [wire compression]
        self._replicated = np.array(job.replicated_tables, np.int32)
        self.replicas = (
            ReplicaStore(job.replica_rows, row_width, self.dim, self.tables, self.ps, world_size)
            if self._replicated.size
            else None
        )
        self.bytes_pulled = self.bytes_pushed = self.bytes_allreduced = 0
        self.timer = PhaseTimer()
        self._writes: list = []  # pushes and write-backs in flight
        self.early = EarlyPulls(self.cache, world_size, self._fetch)
        self.step_message = StepMessage(self.ps, self.cache, self.timer, rank, world_size, self.update_local)

    @property
    def cache_description(self) -> str:
        """One line for the log: which cache (NOTE [worker devices]) and where its rows live."""
        where = f"on {self.cache.device}" if isinstance(self.cache, DeviceCache) else "in host memory"
        return f"embedding cache {type(self.cache).__name__} {where} ({self.cache.capacity_rows:,} rows)"

    # ------------------------------------------------------ before forward
    def evict(self, plan: CachePlan, step: int | None = None, write: Write | None = None) -> None:
        """Drop ``plan.evict``; start writing back the rows flagged in ``plan.write_back``
        (finished by :meth:`wait_writes`: NOTE [early pulls] in herald/dispatch/early.py).
        With ``step`` (the plan's step) the written-back keys are remembered, so that
        ``early.prefetch`` may fetch them early for ``step + 1`` (NOTE [own write-backs]).
        ``write``: how the rows go (:data:`Write`; default a plain ``push_rows``)."""
        self.early.wrote_back(step, KeySet.empty())
        if not len(plan.evict):
            return
        with self.timer("evict"):
            rows = self.cache.evict(plan.evict, plan.write_back)
            wb = plan.write_back
            written = KeySet(plan.evict.table[wb], plan.evict.ids[wb])
            handle = (write or self._write)(written, rows)
            self.early.wrote_back(step, written)
            if handle is not None:
                self._writes.append(handle)

    def _write(self, keys: KeySet, rows: np.ndarray):
        """The plain :data:`Write`: the rows, nothing more."""
        return psio.push_rows_async(self.ps, keys, rows)

    def _fetch(self, keys: KeySet, at: np.ndarray) -> Callable[[], psio.Fetched]:
        """The plain :data:`Fetch`: every row of ``keys``."""
        return psio.fetch_async(self.ps, keys, self.cache.row_width)

    def track_write(self, handle) -> None:
        """Have :meth:`wait_writes` wait for ``handle`` (an object with ``wait()``) too."""
        self._writes.append(handle)

    def wait_writes(self) -> None:
        """Wait until the PS acknowledged every write this step started (write-backs of
        :meth:`evict`, :meth:`push_grads`, :meth:`push_plan`)."""
        if self._writes:
            with self.timer("push_wait"):
                for handle in self._writes:
                    handle.wait()
                self._writes.clear()

    def pull(self, mb: MicroBatch, fetch: Fetch | None = None) -> Pulled:
        """Fetch ``mb.plan.pull`` (rows with optimizer state) from the PS into the cache:
        the prefetched rows (:meth:`~herald.worker.early_pulls.EarlyPulls.prefetch`), then the others, read by ``fetch``
        (:data:`Fetch`; default: plain pulls). A pull the fetch did not bring (its copy is
        still valid: NOTE [bounded reads]) leaves the cached copy as it is."""
        pull = mb.plan.pull
        n = len(pull)
        early, early_wait = self.early.take(mb.step)
        if not n:
            return Pulled(pull, np.ones(0, bool), np.zeros(0, np.uint64))
        late = np.ones(n, bool) if early is None else ~early
        with self.timer("pull"):
            late_wait = (fetch or self._fetch)(KeySet(pull.table[late], pull.ids[late]), late) if late.any() else None
            parts = [(mask, wait()) for mask, wait in ((early, early_wait), (late, late_wait)) if wait is not None]
            if len(parts) == 1 and parts[0][0].all():  # one pull of every key (BSP without prefetch)
                got = parts[0][1]
                rows, fetched, clocks = got.rows, got.fetched, got.clocks
            else:
                rows = np.empty((n, self.cache.row_width), np.float32)
                fetched, clocks = np.ones(n, bool), np.zeros(n, np.uint64)
                for mask, got in parts:
                    rows[mask], fetched[mask], clocks[mask] = got.rows, got.fetched, got.clocks
            if fetched.all():
                self.cache.put(pull, rows)
                return Pulled(pull, fetched, clocks)
            keys = KeySet(pull.table[fetched], pull.ids[fetched])
            self.cache.put(keys, rows[fetched])
        return Pulled(keys, fetched, clocks)

    def pull_replicas(self, mb: MicroBatch) -> None:
        """Make the replicated rows of the global batch present (NOTE [replicated tables])."""
        if self.replicas is not None:
            with self.timer("replicas"):
                self.replicas.ensure(mb.replicated)

    # -------------------------------------------------------------- lookup
    def lookup(self, mb: MicroBatch) -> tuple[torch.Tensor, StepRows]:
        """Sum-pooled embeddings of ``mb``: float32 [b, T, dim] on the device, and the
        :class:`StepRows` whose gradient the after-backward operations read."""
        with self.timer("lookup"):
            return self._lookup(mb)

    def _lookup(self, mb: MicroBatch) -> tuple[torch.Tensor, StepRows]:
        # the micro-batch's flat arrays (NOTE [micro-batch layout]) serve as they are: no per-table lists
        t, b = mb.num_tables, len(mb)
        sk = step_keys(mb, self.feature_tables, len(self.tables))  # features sharing a table read its rows once
        keys, bounds = sk.keys, sk.bounds
        slots = None
        if self.replicas is None:
            slots = self.cache.slots(keys)
            gathered = self.cache.gather(slots, self.dim, self.device)
        else:  # NOTE [replicated tables]: those rows come from the replica, the rest from the cache
            rep = np.isin(keys.table, self._replicated)
            gathered = torch.empty((len(keys), self.dim), dtype=torch.float32, device=self.device)
            at_rep, at_rest = (torch.from_numpy(np.flatnonzero(m)).to(self.device) for m in (rep, ~rep))
            gathered[at_rep] = torch.from_numpy(self.replicas.rows(KeySet(keys.table[rep], keys.ids[rep]))).to(
                self.device
            )
            rest = ~rep
            gathered[at_rest] = self.cache.gather(
                self.cache.slots(KeySet(keys.table[rest], keys.ids[rest])), self.dim, self.device
            )
        rows = gathered.requires_grad_(True)
        pooled = pool_bags(rows, sk.value_rows, mb.offsets_flat, mb.inverse_bounds, self.device)
        step_rows = StepRows(rows, keys.ids, bounds, slots, self.cache.removals, sk.value_rows)
        return pooled.view(t, b, self.dim).transpose(0, 1), step_rows

    # ------------------------------------------------------ after backward
    def gradients(self, step_rows: StepRows) -> StepGrads:
        """Each row's gradient divided by the number of workers, on the training device
        (zeros when backward did not reach the rows). The division is by a device tensor:
        CUDA turns division by a Python number into multiplication by its reciprocal,
        which rounds differently from the reference's division."""
        grad = step_rows.rows.grad
        if grad is None:
            return StepGrads(torch.zeros((step_rows.rows.shape[0], self.dim), dtype=torch.float32, device=self.device))
        return StepGrads((grad.detach() / self._divisor).to(torch.float32))

    def push_grads(self, mb: MicroBatch, grads: StepGrads, step_rows: StepRows) -> None:
        """Send the gradients of ``plan.grad_push`` with their contributor counts: one
        multi-table request per shard, in parallel; acknowledged by :meth:`wait_writes`."""
        plan = mb.plan
        if not len(plan.grad_push):
            return
        with self.timer("grad_push"):
            g = grads.host_rows(step_rows.positions(plan.grad_push))
            self._writes.append(
                psio.push_grads_async(self.ps, plan.grad_push, g, plan.contributors, mb.step, self.rank)
            )

    def update_local(self, plan: CachePlan, grads: StepGrads, step_rows: StepRows) -> None:
        """Apply the sparse optimizer to the cached rows of ``plan.update_local``: the PS's
        numba kernels on the host cache, their torch twins on the device cache."""
        if not len(plan.update_local):
            return
        with self.timer("local_update"):
            at = step_rows.positions(plan.update_local)
            slots = step_rows.cache_slots(self.cache, at)  # a second lookup only if keys left the cache since
            if slots is None:
                slots = self.cache.slots(plan.update_local)
            g = grads.tensor if isinstance(self.cache, DeviceCache) else grads.host()
            if self._one_optimizer:  # one in-place update over every table
                self.cache.apply_gradients(slots, g, at, self.tables[0])
                return
            for t, m in psio.table_groups(plan.update_local.table):
                self.cache.apply_gradients(slots[m], g, at[m], self.tables[t])

    def push_plan(self, plan: CachePlan, write: Write | None = None):
        """Send the rows of ``plan.plan_push`` (with optimizer state) to the PS (Herald Alg. 2);
        acknowledged by :meth:`wait_writes`. With ``write`` (:data:`Write`) the rows go by it
        and its handle is returned (None for no rows); else a plain ``push_rows``, and None."""
        if not len(plan.plan_push):
            return None
        with self.timer("plan_push"):
            handle = (write or self._write)(plan.plan_push, self.cache.read(self.cache.slots(plan.plan_push)))
            self._writes.append(handle)
        return handle if write is not None else None

    def update_replicas(self, mb: MicroBatch, grads: StepGrads, step_rows: StepRows) -> None:
        """All-reduce and apply the replicated tables' gradients (NOTE [replicated tables])."""
        if self.replicas is None:
            return
        with self.timer("replicas"):
            tab = step_rows.tables()
            rep = np.isin(tab, self._replicated)
            self.bytes_allreduced += self.replicas.update(
                mb.replicated, KeySet(tab[rep], step_rows.uniq[rep]), grads.host()[rep]
            )

    # ------------------------------------------------------------- barrier
    def flush(self, keys: KeySet, reset: bool, write: Write | None = None) -> Any:
        """Write back the only-latest rows ``keys`` and wait; with ``reset`` then empty the
        cache (NOTE [checkpoint barrier] in herald/dispatch/dispatcher.py). With ``write``
        (:data:`Write`) the rows go by it and what its handle's ``wait()`` gives is returned;
        else a plain ``push_rows``, and None."""
        self.early.wrote_back(None, KeySet.empty())
        self.step_message.forget_prepared()
        clocks = None
        if len(keys) and write is None:
            psio.push_rows(self.ps, keys, self.cache.read(self.cache.slots(keys)))
        elif len(keys):
            clocks = write(keys, self.cache.read(self.cache.slots(keys))).wait()
        if self.replicas is not None:
            if self.rank == 0:
                self.replicas.write_back()
            if reset:
                self.replicas.clear()
        if reset:
            self.cache.clear()
        return clocks

    def take_traffic(self) -> dict[str, int]:
        """The worker's traffic since the last call (then reset to 0): ``bytes_pulled`` and
        ``bytes_pushed``, the bytes of every frame received from and sent to the PS (as they
        went: compressed, with headers and clock frames; :meth:`PSClient.take_traffic`) plus
        what a protocol exchanged with the dispatcher, ``bytes_allreduced`` (replicated
        tables' gradients), ``bytes_dense`` (the dense gradients among ``bytes_pushed``, the
        same again among ``bytes_pulled``: NOTE [dense gradients on the shards] in
        herald/ps/stepped.py), and ``ps_requests``, the PS requests issued (all shards)."""
        ps = self.ps.take_traffic()
        out = {
            "bytes_pulled": self.bytes_pulled + ps["bytes_received"],
            "bytes_pushed": self.bytes_pushed + ps["bytes_sent"],
            "bytes_allreduced": self.bytes_allreduced,
            "bytes_dense": self.step_message.bytes_dense,
            "ps_requests": ps["requests"],
        }
        self.bytes_pulled = self.bytes_pushed = self.bytes_allreduced = self.step_message.bytes_dense = 0
        return out

    def close(self, timeout_s: float = 1.0) -> None:
        """Close the PS client: its sockets close at once (unanswered requests are dropped),
        well within ``timeout_s``. Idempotent."""
        self.ps.close()
