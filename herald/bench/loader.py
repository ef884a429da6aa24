"""``herald bench loader``: samples/s to produce 4,096-sample Criteo-shaped SampleBatches.

Measured in one run (medians of ``--repeats``), on Criteo-shaped data (13 dense,
26 single-hot tables, synthetic ``criteo-kaggle`` preset written by datagen):

- ``parquet``: ``ParquetSource.read(4096)`` with pyarrow threads off (one core);
- ``parquet+batcher``: the same through ``GlobalBatcher`` (prefetch thread);
- ``parquet+shuffle64k``: ``GlobalBatcher`` with a 65,536-row shuffle buffer;
- ``criteo_tsv``: ``CriteoSource`` over the real Kaggle sample repeated to ~30 MB;
- ``torch_dl_w0`` / ``torch_dl_w2``: a plain torch ``DataLoader`` over the same Parquet
  data (map-style Dataset holding the columns as numpy, returning one sample as
  tensors, default collate), ``num_workers`` 0 and 2;
- ``herald_dl_w0`` / ``herald_dl_w2``: the same ``DataLoader`` over
  :class:`~herald.loader.dataset.HeraldIterableDataset` on the Parquet file
  (``output="torch"``, ``batch_size=None``), ``num_workers`` 0 and 2: herald's loader
  used as a DataLoader dataset.

Each timing starts after the first batch (so worker start-up and JIT compilation
are excluded for every contender alike) and ratios are against the torch baselines.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from herald.loader.batch import SampleBatch
from herald.loader.batcher import GlobalBatcher
from herald.loader.conversion import datagen
from herald.loader.dataset import HeraldIterableDataset
from herald.loader.formats.parquet import ParquetSettings, ParquetSource
from herald.loader.formats.raw import CriteoSource


def _time_batches(make_iter, max_rows: int | None = None) -> float:
    """Samples/s of an iterator of batches, timed from after its first batch."""
    it = make_iter()
    first = next(it)
    n, t0 = 0, time.perf_counter()
    for b in it:
        n += _rows(b)
        if max_rows is not None and n >= max_rows:
            break
    dt = time.perf_counter() - t0
    del first
    close = getattr(it, "close", None)
    if close:
        close()
    return n / dt if dt > 0 else float("nan")


def _rows(batch) -> int:
    """Samples in a batch: a SampleBatch, a torch dict (``labels``) or a collated tuple."""
    if isinstance(batch, dict):
        return len(batch["labels"])
    return len(batch) if not isinstance(batch, (list, tuple)) else len(batch[0])


def _reads(source, batch_size):
    while True:
        b = source.read(batch_size)
        if b is None:
            return
        yield b


class _TorchDataset:
    """Map-style torch Dataset over the Parquet columns: one sample per ``__getitem__``."""

    def __init__(self, path):
        with ParquetSource(path) as source:
            batch = SampleBatch.concat(list(source))
        self.labels = torch.from_numpy(batch.labels.copy())
        self.dense = torch.from_numpy(batch.dense.copy())
        ids = np.zeros((len(batch), batch.num_tables), np.uint64)
        for t in range(batch.num_tables):
            present = batch.lengths(t).astype(bool)
            ids[present, t] = batch.values[t]
        self.ids = torch.from_numpy(ids.view(np.int64))

    def __len__(self):
        return self.labels.shape[0]

    def __getitem__(self, i):
        return self.labels[i], self.dense[i], self.ids[i]


def _torch_loader(dataset, batch_size, workers):
    return iter(DataLoader(dataset, batch_size=batch_size, num_workers=workers, persistent_workers=False))


def _herald_loader(path, batch_size, workers):
    return iter(
        DataLoader(HeraldIterableDataset(path, batch_size, output="torch"), batch_size=None, num_workers=workers)
    )


def run(rows: int, batch_size: int, repeats: int, torch_rows: int, criteo: str | None, workdir: str | None) -> dict:
    """Run every measurement; returns ``{name: median samples/s}``."""
    tmp = tempfile.TemporaryDirectory() if workdir is None else None
    work = pathlib.Path(workdir or tmp.name)
    try:
        pq_path = work / "bench_criteo_shaped.parquet"
        if not pq_path.exists():
            datagen(pq_path, rows=rows, seed=0, row_group_rows=65536, progress=False)
        criteo = criteo or str(
            pathlib.Path(__file__).resolve().parents[3]
            / "shared"
            / "data"
            / "criteo"
            / "criteo_kaggle_sample_train.tsv"
        )
        tsv = work / "bench_criteo_repeated.tsv"
        if not tsv.exists():
            data = pathlib.Path(criteo).read_bytes()
            tsv.write_bytes(data * max(1, (30 << 20) // max(len(data), 1)))
        contenders = {
            "parquet": lambda: _reads(ParquetSource(pq_path, settings=ParquetSettings(use_threads=False)), batch_size),
            "parquet+batcher": lambda: iter(GlobalBatcher(ParquetSource(pq_path), batch_size)),
            "parquet+shuffle64k": lambda: iter(GlobalBatcher(ParquetSource(pq_path), batch_size, shuffle_buffer=65536)),
            "criteo_tsv": lambda: _reads(CriteoSource(tsv), batch_size),
        }
        results = {name: statistics.median(_time_batches(f) for _ in range(repeats)) for name, f in contenders.items()}
        dataset = _TorchDataset(pq_path)
        for workers in (0, 2):
            results[f"torch_dl_w{workers}"] = statistics.median(
                _time_batches(lambda: _torch_loader(dataset, batch_size, workers), torch_rows) for _ in range(repeats)
            )
        for workers in (0, 2):
            results[f"herald_dl_w{workers}"] = statistics.median(
                _time_batches(lambda: _herald_loader(pq_path, batch_size, workers)) for _ in range(repeats)
            )
        return results
    finally:
        if tmp is not None:
            tmp.cleanup()


def report(results: dict) -> str:
    """A table of samples/s and the ratios against the torch DataLoader baselines."""
    lines = [f"{'loader':<20}{'samples/s':>14}{'x torch w0':>12}{'x torch w2':>12}"]
    for name, v in results.items():
        lines.append(f"{name:<20}{v:>14,.0f}{v / results['torch_dl_w0']:>12.1f}{v / results['torch_dl_w2']:>12.1f}")
    return "\n".join(lines)


def main(args) -> int:
    """Entry point of ``herald bench loader``."""
    if args.quick:
        args.rows, args.repeats, args.torch_rows = min(args.rows, 262144), 1, min(args.torch_rows, 16384)
    print(
        f"herald bench loader: {args.rows:,} Criteo-shaped rows (13 dense, 26 tables), "
        f"batch {args.batch_size}, medians of {args.repeats} (cores visible: {os.cpu_count()})"
    )
    results = run(args.rows, args.batch_size, args.repeats, args.torch_rows, args.criteo, args.workdir)
    print(report(results))
    return 0
