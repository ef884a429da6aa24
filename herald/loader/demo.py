"""The loader half of the README's main job (``herald demo`` is registered by the lead).

``run_demo(args)``: ``herald datagen`` into a temporary directory, then read it back
through :class:`GlobalBatcher` (shuffle buffer, prefetch) and print samples/s and
the stats. ``args`` is any object with optional attributes ``rows`` (default
200,000), ``seed`` (0), ``batch_size`` (4,096), ``shuffle_buffer`` (16,384),
``fit`` (a real file to fit the synthetic spec to; default: criteo-kaggle preset).
"""

from __future__ import annotations

import tempfile
import time

from herald.loader.batcher import GlobalBatcher
from herald.loader.conversion import datagen
from herald.loader.parquet import ParquetSource


def run_demo(args) -> int:
    """Generate, read back, print throughput and stats. Returns the exit code (0)."""
    rows = int(getattr(args, "rows", None) or 200_000)
    seed = int(getattr(args, "seed", None) or 0)
    batch_size = int(getattr(args, "batch_size", None) or 4096)
    shuffle = int(getattr(args, "shuffle_buffer", None) or 16384)
    fit = getattr(args, "fit", None)
    with tempfile.TemporaryDirectory(prefix="herald-demo-") as tmp:
        t0 = time.perf_counter()
        out = datagen(tmp, rows=rows, seed=seed, fit=fit, progress=False)
        t_gen = time.perf_counter() - t0
        print(f"datagen: {out['rows']:,} rows -> {out['path']} in {t_gen:.2f} s "
              f"({out['rows'] / max(t_gen, 1e-9):,.0f} rows/s)")
        source = ParquetSource(tmp)
        t0 = time.perf_counter()
        with GlobalBatcher(source, batch_size, shuffle_buffer=shuffle, seed=seed) as batcher:
            first = None
            for batch in batcher:
                first = first or batch
            stats = batcher.stats
        dt = time.perf_counter() - t0
        source.close()
        print(f"loader: {stats['rows']:,} samples in {stats['batches']} batches of {batch_size} in "
              f"{dt:.2f} s ({stats['rows'] / max(dt, 1e-9):,.0f} samples/s)")
        print(f"first batch: {first!r}; label rate {float(first.labels.mean()):.3f}")
        print(f"stats: {stats}")
    return 0
