"""HeraldIterableDataset: herald's loader as a ``torch.utils.data.IterableDataset``.

For training code that already uses ``torch.utils.data.DataLoader`` (or torchdata's
``StatefulDataLoader``) and wants herald's sources, decoding and resumable position
without the scheduler (docs/loader.md, "Using herald as a DataLoader")::

    dataset = HeraldIterableDataset("train.parquet", 4096, output="torch")
    loader = DataLoader(dataset, batch_size=None, num_workers=2, pin_memory=True)

NOTE [dataset shards]:

- A loader on ``world_size`` ranks with ``W = max(num_workers, 1)`` DataLoader workers
  each reads ``N = world_size x W`` shards; the worker ``w`` of rank ``r`` reads shard
  ``g = r x W + w`` (``torch.utils.data.get_worker_info()`` gives ``w`` and ``W``).
- Shard ``g`` is a contiguous range of the source's rows in read order
  (:func:`shard_range`, ``n`` rows, batch size ``B``):
  ``drop_last=False`` (default): rows ``[g n // N, (g+1) n // N)``. Every row is in
  exactly one shard: no row is dropped or repeated. Shards differ by at most one
  row; a shard ends with a short batch when its rows are not a multiple of ``B``, so
  ranks may yield different numbers of batches (at most ``W`` apart).
  ``drop_last=True``: every shard holds ``k = n // (N B)`` full batches, rows
  ``[g k B, (g+1) k B)``; the last ``n - N k B`` rows (fewer than ``N B``) are not read.
  Every rank yields exactly ``W k`` batches, which DDP needs (a rank with one step more
  than the others waits forever in the all-reduce).
- Positioning: synthetic sources and Parquet under ``bad_records="strict"`` move to
  the shard's first row directly (the states of docs/loader.md, "Position and
  resume"); the others (text formats, Parquet under ``skip``, whose good rows are known
  only after decoding) read and discard the rows before it
  (:class:`~herald.loader.splits.RowRange`), so shard ``g`` also decodes ``g/N`` of the
  input: convert to Parquet (``herald convert``) to read a text file with many shards.
- In a shard, batches come from a :class:`~herald.loader.batcher.GlobalBatcher` (NOTE
  [batcher protocol]): ``shuffle_buffer`` shuffles within the shard with a seed drawn
  from ``(seed, epoch, g)``; its state is the shard's position.
- Kafka (``kafka://``) is not supported: a stream has no row count to cut into
  disjoint shards, and a kafka-python consumer is not fork-safe (it cannot live in a
  DataLoader worker). Read a topic with ``herald train`` / ``herald serve dispatcher``,
  or give each rank its own ``partitions=`` and use the Kafka source directly.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from herald.config import require
from herald.errors import DataError
from herald.loader.batch import SampleBatch, Schema
from herald.loader.batcher import GlobalBatcher
from herald.loader.formats.parquet import ParquetSource, dataset_files
from herald.loader.registry import infer_format, open_source
from herald.loader.source import Source
from herald.loader.splits import RowRange
from herald.loader.synthetic import SyntheticSource
from herald.loader.torchrec_interop import TORCHREC_HINT, _torchrec, to_torchrec  # noqa: F401 (re-exported)

STATE_FORMAT = "herald_iterable_dataset"
OUTPUTS = ("batch", "torch", "kjt")


@dataclasses.dataclass(frozen=True)
class DatasetSettings:
    """Args: batch_size: samples per yielded batch (>= 1); output: ``batch``
    (:class:`SampleBatch`), ``torch`` (:class:`TorchBatch`, a dict of tensors) or
    ``kjt`` (torchrec ``Batch`` with a ``KeyedJaggedTensor``); shuffle_buffer: rows of
    the per-shard shuffle buffer (0: read order); seed: shuffle seed (>= 0);
    drop_last: NOTE [dataset shards]; prefetch_batches: batches read ahead by a thread in
    the process that iterates (0: no thread)."""

    batch_size: int
    output: str = "batch"
    shuffle_buffer: int = 0
    seed: int = 0
    drop_last: bool = False
    prefetch_batches: int = 2

    def __post_init__(self) -> None:
        for name in ("batch_size", "shuffle_buffer", "seed", "prefetch_batches"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}")
        require(
            self.batch_size >= 1,
            f"batch_size must be >= 1, got {self.batch_size}; the dataset batches, "
            "so give the DataLoader batch_size=None",
        )
        require(self.output in OUTPUTS, f"output must be one of {list(OUTPUTS)}, got {self.output!r}")
        require(self.shuffle_buffer >= 0, f"shuffle_buffer must be >= 0 (0: no shuffle), got {self.shuffle_buffer}")
        require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        require(isinstance(self.drop_last, bool), f"drop_last must be a bool, got {self.drop_last!r}")
        require(self.prefetch_batches >= 0, f"prefetch_batches must be >= 0, got {self.prefetch_batches}")


def shard_range(num_rows: int, shard: int, num_shards: int, batch_size: int, drop_last: bool) -> tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``shard`` of ``num_shards`` (NOTE [dataset shards]).

    Raises:
        ConfigError: ``shard`` not in ``[0, num_shards)``.
    """
    require(0 <= shard < num_shards, f"shard {shard} is not in [0, {num_shards})")
    if drop_last:
        per = num_rows // (num_shards * batch_size) * batch_size
        return shard * per, (shard + 1) * per
    return shard * num_rows // num_shards, (shard + 1) * num_rows // num_shards


def _seek_state(source: Source, row: int) -> dict | None:
    """The state of ``source`` after its first ``row`` rows when it can be computed
    without decoding (docs/loader.md, "Position and resume"), else None."""
    base = {"format": source.format_name, "rows": row, "skipped": {}}
    if isinstance(source, SyntheticSource):
        return {**base, "row": row, "seed": source.seed}
    if not isinstance(source, ParquetSource) or source.num_rows is None:
        return None  # under ``skip`` a good row's index is known only after decoding
    path = pathlib.Path(source.path)
    for fi, file in enumerate(dataset_files(path) if path.is_dir() else [path]):
        meta = pq.read_metadata(file)
        for gi in range(meta.num_row_groups):
            if row < meta.row_group(gi).num_rows:
                return {**base, "file_index": fi, "file": file.name, "row_group": gi, "row": row}
            row -= meta.row_group(gi).num_rows
    return None


def open_shard(spec: str, options: Mapping[str, Any], start: int, stop: int) -> Source:
    """Rows ``[start, stop)`` of ``open_source(spec, **options)``, moved to ``start``
    directly when the source allows it (NOTE [dataset shards], "Positioning")."""
    source = open_source(spec, **options)
    state = _seek_state(source, start) if 0 < start < stop else None
    if state is None:
        return RowRange(source, start, stop)
    source.load_state_dict(state)
    return RowRange(source, 0, stop - start)


def _default_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    for name, value in (("rank", rank), ("world_size", world_size)):
        require(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}")
    require(world_size >= 1, f"world_size must be >= 1, got {world_size}")
    require(0 <= rank < world_size, f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


def _shard_seed(seed: int, epoch: int, shard: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, shard]).generate_state(1)[0])


class Jagged(NamedTuple):
    """One table of a :class:`TorchBatch`: ``values`` int64 [nnz] (the uint64 ids' bits),
    ``offsets`` int64 [B+1] (sample ``i`` uses ``values[offsets[i]:offsets[i+1]]``)."""

    values: torch.Tensor
    offsets: torch.Tensor


class TorchBatch(dict):
    """``output="torch"``: ``labels`` float32 [B], ``dense`` float32 [B, D] and, per table
    name, a :class:`Jagged` (:meth:`SampleBatch.to_torch` with named pairs).

    Between processes (a DataLoader worker to the main process) it travels as four
    tensors (labels, dense, every table's values in one, every table's offsets in one
    [T, B+1]) and is rebuilt as views: torch shares each tensor through its own file
    descriptor, and two tensors per table made 2 workers ~5x slower (45k against 240k
    samples/s of 4,096-sample Criteo-shaped batches, 2 shared cores).
    """

    @classmethod
    def from_batch(cls, batch: SampleBatch) -> TorchBatch:
        return cls(
            (name, value if name in ("labels", "dense") else Jagged(*value)) for name, value in batch.to_torch().items()
        )

    def __copy__(self) -> TorchBatch:
        return TorchBatch(self)

    def __reduce__(self):
        names = [k for k in self if k not in ("labels", "dense")]
        b = self["labels"].shape[0]
        offsets = torch.stack([self[n][1] for n in names]) if names else torch.zeros((0, b + 1), dtype=torch.int64)
        return _torch_batch, (
            self["labels"],
            self["dense"],
            _all_values(self, names),
            offsets,
            [int(self[n][0].shape[0]) for n in names],
            names,
        )


def _all_values(tables: Mapping, names: list[str]) -> torch.Tensor:
    """int64 [sum nnz]: the values of tables ``names`` (``tables[name][0]``) one after the other."""
    return torch.cat([tables[n][0] for n in names]) if names else torch.zeros(0, dtype=torch.int64)


def _torch_batch(labels, dense, values, offsets, sizes, names) -> TorchBatch:
    out = TorchBatch(labels=labels, dense=dense)
    for name, v, o in zip(names, torch.split(values, sizes), offsets.unbind(0)):
        out[name] = Jagged(v, o)
    return out


_CONVERT = {"batch": lambda b: b, "torch": TorchBatch.from_batch, "kjt": to_torchrec}


class HeraldIterableDataset(IterableDataset):
    """Batches of any herald source, sharded across DataLoader workers and ranks
    (NOTE [dataset shards]); give the DataLoader ``batch_size=None``.

    Yields, per ``output``: ``batch``: :class:`SampleBatch` (labels float32 [B], dense
    float32 [B, D], per table uint64 values [nnz] and int64 offsets [B+1]); ``torch``: a
    :class:`TorchBatch`, a dict ``labels`` float32 [B], ``dense`` float32 [B, D] and, per
    table name, ``Jagged(values int64 [nnz], offsets int64 [B+1])``; ``kjt``:
    :func:`to_torchrec`. All three are pinned by ``DataLoader(pin_memory=True)``
    (tensors, or a ``pin_memory()`` method).

    Resume (torchdata ``StatefulDataLoader`` conventions): ``state_dict()`` is the
    position of every shard this process iterated (``shards``: shard index -> the
    shard's :class:`GlobalBatcher` state), the epoch and the seed; ``load_state_dict``
    makes the next iteration of each shard yield exactly the batches after that
    position. ``StatefulDataLoader`` saves and restores it in each worker. Epochs follow
    ``DistributedSampler``: call :meth:`set_epoch` before each epoch (it reseeds the
    shuffle); iterating again without it repeats the epoch.

    Args:
        source: a path or URL as for :func:`~herald.loader.open_source` (any format but
            ``kafka``); opened in each worker, so the dataset pickles.
        batch_size, output, shuffle_buffer, seed, drop_last, prefetch_batches: as
            :class:`DatasetSettings`.
        rank, world_size: this process among the ranks (default: torch.distributed's
            when it is initialised, else 0 and 1).
        source_options: options of the source (``bad_records``, ``threshold``, ...).

    Raises:
        ConfigError: a bad setting, a ``kafka://`` source, ``quarantine_path`` (shards
            re-read rows), a table named ``labels`` or ``dense`` with ``output="torch"``;
            unknown source options. DataError: the source cannot be read.
        ImportError: ``output="kjt"`` without torchrec (the message gives the install:
            ``make torchrec``, docs/torchrec.md).
    """

    def __init__(
        self,
        source: str,
        batch_size: int,
        *,
        output: str = "batch",
        shuffle_buffer: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        prefetch_batches: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        source_options: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        self.settings = DatasetSettings(batch_size, output, shuffle_buffer, seed, drop_last, prefetch_batches)
        self.rank, self.world_size = _default_rank(rank, world_size)
        self.spec, self.source_options = str(source), dict(source_options or {})
        self._check_source()
        if output == "kjt":
            _torchrec()
        with open_source(self.spec, **self.source_options) as src:
            self.schema: Schema = src.schema
            rows = src.num_rows
            #: rows of the source (good rows under ``bad_records="skip"``): one pass when unknown.
            self.num_rows: int = rows if rows is not None else sum(len(b) for b in src)
        clash = {"labels", "dense"} & set(self.schema.table_names)
        require(
            output != "torch" or not clash,
            f"table(s) {sorted(clash)} clash with the 'labels'/'dense' keys "
            "of output='torch'; rename them in the data or use output='batch'",
        )
        self.epoch = 0
        self._resume: dict[str, dict] = {}  # shard -> saved entry, used by its next iteration
        self._positions: dict[str, Any] = {}  # shard -> (num_shards, live GlobalBatcher or its final state)

    def _check_source(self) -> None:
        fmt = self.source_options.get("format") or infer_format(self.spec)
        require(
            fmt != "kafka",
            "a kafka:// stream cannot be a HeraldIterableDataset (no row count to shard, and "
            "a Kafka consumer cannot live in a DataLoader worker); train from Kafka with herald "
            "train, or read it with open_source and partitions= per rank",
        )
        require(
            "quarantine_path" not in self.source_options,
            "quarantine_path is not supported here (shards and epochs re-read rows, so a bad record would be "
            "written several times); quarantine once with herald convert SRC DST.parquet --bad-records skip "
            "--quarantine FILE and read DST.parquet",
        )

    # ---------------------------------------------------------------- epochs
    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next (reseeds the shuffle; forgets positions of another epoch).

        Raises:
            ConfigError: ``epoch`` is not an int >= 0.
        """
        require(
            isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0,
            f"epoch must be an int >= 0, got {epoch!r}",
        )
        if epoch != self.epoch:
            self.epoch, self._resume, self._positions = epoch, {}, {}

    def num_shards(self, num_workers: int) -> int:
        """Shards of a loader with ``num_workers`` DataLoader workers per rank."""
        return self.world_size * max(num_workers, 1)

    def dropped_rows(self, num_workers: int) -> int:
        """Rows no shard reads in an epoch (0 unless ``drop_last``), NOTE [dataset shards]."""
        if not self.settings.drop_last:
            return 0
        n = self.num_shards(num_workers)
        return self.num_rows - n * shard_range(self.num_rows, 0, n, self.settings.batch_size, True)[1]

    def __getstate__(self) -> dict:
        # a DataLoader pickles the dataset for its workers (spawn): positions travel as states
        return {**self.__dict__, "_positions": self._saved_positions()}

    def _saved_positions(self) -> dict[str, tuple[int, dict]]:
        """shard -> (num_shards, GlobalBatcher state) of every shard iterated in this epoch."""
        return {k: (n, pos if isinstance(pos, dict) else pos.state_dict()) for k, (n, pos) in self._positions.items()}

    # ------------------------------------------------------------- iteration
    def _shard(self) -> tuple[int, int]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self):
        shard, num_shards = self._shard()
        resume = self._take_resume(shard, num_shards)
        s = self.settings
        start, stop = shard_range(self.num_rows, shard, num_shards, s.batch_size, s.drop_last)
        source = open_shard(self.spec, self.source_options, start, stop)
        batcher = GlobalBatcher(
            source,
            s.batch_size,
            shuffle_buffer=s.shuffle_buffer,
            seed=_shard_seed(s.seed, self.epoch, shard),
            prefetch_batches=s.prefetch_batches,
        )
        key = str(shard)
        try:
            if resume is not None:
                batcher.load_state_dict(resume)
            self._positions[key] = (num_shards, batcher)
            convert = _CONVERT[s.output]
            for batch in batcher:
                yield convert(batch)
        finally:
            batcher.close()
            source.close()
            if self._positions.get(key, (None, None))[1] is batcher:
                self._positions[key] = (num_shards, batcher.state_dict())

    def _take_resume(self, shard: int, num_shards: int) -> dict | None:
        """The saved position of ``shard`` (consumed), or None to start the epoch."""
        if not self._resume:
            return None
        saved = {entry["num_shards"] for entry in self._resume.values()}
        require(
            saved == {num_shards},
            f"the state was saved with {sorted(saved)} shards (world_size x num_workers), "
            f"this loader reads {num_shards}; resume with the same world_size and "
            "num_workers",
        )
        entry = self._resume.pop(str(shard), None)
        require(
            entry is not None,
            f"the state holds the positions of shards {sorted(self._resume, key=int)}, not "
            f"of shard {shard}; load the state this worker saved (StatefulDataLoader does)",
        )
        return entry["batcher"]

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """JSON-serialisable: settings, ``epoch``, ``seed``, ``num_rows`` and ``shards``
        (shard index -> ``{"num_shards", "batcher": GlobalBatcher state}``)."""
        shards = dict(self._resume)
        for key, (num_shards, pos) in self._saved_positions().items():
            shards[key] = {"num_shards": num_shards, "batcher": pos}
        s = self.settings
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "seed": s.seed,
            "batch_size": s.batch_size,
            "shuffle_buffer": s.shuffle_buffer,
            "drop_last": s.drop_last,
            "num_rows": self.num_rows,
            "shards": shards,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from :meth:`state_dict` of a dataset over the same data).

        Raises:
            DataError: malformed state. ConfigError: saved with other settings or data.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise DataError("not a HeraldIterableDataset state; pass HeraldIterableDataset.state_dict()")
        s = self.settings
        for key, mine in (
            ("seed", s.seed),
            ("batch_size", s.batch_size),
            ("shuffle_buffer", s.shuffle_buffer),
            ("drop_last", s.drop_last),
            ("num_rows", self.num_rows),
        ):
            require(
                state.get(key) == mine,
                f"state saved with {key}={state.get(key)!r}, this dataset has "
                f"{mine!r}; build it with the same settings and data",
            )
        epoch, shards = state.get("epoch"), state.get("shards")
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(shards, dict):
            raise DataError("malformed dataset state: 'epoch' must be an int >= 0 and 'shards' a dict")
        for key, entry in shards.items():
            if not (
                isinstance(key, str)
                and key.isdigit()
                and isinstance(entry, dict)
                and isinstance(entry.get("num_shards"), int)
                and isinstance(entry.get("batcher"), dict)
            ):
                raise DataError(
                    f"malformed dataset state: shard {key!r} must map to {{'num_shards': int, 'batcher': dict}}"
                )
        self.epoch, self._positions = epoch, {}
        self._resume = {key: dict(entry) for key, entry in shards.items()}
