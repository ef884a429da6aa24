"""The PyTorch-facing API: an iterable of micro-batches and a cached embedding module.

A training script is the standard loop (see examples/train_dlrm.py)::

    loader = ScheduledLoader.connect("tcp://127.0.0.1:5555", rank=rank, world_size=n)
    embedding = loader.embedding()                 # nn.Module: batch -> [b, T, dim]
    model = DLRM(...)                              # dense parameters only
    loader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in loader:                           # plan's evictions + pulls already done
        logits = model(batch.dense, embedding(batch))
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()
        loader.step(loss)                          # sparse pushes/updates per plan, dense all-reduce, ack

``loss`` must be the *mean* over the micro-batch. Every rank gets equal-size
micro-batches, so the mean of the ranks' gradients is the gradient of the mean loss
over the global batch: the job equals single-process training on the same global
batches (Herald §3.3). The order of operations is NOTE [step protocol] in
``herald/scheduler/plan.py``; the messages are NOTE [dispatch protocol] in
``herald/dispatch/dispatcher.py``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from datetime import timedelta
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zmq
from torch import nn

from herald import wire
from herald.errors import ConfigError, HeraldError, PeerTimeout, ProtocolError
from herald.ps import PSClient, TableConfig, apply_gradients
from herald.scheduler.plan import KeySet
from herald.worker.cache import EmbeddingCache
from herald.worker import psio
from herald.dispatch.microbatch import MicroBatch
from herald.worker.replicas import ReplicaStore


@dataclasses.dataclass
class Batch:
    """One micro-batch as tensors on the training device.

    Attributes:
        labels: float32 [b]; dense: float32 [b, D]; sample_ids: uint64 numpy [b];
        step: global step; micro_batch: the decoded :class:`MicroBatch`.
    """

    labels: torch.Tensor
    dense: torch.Tensor
    sample_ids: np.ndarray
    step: int
    micro_batch: MicroBatch


class CachedEmbedding(nn.Module):
    """Sum-pooled embedding lookup from the worker cache: ``batch -> float32 [b, T, dim]``.

    Holds no parameters: the rows a micro-batch uses are gathered from the cache into
    one leaf tensor per step; :meth:`ScheduledLoader.step` reads its gradient.
    """

    def __init__(self, loader: "ScheduledLoader"):
        super().__init__()
        self._loader = loader

    def forward(self, batch: Batch) -> torch.Tensor:
        return self._loader._lookup(batch)


class ScheduledLoader:
    """Worker ``rank``'s micro-batches, with the plan-driven embedding cache underneath.

    Use :meth:`connect`. Iterating yields :class:`Batch` objects; call :meth:`step`
    once per batch after ``backward()``.
    """

    def __init__(self, sock: zmq.Socket, dispatcher: str, rank: int, world_size: int, job: dict[str, Any],
                 device: torch.device, timeout_ms: int):
        self.rank, self.world_size, self.job, self.device = rank, world_size, job, device
        self._sock, self._dispatcher, self._timeout_ms = sock, dispatcher, timeout_ms
        self.tables = [TableConfig.from_dict(t) for t in job["tables"]]
        dims = {(t.dim, t.row_width) for t in self.tables}
        if len(dims) != 1:
            raise ConfigError("the worker cache needs every table to share dim and optimizer state width, got "
                              f"{sorted(dims)}; give all tables the same dim and optimizer")
        self.dim, row_width = dims.pop()
        self.cache = EmbeddingCache(int(job["capacity_rows"]), row_width)
        self.ps = PSClient(job["ps"], tables=self.tables, timeout_ms=int(job.get("ps_timeout_ms", 30_000)))
        self._replicated = np.array(job.get("replicated_tables", []), np.int32)
        self.replicas = (ReplicaStore(int(job["replica_rows"]), row_width, self.dim, self.tables, self.ps, world_size)
                         if self._replicated.size else None)
        self.bytes_allreduced = 0
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._current: tuple[MicroBatch, torch.Tensor, tuple[np.ndarray, np.ndarray]] | None = None
        self._flat_grad: torch.Tensor | None = None  # dense grads, one buffer (see _dense_step)
        self._grad_views: list[torch.Tensor] = []
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self.steps = 0
        self._closed = False

    # ------------------------------------------------------------ creation
    @classmethod
    def connect(cls, dispatcher: str, *, rank: int, world_size: int, device: str | None = None,
                timeout_ms: int = 120_000, dist_init: str | None = None) -> "ScheduledLoader":
        """Say hello to the dispatcher, receive the job, join the dense all-reduce group.

        Args:
            dispatcher: the dispatcher's ZeroMQ endpoint (``tcp://host:port``).
            rank, world_size: this worker's rank among ``world_size`` workers.
            device: training device; default ``cuda`` when available, else ``cpu``.
            timeout_ms: longest wait for any dispatcher message.
            dist_init: torch.distributed init method; default the job's ``dist_init``,
                or ``env://`` under torchrun. Unused when ``world_size == 1``.

        Raises:
            PeerTimeout: the dispatcher did not send the job within ``timeout_ms``.
        """
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"worker-{rank}".encode())
        sock.connect(dispatcher)
        sock.send_multipart(wire.pack({"op": "hello", "rank": rank, "world_size": world_size}), copy=False)
        header, _ = _recv(sock, timeout_ms, dispatcher, "config")
        if header["op"] != "config":
            raise ProtocolError(f"expected config from the dispatcher, got {header['op']!r}")
        job = header["job"]
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        loader = cls(sock, dispatcher, rank, world_size, job, dev, timeout_ms)
        if world_size > 1 and not dist.is_initialized():
            method = dist_init or ("env://" if "MASTER_ADDR" in os.environ else job.get("dist_init"))
            if not method:
                raise ConfigError("no torch.distributed init method: pass dist_init, run under torchrun, "
                                  "or set dist_init in the job")
            backend = "nccl" if dev.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=method, rank=rank, world_size=world_size,
                                    timeout=timedelta(milliseconds=timeout_ms))
        return loader

    def embedding(self) -> CachedEmbedding:
        """The embedding module to call inside the model's forward."""
        return CachedEmbedding(self)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Register the dense model and its optimizer (all-reduced and stepped in :meth:`step`).

        A resumed job (``job["resume_dense"]``, a checkpoint folder) loads both states here.
        """
        self._model, self._optimizer = model, optimizer
        if self.job.get("resume_dense"):
            state = torch.load(pathlib.Path(self.job["resume_dense"]) / "dense.pt", weights_only=True,
                               map_location=self.device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

    # ----------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Batch]:
        try:
            while True:
                header, arrays = _recv(self._sock, self._timeout_ms, self._dispatcher, "micro-batch")
                op = header["op"]
                if op == "microbatch":
                    mb = MicroBatch.from_frames(header, arrays)
                    self._before_forward(mb)
                    yield Batch(torch.from_numpy(mb.labels.copy()).to(self.device),
                                torch.from_numpy(mb.dense.copy()).to(self.device), mb.sample_ids, mb.step, mb)
                elif op == "flush":
                    self._flush(KeySet(arrays[0], arrays[1]), reset=bool(header.get("reset")))
                elif op == "save":
                    self._save(str(header["path"]))
                elif op == "end":
                    return
                else:
                    raise ProtocolError(f"unexpected op {op!r} from the dispatcher")
        except Exception as exc:
            self._report_error(exc)
            raise

    def _before_forward(self, mb: MicroBatch) -> None:
        """Steps 1-2 of NOTE [step protocol]: evict (+ write back), then pull."""
        plan = mb.plan
        if len(plan.evict):
            rows = self.cache.evict(plan.evict, plan.write_back)
            wb = plan.write_back
            self.bytes_pushed += psio.push_rows(self.ps, KeySet(plan.evict.table[wb], plan.evict.ids[wb]), rows)
        if len(plan.pull):
            rows = psio.pull_keys(self.ps, plan.pull, self.cache.row_width)
            self.bytes_pulled += rows.nbytes + plan.pull.ids.nbytes
            self.cache.put(plan.pull, rows)
        if self.replicas is not None:
            self.bytes_pulled += self.replicas.ensure(mb.replicated)

    def _lookup(self, batch: Batch) -> torch.Tensor:
        mb = batch.micro_batch
        sizes = np.array([u.shape[0] for u in mb.unique_ids], np.int64)
        bounds = np.zeros(mb.num_tables + 1, np.int64)
        np.cumsum(sizes, out=bounds[1:])
        uniq = np.concatenate(mb.unique_ids) if mb.num_tables else np.zeros(0, np.uint64)
        keys = KeySet(np.repeat(np.arange(mb.num_tables, dtype=np.int32), sizes), uniq)
        if self.replicas is None:
            gathered = self.cache.rows[self.cache.slots(keys), : self.dim]
        else:  # NOTE [replicated tables]: those rows come from the replica, the rest from the cache
            rep = np.isin(keys.table, self._replicated)
            gathered = np.empty((len(keys), self.dim), np.float32)
            gathered[rep] = self.replicas.rows(KeySet(keys.table[rep], keys.ids[rep]))
            rest = ~rep
            gathered[rest] = self.cache.rows[self.cache.slots(KeySet(keys.table[rest], keys.ids[rest])), : self.dim]
        rows = torch.from_numpy(gathered).to(self.device).requires_grad_(True)
        nnz = np.array([i.shape[0] for i in mb.inverse], np.int64)
        nnz_base = np.zeros(mb.num_tables, np.int64)
        np.cumsum(nnz[:-1], out=nnz_base[1:])
        inputs = np.concatenate(mb.inverse).astype(np.int64) if mb.num_tables else np.zeros(0, np.int64)
        inputs += np.repeat(bounds[:-1], nnz)
        bags = np.concatenate([o[:-1] for o in mb.offsets]) if mb.num_tables else np.zeros(0, np.int64)
        bags += np.repeat(nnz_base, len(mb))
        pooled = F.embedding_bag(torch.from_numpy(inputs).to(self.device), rows,
                                 torch.from_numpy(bags).to(self.device), mode="sum")
        self._current = (mb, rows, (uniq, bounds))
        return pooled.view(mb.num_tables, len(mb), self.dim).transpose(0, 1)

    # ---------------------------------------------------------------- step
    def step(self, loss: torch.Tensor | float | None = None, logits: torch.Tensor | None = None) -> None:
        """Finish the step: steps 4-7 of NOTE [step protocol], then ack to the dispatcher.

        Args:
            loss: the micro-batch's mean loss (reported, not used for the update).
            logits: float [b] predictions made before this update; sent with the ack for
                progressive validation (AUC / log loss of unseen samples).

        Raises:
            HeraldError: called before the embedding was used in this step, or without
                :meth:`attach`.
        """
        if self._current is None or self._model is None or self._optimizer is None:
            raise HeraldError("step() needs attach(model, optimizer) and one embedding(batch) call per batch")
        mb, rows, layout = self._current
        self._current = None
        try:
            grads = np.zeros((rows.shape[0], self.dim), np.float32)
            if rows.grad is not None:
                grads = (rows.grad.detach().to("cpu").numpy() / np.float32(self.world_size)).astype(np.float32)
            plan = mb.plan
            self._push_grads(mb, plan, grads, layout)
            if len(plan.update_local):
                slots = self.cache.slots(plan.update_local)
                g = grads[psio.positions(*layout, plan.update_local)]
                for t, m in psio.table_groups(plan.update_local.table):
                    local = np.ascontiguousarray(self.cache.rows[slots[m]])
                    apply_gradients(local, np.ascontiguousarray(g[m]), self.tables[t])
                    self.cache.rows[slots[m]] = local
            if len(plan.plan_push):
                self.bytes_pushed += psio.push_rows(self.ps, plan.plan_push,
                                                    self.cache.rows[self.cache.slots(plan.plan_push)])
            if self.replicas is not None:
                uniq, bounds = layout
                tab = np.repeat(np.arange(mb.num_tables, dtype=np.int32), np.diff(bounds))
                rep = np.isin(tab, self._replicated)
                self.bytes_allreduced += self.replicas.update(mb.replicated, KeySet(tab[rep], uniq[rep]), grads[rep])
            self._dense_step()
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else (float("nan") if loss is None else float(loss))
            preds = []
            if logits is not None:
                preds = [mb.labels, torch.sigmoid(logits.detach()).to("cpu", torch.float32).numpy().reshape(-1)]
            self._sock.send_multipart(wire.pack({
                "op": "ack", "rank": self.rank, "step": mb.step, "loss": value,
                "bytes_pulled": self.bytes_pulled, "bytes_pushed": self.bytes_pushed,
                "bytes_allreduced": self.bytes_allreduced}, preds), copy=False)
            self.bytes_pulled = self.bytes_pushed = self.bytes_allreduced = 0
            self.steps += 1
        except Exception as exc:
            self._report_error(exc)
            raise

    def _push_grads(self, mb: MicroBatch, plan: Any, grads: np.ndarray, layout: tuple) -> None:
        """Step 4: one multi-table request per shard, sent in parallel; waits for the acks."""
        if not len(plan.grad_push):
            return
        g = grads[psio.positions(*layout, plan.grad_push)]
        parts = {}
        for t, m in psio.table_groups(plan.grad_push.table):
            parts[t] = (plan.grad_push.ids[m], np.ascontiguousarray(g[m]), plan.contributors[m])
        self.ps.push_grad_async(parts, step=mb.step, rank=self.rank).wait()
        self.bytes_pushed += plan.grad_push.ids.nbytes + g.nbytes

    def _dense_step(self) -> None:
        """Average the dense gradients over the ranks (one all-reduce), then step.

        The gradients live in one flat buffer: after the first step every ``p.grad`` is a
        view into it, so ``backward()`` accumulates in place (grads are zeroed, not freed)
        and the all-reduce needs no concatenation or copy-back (DDP's gradient-as-bucket-view).
        """
        params = [p for p in self._model.parameters() if p.requires_grad]
        if self.world_size > 1 and params:
            flat = self._flat_grad
            if flat is None or not all(p.grad is not None and p.grad.data_ptr() == v.data_ptr()
                                       for p, v in zip(params, self._grad_views)):
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in params])
                self._flat_grad, self._grad_views = flat, []
                offset = 0
                for p in params:
                    n = p.numel()
                    p.grad = flat[offset: offset + n].view_as(p)
                    self._grad_views.append(p.grad)
                    offset += n
            dist.all_reduce(flat)
            flat /= self.world_size
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=False)

    def _flush(self, keys: KeySet, reset: bool) -> None:
        """Write back the only-latest rows; with ``reset`` then empty the cache
        (NOTE [checkpoint barrier] in herald/dispatch/dispatcher.py)."""
        if len(keys):
            self.bytes_pushed += psio.push_rows(self.ps, keys, self.cache.rows[self.cache.slots(keys)])
        if self.replicas is not None:
            if self.rank == 0:
                self.replicas.write_back()
            if reset:
                self.replicas.clear()
        if reset:
            self.cache = EmbeddingCache(self.cache.capacity_rows, self.cache.row_width)
        self._sock.send_multipart(wire.pack({"op": "flushed", "rank": self.rank}), copy=False)

    def _save(self, path: str) -> None:
        """Write the dense model and optimizer state to ``path/dense.pt`` (atomically)."""
        if self._model is None or self._optimizer is None:
            raise HeraldError("save requested before attach(model, optimizer)")
        out = pathlib.Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "dense.pt.tmp"
        torch.save({"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict()}, tmp)
        tmp.replace(out / "dense.pt")
        self._sock.send_multipart(wire.pack({"op": "saved", "rank": self.rank}), copy=False)

    # ------------------------------------------------------------- closing
    def _report_error(self, exc: BaseException) -> None:
        try:
            self._sock.send_multipart(wire.pack({"op": "error", "rank": self.rank,
                                                 "message": f"{type(exc).__name__}: {exc}"}), copy=False)
        except Exception:
            pass

    def close(self) -> None:
        """Close the dispatcher socket and the PS client (idempotent, bounded)."""
        if self._closed:
            return
        self._closed = True
        self.ps.close()
        self._sock.close(linger=0)

    def __enter__(self) -> "ScheduledLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _recv(sock: zmq.Socket, timeout_ms: int, peer: str, what: str):
    if not sock.poll(timeout_ms):
        raise PeerTimeout(f"dispatcher {peer} sent no {what} within {timeout_ms} ms; check that the dispatcher "
                          "process is alive", peer=peer, op=what)
    header, arrays = wire.unpack(sock.recv_multipart(copy=False))
    if header["op"] == "error":
        raise HeraldError(f"dispatcher {peer} reported: {header.get('message')}")
    return header, arrays
