"""Every name a job can be configured with, defined once (docs/design.md, "Layers").

The settings classes (:mod:`herald.contracts.train`, :mod:`herald.contracts.job`,
:mod:`herald.contracts.tables`), the command-line choices and the parts that act on a name
(the scheduler's allocation policies, the PS kernels' optimizer codes, the wire codecs)
all read these tuples; nothing keeps a copy. Plain Python: no numba, torch or zmq, so
``herald train`` checks its options before anything heavy is imported.
"""

from __future__ import annotations

#: ``--schedule``: vanilla = random partition + full-set sync (the baseline), laia = LAIA
#: + full-set sync, plan = random + communication plan, herald = LAIA + communication
#: plan (Herald §3, §4), costaware = our cost-aware allocation + plan, optimal =
#: brute-force step-optimal allocation + plan (tiny cases only, Herald App. C).
SCHEDULES = ("costaware", "herald", "laia", "optimal", "plan", "vanilla")
#: The schedules a benchmark compares by default (``optimal`` is brute force).
BENCH_SCHEDULES = ("vanilla", "laia", "plan", "herald", "costaware")
#: Workers of one job: the cache snapshots keep one bit per worker per key (uint64 masks).
MAX_WORKERS = 64
#: Workers ``--schedule optimal`` (brute force over allocations) handles.
MAX_BRUTEFORCE_WORKERS = 8
MAX_EMBEDDING_DIM = 4096
#: PS shards of one job (``--ps-shards``, ``herald serve ps --num-shards``).
MAX_PS_SHARDS = 64

#: Sparse optimizers of the embedding rows; the index is the kernels' optimizer code
#: (row layouts in herald/contracts/tables.py; Persia §4.2.2: optimizer state lives in the row).
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
#: Optimizers of the dense parameters (torch.optim).
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
#: Row initialisers of an embedding table.
INITS = ("uniform", "normal", "zeros")
#: Worker cache and cache-snapshot eviction policies (HET §4.3).
CACHE_POLICIES = ("lru", "lfu")

#: ``--consistency``: ``bsp`` exact (NOTE [step protocol] in herald/contracts/plan.py);
#: ``bounded`` HET's clock-bounded reads (HET §3.3, §4.1); ``hybrid`` Persia's hybrid
#: training (Persia §3, §4.2); ``gba`` GBA's token-controlled global-batch aggregation
#: on the PS (GBA §4.1). docs/consistency.md.
CONSISTENCY_MODES = ("bsp", "bounded", "hybrid", "gba")

#: ``--wire-dtype``: embedding rows and gradients between workers and the PS (NOTE [wire
#: compression] in herald/ps/compress.py; Persia §4.2.3, HT §4.2).
WIRE_DTYPES = ("fp32", "fp16", "bf16", "int8")
#: ``--dense-comm``: the dense all-reduce (torch's DDP fp16/bf16 compress hooks' scheme).
DENSE_COMM_DTYPES = ("fp32", "fp16", "bf16")

#: ``--model``: ``auto`` picks by dataset (:func:`herald.contracts.train.auto_model`).
MODELS = ("auto", "dlrm", "ncf", "wdl", "deepfm", "dcn", "din")
#: Models reading the last element of each row as a scalar weight (NOTE [scalar slice]
#: in herald/worker/models.py): they need rows of at least 2 elements.
SCALAR_SLICE_MODELS = ("wdl", "deepfm")
#: ``--device`` values (NOTE [worker devices] in herald/worker/devices.py).
DEVICE_PATTERN = r"auto|cpu|cuda(:[0-9]+)?"
#: ``--cache-device`` choices.
CACHE_DEVICES = ("auto", "cpu", "torch")
#: ``--launcher``: who runs a ``herald train`` job's PS shards and workers (local processes,
#: or Ray actors: herald/job/ray/parts.py, docs/cluster.md).
LAUNCHERS = ("local", "ray")

#: Longest wait for any peer (a PS shard, the dispatcher, a worker) before it is
#: reported by name, milliseconds; every role's default.
DEFAULT_TIMEOUT_MS = 120_000
#: Largest ``--timeout-ms``: a day.
MAX_TIMEOUT_MS = 86_400_000
#: Least time the start-up waits get, milliseconds: the dispatcher's wait for its workers'
#: hellos and each worker's wait for the job (its ``config``) last the longer of
#: ``--timeout-ms`` and this, since starting a worker (Python, torch, numba) takes seconds
#: to tens of seconds on a loaded host however short a step's timeout is (docs/operations.md).
STARTUP_GRACE_MS = 60_000
