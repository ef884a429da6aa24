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
``herald/contracts/plan.py``; the messages are NOTE [dispatch protocol] in
``herald/dispatch/dispatcher.py``.

The loader is a thin iterator over the dispatcher's messages, which its
:class:`~herald.worker.link.DispatcherLink` receives and sends. What happens to the
embeddings is the consistency protocol's (:mod:`herald.worker.protocol`), carried out by
the plan executor (:mod:`herald.worker.executor`: cache, PS I/O, replicated tables); the
dense model is synchronised by the protocol's dense side
(:meth:`~herald.worker.protocol.ConsistencyProtocol.make_dense`: :class:`~herald.worker.dense.DenseSync`
unless the mode brings its own).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from herald.contracts.job import JobSpec
from herald.contracts.microbatch import MicroBatch
from herald.contracts.plan import KeySet
from herald.contracts.vocab import DEFAULT_TIMEOUT_MS
from herald.errors import ConfigError, DataError, HeraldError, ProtocolError
from herald.loader.torchrec_interop import keyed_pooled, keyed_tensor_class, kjt_from_arrays
from herald.phases import PhaseTimer
from herald.worker.dense import DenseState
from herald.worker.dense_group import DenseGroup
from herald.worker.divergence import check_finite
from herald.worker.executor import PlanExecutor
from herald.worker.link import DispatcherLink
from herald.worker.modes import job_protocol
from herald.worker.pooling import FeaturePooling
from herald.worker.rows import StepRows
from herald.worker.script import job_environment
from herald.worker.warm import save_checkpoint_part

#: The loaders connected and not yet closed in this process (NOTE [own script] in
#: herald/worker/script.py closes those a script leaves open).
OPEN_LOADERS: weakref.WeakSet = weakref.WeakSet()


@dataclasses.dataclass
class Batch:
    """One micro-batch as tensors on the training device.

    Attributes:
        labels: float32 [b]; dense: float32 [b, D]; sample_ids: uint64 numpy [b];
        step: global step; micro_batch: the decoded :class:`MicroBatch`.
        rows: the embedding rows this batch used, set by :class:`CachedEmbedding`
            (None until the embedding is called); :meth:`ScheduledLoader.step` reads
            their gradient.
        table_names: the job's table names, in order (the keys of :meth:`to_kjt`).
    """

    labels: torch.Tensor
    dense: torch.Tensor
    sample_ids: np.ndarray
    step: int
    micro_batch: MicroBatch
    rows: StepRows | None = None
    table_names: tuple[str, ...] = ()

    def to_kjt(self):
        """The micro-batch's ids as a ``torchrec.KeyedJaggedTensor`` on the CPU: keys =
        :attr:`table_names`, values int64 [sum nnz] (uint64 bits, decompressed from the
        unique ids + inverse index), lengths int32 [T x b]; lossless (NOTE [kjt layout] in
        herald/loader/torchrec_interop.py; its ``from_kjt`` is the way back). The ids are
        decompressed from the unique ids + inverse index (Persia §4.2.3) to one value per
        (sample, id).

        Raises:
            DataError: :attr:`table_names` does not hold one name per table.
            ImportError: torchrec is not installed (the message gives the install).
        """
        mb = self.micro_batch
        if len(self.table_names) != mb.num_tables:
            raise DataError(
                f"to_kjt: {len(self.table_names)} table names for a micro-batch of {mb.num_tables} "
                "tables; pass the job's table names (ScheduledLoader.table_names)"
            )
        nnz = np.diff(mb.inverse_bounds)
        index = mb.inverse_flat.astype(np.int64) + np.repeat(mb.id_bounds[:-1], nnz)
        lengths = np.diff(mb.offsets_flat, axis=1).ravel()
        return kjt_from_arrays(self.table_names, mb.ids_flat[index], lengths, len(mb))


class CachedEmbedding(nn.Module):
    """Embedding lookup from the worker cache, each feature pooled as the job declares it
    (sum, mean or a sequence: NOTE [tables and features] in herald/contracts/features.py).

    Holds no parameters: the rows a micro-batch uses are gathered from the cache into
    one leaf tensor per step, recorded in ``batch.rows``.

    Args:
        executor: the worker's :class:`PlanExecutor` (``ScheduledLoader.embedding()``).
        output: ``tensor`` (default: float32 [b, T, dim], every feature pooled; tables of several
            widths: the features concatenated, float32 [b, sum dim_f]), ``keyed_tensor``:
            a ``torchrec.KeyedTensor`` (keys = ``table_names``, ``length_per_key`` dim,
            values float32 [b, T x dim]), what a TorchRec ``EmbeddingBagCollection``
            returns (docs/torchrec.md), or ``features``: a
            :class:`~herald.worker.pooling.FeatureEmbeddings` (pooled features float32 [b, dim],
            sequence features padded [b, L, dim] with their lengths; ``to_keyed_tensor()``,
            ``to_jagged(name)`` for TorchRec); gradients reach the rows every way.
        table_names: the keys of ``keyed_tensor`` (the job's features, in order).
        pooling: the features' :class:`~herald.worker.pooling.FeaturePooling` (default: every
            feature sum-pooled).

    Raises:
        ConfigError: an unknown ``output``, or ``tensor`` / ``keyed_tensor`` for a job with
            sequence features. ImportError: ``keyed_tensor`` without torchrec.
    """

    OUTPUTS = ("tensor", "keyed_tensor", "features")
    #: the job's :class:`~herald.worker.protocol.ConsistencyProtocol` when it pools the rows itself
    #: (hybrid: NOTE [hybrid training]); set by :meth:`ScheduledLoader.embedding`
    protocol = None

    def __init__(
        self,
        executor: PlanExecutor,
        output: str = "tensor",
        table_names: tuple[str, ...] = (),
        pooling: FeaturePooling | None = None,
    ):
        super().__init__()
        if output not in self.OUTPUTS:
            raise ConfigError(f"embedding output must be one of {list(self.OUTPUTS)}, got {output!r}")
        self.executor, self.output, self.table_names = executor, output, tuple(table_names)
        self.pooling = pooling
        if output == "features" and pooling is None:
            raise ConfigError(
                "output='features' needs the features' pooling: use ScheduledLoader.embedding(output='features')"
            )
        if pooling is not None and output != "features":
            pooling.check_tensor_output()
        if output == "keyed_tensor":  # a missing torchrec is named here, not at the first batch
            keyed_tensor_class()
            if not self.table_names:
                raise ConfigError(
                    "output='keyed_tensor' needs the table names (the keys): pass table_names, "
                    "or use ScheduledLoader.embedding(output='keyed_tensor')"
                )

    def forward(self, batch: Batch) -> Any:
        mb = batch.micro_batch
        pooled, batch.rows = (self.protocol or self.executor).lookup(mb)
        if self.pooling is None:
            return pooled if self.output == "tensor" else keyed_pooled(pooled, self.table_names)
        if self.output == "features":
            out = self.pooling.features_of(pooled, batch.rows.rows, mb, batch.rows.value_rows)
            if self.protocol is not None and self.pooling.truncated:  # counted in the report (its embeddings block)
                self.protocol.stats["sequence_truncated"] += self.pooling.truncated
                self.pooling.truncated = 0
            return out
        if self.output == "keyed_tensor" and self.pooling.dims is not None:  # per-feature widths
            return self.pooling.features_of(pooled, batch.rows.rows, mb, batch.rows.value_rows).to_keyed_tensor()
        pooled = self.pooling.pooled(pooled, mb.offsets_flat)
        if self.output == "tensor":
            return pooled
        return keyed_pooled(pooled, self.table_names)


class ScheduledLoader:
    """Worker ``rank``'s micro-batches, with the plan-driven embedding cache underneath.

    Use :meth:`connect`. Iterating yields :class:`Batch` objects; call :meth:`step`
    once per batch after ``backward()``: it finishes the batch yielded last.

    Attributes:
        job: the :class:`JobSpec`; executor: the :class:`PlanExecutor`; protocol: the
        job's :class:`~herald.worker.protocol.ConsistencyProtocol`; steps: steps finished;
        link: the :class:`~herald.worker.link.DispatcherLink` (the socket to the dispatcher);
        group: the :class:`~herald.worker.dense_group.DenseGroup` (the dense process group);
        dist_rank, dist_world_size: its rank and world (they differ from the dispatcher's
        with one dispatcher per group: NOTE [independent groups] in herald/job/group_dispatch.py).
    """

    def __init__(self, link: DispatcherLink, world_size: int, job: JobSpec, group: DenseGroup, cache_device: str):
        rank, device = link.rank, group.choice.device
        self.rank, self.world_size, self.job, self.device = rank, world_size, job, device
        self.group, self.dist_rank, self.dist_world_size = group, group.rank, group.world_size
        self.link = link
        self.executor = PlanExecutor(job, rank, world_size, device, cache_device)
        self.protocol = job_protocol(job, self.executor)  # its mode's entry in herald.worker.modes
        # each feature's pooling and width, shared by embedding() modules
        self.pooling = FeaturePooling(job.feature_list, job.feature_dims)
        if rank == 0:
            print(
                f"herald worker: training on {device}, {self.executor.cache_description}", file=sys.stderr, flush=True
            )
        self.dense: DenseState | None = None
        self._batch: Batch | None = None
        self.steps = 0
        self._yielded: tuple[float, float] | None = None  # (when, phase seconds then): see step()
        self._ahead: tuple | None = None  # (header, arrays, MicroBatch or None) received early
        self._closed = False

    @property
    def timer(self) -> PhaseTimer:
        """The step's :class:`~herald.phases.PhaseTimer`: a training loop may time its own
        phases (``with loader.timer("forward"): ...``); they travel with the ack. Time between
        the yield of a batch and :meth:`step` that no phase claims is ``compute``."""
        return self.executor.timer

    @property
    def dim(self) -> int:
        """Embedding dim of every table.

        Raises:
            ConfigError: the tables differ in width (read :attr:`feature_dims`).
        """
        if len({t.dim for t in self.job.tables}) > 1:
            raise ConfigError(
                f"the job's tables differ in width ({sorted({t.dim for t in self.job.tables})}): read "
                "loader.feature_dims, each feature's"
            )
        return self.executor.dim

    @property
    def feature_dims(self) -> tuple[int, ...]:
        """Each feature's embedding width, in :attr:`feature_names` order."""
        return self.job.feature_dims

    # ------------------------------------------------------------ creation
    @classmethod
    def connect(
        cls,
        dispatcher: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | None = None,
        cache_device: str | None = None,
        timeout_ms: int | None = None,
        dist_init: str | None = None,
        keys_dir: str | None = None,
    ) -> ScheduledLoader:
        """Say hello to the dispatcher, receive the job, join the dense all-reduce group.

        Under ``herald train --script`` any argument may be left out: it is read from the
        environment the job gives its workers (:func:`job_environment`, NOTE [own script]).

        Args:
            dispatcher: the dispatcher's endpoint (``tcp://host:port``; ``$HERALD_DISPATCHER``).
            rank, world_size: this worker's rank among ``world_size`` workers (default
                ``$RANK`` / ``$WORLD_SIZE``, as torchrun sets them).
            device: ``auto`` (default, or ``$HERALD_DEVICE``: ``cuda:LOCAL_RANK % GPUs`` with
                CUDA, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``; NCCL only when every rank
                of this host has a GPU of its own, else gloo (NOTE [worker devices] in
                herald/worker/devices.py); ``torch.cuda.set_device`` before the group.
            cache_device: ``auto`` (default, or ``$HERALD_CACHE_DEVICE``: on the GPU when the
                device is one), ``cpu`` or ``torch`` (NOTE [device cache]).
            timeout_ms: longest wait for any dispatcher message (``$HERALD_TIMEOUT_MS``, 120 s).
            dist_init: the dense group's init method (the job's; ``env://`` under torchrun); unused for 1 worker.
            keys_dir: CURVE keys folder (``$HERALD_KEYS``; NOTE [transport security] in herald/auth.py)
                for a dispatcher and PS shards run with ``--keys``, read here, never received; it replaces
                the job's ``keys_dir``. None: plain ZeroMQ to the dispatcher, the job's ``keys_dir`` for the PS.

        Raises:
            PeerTimeout: the dispatcher did not send the job within ``timeout_ms`` (also
                what a dispatcher that does not accept this worker's keys looks like).
            ConfigError: the job spec is of another version or malformed; a device that
                cannot be had (``cuda`` without a GPU, ``cuda:N`` beyond the GPUs).
            UsageError: an argument neither given nor in the environment (or malformed there).
            On any failure the dispatcher is sent an ``error`` message (if it is there).
        """
        env = job_environment(dispatcher, rank, world_size, device, cache_device, timeout_ms, keys_dir)
        dispatcher, rank, world_size, device, cache_device, timeout_ms, keys_dir = env
        link = DispatcherLink.connect(dispatcher, rank, timeout_ms, keys_dir)  # bad keys: raise before any socket
        loader = None
        try:
            job = JobSpec.from_dict(link.handshake(world_size))
            if keys_dir is not None:  # this host's copy of the keys folder
                job = job.replace(keys_dir=str(keys_dir))
            group = DenseGroup(job, rank, world_size, device)  # NOTE [worker devices]; set_device before the group
            loader = cls(link, world_size, job, group, cache_device)
            group.join(dist_init, timeout_ms)  # a group it creates is destroyed by close()
        except BaseException as exc:  # tell the dispatcher (else it waits out its timeout); free the socket
            link.report_error_nowait(f"{type(exc).__name__}: {exc}")  # no dispatcher connected: nobody to tell
            if loader is not None:
                loader.executor.close()
            link.close(timeout_s=1.0)  # bounded: lets the error report leave
            raise
        OPEN_LOADERS.add(loader)
        return loader

    def embedding(self, output: str = "tensor") -> CachedEmbedding:
        """The embedding module to call inside the model's forward; ``output="keyed_tensor"``
        makes it return a ``torchrec.KeyedTensor`` for a TorchRec model (:class:`CachedEmbedding`)."""
        module = CachedEmbedding(self.executor, output, self.feature_names, self.pooling)
        module.protocol = self.protocol
        return module

    @property
    def table_names(self) -> tuple[str, ...]:
        """The job's table names, in order."""
        return tuple(t.name for t in self.job.tables)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The job's feature names, in micro-batch order (the table names when each feature
        reads a table of its own: NOTE [tables and features] in herald/contracts/features.py)."""
        return self.pooling.names

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Register the dense model and its optimizer (all-reduced and stepped in :meth:`step`).

        A resumed job (``job.resume_dense``, a checkpoint folder) loads both states here.
        """
        job = self.job  # groups > 1: a collective setup (NOTE [training groups])
        # DenseSync, or the mode's own dense side (gba: the PS aggregates the dense gradients, NOTE [gba tokens])
        self.dense = self.protocol.make_dense(
            model,
            optimizer,
            world_size=self.dist_world_size,
            rank=self.dist_rank,
            dense_comm=job.comm.dense_comm,
            groups=job.groups.count,
            average_every=job.groups.average_every,
            easgd_alpha=job.groups.easgd_alpha,
        )
        if self.job.resume_dense:
            self.dense.load(self.job.resume_dense, self.device)

    # ----------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Batch]:
        try:
            while True:
                with self.timer("wait"):
                    header, arrays, mb = self._ahead or (*self.link.receive("micro-batch"), None)
                    self._ahead = None
                op = header["op"]
                if op == "microbatch":
                    mb = mb or MicroBatch.from_frames(header, arrays)
                    self.protocol.before_forward(mb)
                    self._look_ahead()
                    self._batch = Batch(
                        torch.from_numpy(mb.labels.copy()).to(self.device),
                        torch.from_numpy(mb.dense.copy()).to(self.device),
                        mb.sample_ids,
                        mb.step,
                        mb,
                        table_names=self.feature_names,
                    )
                    self._yielded = (time.perf_counter(), sum(self.timer.seconds.values()))
                    yield self._batch
                elif op == "flush":
                    self.protocol.flush(KeySet(arrays[0], arrays[1]), reset=bool(header.get("reset")))
                    self.link.send_flushed()
                elif op == "save":
                    self._save(str(header["path"]), caches=bool(header.get("caches")))
                elif op == "end":
                    return
                else:
                    raise ProtocolError(f"unexpected op {op!r} from the dispatcher")
        except Exception as exc:
            self.link.report_error(exc)
            raise

    def _look_ahead(self, wait: bool = False) -> None:
        """Receive the next message if it is already here (with ``wait``: wait for it, as the
        link's receive does); if it is a micro-batch, let the protocol start its early reads
        while this step computes (NOTE [early pulls] in herald/dispatch/early.py: this worker
        has finished the step before this one), or take its pulls along (NOTE [step messages])."""
        if not wait and not self.link.ready():
            return
        with self.timer("wait" if wait else "prefetch"):
            header, arrays = self.link.receive("micro-batch", timeout_ms=None if wait else 0)
            mb = MicroBatch.from_frames(header, arrays) if header["op"] == "microbatch" else None
            if mb is not None:
                self.protocol.prefetch(mb)
            self._ahead = (header, arrays, mb)

    # ---------------------------------------------------------------- step
    def step(self, loss: torch.Tensor | float | None = None, logits: torch.Tensor | None = None) -> None:
        """Finish the batch yielded last: the protocol's after-backward part (steps 4-6 of
        NOTE [step protocol]), the dense all-reduce and step (7), then the ack.

        Args:
            loss: the micro-batch's mean loss (reported, not used for the update).
            logits: float [b] predictions made before this update; sent with the ack for
                progressive validation (AUC / log loss of unseen samples).

        Raises:
            HeraldError: no batch was yielded, its embedding was not called, or
                :meth:`attach` was not called.
            TrainingDiverged: the loss or a gradient is NaN or infinite (nothing of the step is
                applied; the message names the step, the rank and the likely cause:
                :func:`herald.worker.divergence.check_finite`).
        """
        batch = self._batch
        if batch is None or batch.rows is None or self.dense is None:
            raise HeraldError("step() needs attach(model, optimizer) and one embedding(batch) call per batch")
        self._batch = None
        try:
            mb = batch.micro_batch
            check_finite(
                self.job, self.rank, mb.step, loss, [batch.rows.rows.grad] + [p.grad for p in self.dense.params]
            )
            if self.dist_rank == self.job.straggler.rank:  # --slow-worker: a straggler, counted as compute
                time.sleep(self.job.straggler.ms / 1000.0)
            if self._yielded is not None:  # forward + backward not timed by the training loop
                since, claimed = self._yielded
                self.timer.add(
                    "compute", max(0.0, time.perf_counter() - since - (sum(self.timer.seconds.values()) - claimed))
                )
            if self._ahead is None:  # the next micro-batch came while this step computed: start its early pulls
                self._look_ahead(wait=mb.next_follows and self.protocol.step_messages)
            if self.protocol.step_messages:  # the dense sum rides in the step messages, or is all-reduced meanwhile
                with self.timer("dense_allreduce"):
                    self.executor.step_message.dense = self.dense.start()
            self.protocol.after_backward(mb, batch.rows)
            with self.timer("dense_allreduce"):
                self.dense.step(summed=self.executor.step_message.take_dense_summed())
            self._send_ack(mb, loss, logits)
            self.steps += 1
        except Exception as exc:
            self.link.report_error(exc)
            raise

    def _send_ack(self, mb: MicroBatch, loss: torch.Tensor | float | None, logits: torch.Tensor | None) -> None:
        """Ack step ``mb.step`` to the dispatcher: the loss (NaN when None), the phase times,
        the protocol's counters, the traffic, the predictions (``mb.labels`` and the sigmoid of
        ``logits``, when given) and the protocol's ack arrays."""
        value = (
            float(loss.detach()) if isinstance(loss, torch.Tensor) else (float("nan") if loss is None else float(loss))
        )
        preds = []
        if logits is not None:
            preds = [mb.labels, torch.sigmoid(logits.detach()).to("cpu", torch.float32).numpy().reshape(-1)]
        with self.timer("ack"):
            self.link.send_ack(
                mb.step,
                value,
                self.timer.take(),
                self.protocol.take_stats(),
                self.executor.take_traffic(),
                preds + self.protocol.ack_arrays(),
            )

    def _save(self, path: str, caches: bool = False) -> None:
        """Rank 0's dense state into ``path``, with ``caches`` this rank's cache too (herald/worker/warm.py)."""
        if self.dense is None:
            raise HeraldError("save requested before attach(model, optimizer)")
        save_checkpoint_part(path, self.dense, self.executor, self.protocol, caches)
        self.link.send_saved()

    # ------------------------------------------------------------- closing
    def close(self, timeout_s: float = DEFAULT_TIMEOUT_MS / 1000) -> None:
        """Stop the dense side's background thread (training groups' averaging) within
        ``timeout_s``, close the PS client and the dispatcher socket (at once), and destroy
        the process group :meth:`connect` created. Idempotent; ``with`` closes with the
        link's ``timeout_ms``."""
        if self._closed:
            return
        self._closed = True
        OPEN_LOADERS.discard(self)
        stats = None
        if self.dense is not None:  # the averaging thread's statistics, for the report
            self.dense.close(timeout_s)
            stats = self.dense.background_stats(self.job.run_dir)
        self.executor.close()
        self.link.close()
        self.group.leave(threads_ended=stats is None or bool(stats.get("thread_ended")))

    def __enter__(self) -> ScheduledLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(self.link.timeout_ms / 1000)
