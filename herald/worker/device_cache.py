"""The device-resident embedding cache: the slot array as a torch tensor on the training device.

NOTE [device cache]. Same slots and same plan operations as the host cache (NOTE
[cache interface] in herald/worker/cache.py: :class:`~herald.worker.cache.SlotMap`
decides the slots), with the rows in ``rows float32 [capacity_rows, row_width]`` on
the device:

- lookup gathers the step's rows on the device (``index_select``), and the sparse
  optimizer runs there as torch operations (:mod:`herald.worker.kernels_torch`, equal
  to the PS's numba kernels: bit-identical on the CPU in the tests, within 1e-6 by
  contract); no row crosses to the host for either;
- pulled rows are staged in pinned host memory and copied to the device with
  ``non_blocking=True`` on a side stream, then scattered into their slots there;
  evicted rows (write-backs), plan pushes and flushes are gathered on the side stream
  and copied back into pinned memory the same way.

Ordering on CUDA (two streams, two events): every operation of the compute stream on
``rows`` (lookup, sparse update) records ``_compute_done``; every side-stream operation
waits for it before touching ``rows`` and records ``_copies_done``, which the compute
stream waits for before its next operation on ``rows``. The host-to-device copy of
pulled rows waits for nothing, so it overlaps with whatever step ``t`` left queued on
the compute stream (its local sparse update, the dense optimizer step); only the
scatter into the slots waits. A read for the host (write-back, plan push) blocks the
caller until its copy has landed (the PS needs the bytes). Pinned buffers come from
torch's caching host allocator, which keeps a buffer alive until its copy is done.

On the CPU (``--cache-device torch`` without CUDA, how CI tests it) the same code
runs with plain copies: no pinning, no streams, no events.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from herald.contracts.plan import KeySet
from herald.contracts.tables import TableConfig
from herald.errors import ConfigError
from herald.worker.cache import EmbeddingCache, SlotMap
from herald.worker.kernels_torch import apply_rows_torch


class DeviceCache(SlotMap):
    """Fixed-capacity cache of embedding rows on ``device`` (NOTE [device cache]).

    Args:
        capacity_rows: slots (rows), > 0; the scheduler's per-worker capacity.
        row_width: floats per row (embedding dim + optimizer state dim), > 0.
        device: where the rows live (a GPU, or the CPU for tests).

    Attributes:
        rows: float32 [capacity_rows, row_width] tensor on ``device``.

    Raises:
        ConfigError: non-positive capacity or width.
        torch.OutOfMemoryError: the slot array does not fit on the device (use
            ``--cache-device cpu``, the host cache, for caches larger than GPU memory).
    """

    def __init__(self, capacity_rows: int, row_width: int, device: torch.device | str):
        super().__init__(capacity_rows, row_width)
        self.device = torch.device(device)
        self.rows = torch.zeros((self.capacity_rows, self.row_width), dtype=torch.float32, device=self.device)
        self._cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        self._compute_done: torch.cuda.Event | None = None
        self._copies_done: torch.cuda.Event | None = None

    # ------------------------------------------------------------ streams
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device: staged in pinned memory and copied non-blocking on CUDA
        (call inside :meth:`_on_side`), a plain tensor on the CPU."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if not self._cuda:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, tensor: torch.Tensor) -> np.ndarray:
        """A numpy copy of ``tensor``; on CUDA through pinned memory, waiting only for this copy."""
        if not self._cuda:
            return tensor.to("cpu").numpy()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()
        return host.numpy()

    @contextlib.contextmanager
    def _on_side(self) -> Iterator[None]:
        """Run the body on the side stream (CUDA); see NOTE [device cache] for the events."""
        if not self._cuda:
            yield
            return
        with torch.cuda.stream(self._side):
            yield
            self._copies_done = torch.cuda.Event()
            self._copies_done.record(self._side)

    def _side_waits_compute(self) -> None:
        if self._cuda and self._compute_done is not None:
            self._side.wait_event(self._compute_done)

    @contextlib.contextmanager
    def _on_compute(self) -> Iterator[None]:
        """Run the body on the current (compute) stream after the side stream's copies."""
        if not self._cuda:
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        if self._copies_done is not None:
            stream.wait_event(self._copies_done)
        yield
        self._compute_done = torch.cuda.Event()
        self._compute_done.record(stream)

    def synchronize(self) -> None:
        """Wait until every copy and update queued on the device is done (tests, shutdown)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ plan operations
    def evict(self, keys: KeySet, write_back: np.ndarray) -> np.ndarray:
        """Drop ``keys``; returns a host copy (float32 [k, row_width]) of the rows flagged in
        ``write_back`` (bool [n]), copied back on the side stream.

        Raises:
            ProtocolError: a key to evict is not cached.
        """
        slots = self.slots(keys)
        out = self.read(slots[write_back]) if write_back.any() else np.zeros((0, self.row_width), np.float32)
        self._remove(keys)
        return out

    def put(self, keys: KeySet, rows: np.ndarray) -> None:
        """Store ``rows`` (float32 [n, row_width], host) for ``keys``: overwrite cached ones
        in place, insert the rest into free slots; staged and copied on the side stream.

        Raises:
            ProtocolError: more new keys than free slots (the plan broke capacity).
        """
        self._check_rows(keys, rows)
        slots = self._assign(keys)
        if not len(keys):
            return
        with self._on_side():
            staged = self._to_device(rows.astype(np.float32, copy=False))
            at = self._to_device(slots)
            self._side_waits_compute()  # the copies above overlap; the scatter waits
            self.rows.index_copy_(0, at, staged)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """float32 [n, row_width]: a host copy of the rows in ``slots`` (int64 [n])."""
        if slots.shape[0] == 0:
            return np.zeros((0, self.row_width), np.float32)
        with self._on_side():
            at = self._to_device(slots)
            self._side_waits_compute()
            return self._to_host(self.rows.index_select(0, at))

    def gather(self, slots: np.ndarray, dim: int, device: torch.device) -> torch.Tensor:
        """float32 [n, dim] on ``device``: the embeddings in ``slots`` (a new tensor)."""
        at = torch.from_numpy(np.ascontiguousarray(slots)).to(self.device, non_blocking=self._cuda)
        with self._on_compute():
            out = self.rows.index_select(0, at)[:, :dim].contiguous()
        return out.to(device)

    def apply_gradients(
        self, slots: np.ndarray, grads: torch.Tensor | np.ndarray, grad_rows: np.ndarray, table: TableConfig
    ) -> None:
        """The sparse optimizer of ``table`` on the rows in ``slots`` (int64 [n], distinct)
        with ``grads[grad_rows]`` (float32 [m, dim] tensor on the device, or numpy; int64
        [n]), in place, as torch operations on the device (:func:`apply_rows_torch`)."""
        if table.row_width > self.row_width:
            raise ConfigError(
                f"apply_gradients: table {table.name!r}'s rows ({table.row_width} floats) are wider than the "
                f"cache's ({self.row_width})"
            )
        if slots.shape[0] == 0:
            return
        if isinstance(grads, np.ndarray):
            grads = torch.from_numpy(grads)
        at = torch.from_numpy(np.ascontiguousarray(slots)).to(self.device, non_blocking=self._cuda)
        g_at = torch.from_numpy(np.ascontiguousarray(grad_rows, dtype=np.int64)).to(
            grads.device, non_blocking=self._cuda
        )
        width, dim = table.row_width, table.dim  # the cache's rows may be wider (NOTE [mixed widths])
        with self._on_compute():
            g = grads.detach().index_select(0, g_at).to(self.device, torch.float32)[:, :dim].contiguous()
            rows = self.rows.index_select(0, at)
            if width == self.row_width:
                self.rows.index_copy_(0, at, apply_rows_torch(rows, g, table))
            else:
                rows[:, :width] = apply_rows_torch(rows[:, :width].contiguous(), g, table)
                self.rows.index_copy_(0, at, rows)

    def clear(self) -> None:
        """Forget every key (the rows' contents are left; every slot is free)."""
        self._reset_map()


def make_cache(kind: str, capacity_rows: int, row_width: int, device: torch.device) -> EmbeddingCache | DeviceCache:
    """The worker cache of ``kind`` (:func:`herald.worker.devices.resolve_cache_device`):
    ``"host"`` -> :class:`EmbeddingCache`, ``"torch"`` -> :class:`DeviceCache` on ``device``.

    Raises:
        ValueError: another kind.
    """
    if kind == "host":
        return EmbeddingCache(capacity_rows, row_width)
    if kind == "torch":
        return DeviceCache(capacity_rows, row_width, device)
    raise ValueError(f"cache kind {kind!r} is not 'host' or 'torch'")
