"""The groups of related settings :class:`~herald.contracts.train.TrainConfig` nests: each a
frozen dataclass that validates itself on construction, naming the flag; every field a
:func:`~herald.config.setting` whose option keeps its flat name (``--cache-rows`` is
``cfg.cache.rows``: :class:`herald.config.Nested`). Checks across groups stay in TrainConfig.

Imports no numba/torch/zmq package (see herald/contracts/train.py).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re

from herald.config import require, setting
from herald.contracts.features import Declarations
from herald.contracts.flags import _choice, _flag, _integer, _number, scheduling_budget_value
from herald.contracts.vocab import (
    CACHE_DEVICES,
    CACHE_POLICIES,
    DENSE_OPTIMIZERS,
    LAUNCHERS,
    MAX_EMBEDDING_DIM,
    SCHEDULES,
    SPARSE_OPTIMIZERS,
)

#: Worker cache rows for a kafka:// stream without --cache-rows: a stream has no known
#: set of keys to take --cache-ratio of.
STREAM_CACHE_ROWS = 100_000
#: The schedules whose allocation ``--scheduling-budget`` adapts (LAIA's, ours).
ADAPTIVE_SCHEDULES = ("herald", "laia", "costaware")


@dataclasses.dataclass(frozen=True)
class SchedulingSettings:
    """How the dispatcher's scheduler allocates and plans (Herald §3, §4; docs/scheduler.md).

    Attributes:
        schedule: one of :data:`~herald.contracts.vocab.SCHEDULES` (``--schedule``).
        budget: ``--scheduling-budget``: None (static LAIA), ``"auto"`` or milliseconds > 0 (Herald §4.3).
        threads: ``--scheduler-threads``, 1..256 (Herald §4.4).

    Raises:
        ConfigError: a value out of range, or a budget for a schedule that does not adapt.
    """

    schedule: str = setting(
        "herald",
        "herald (LAIA allocation + communication plan), costaware (our cost-aware "
        "allocation + communication plan), laia (LAIA allocation + full-set sync), "
        "plan (random partition + communication plan), vanilla (random partition + "
        "full-set sync: the baseline), optimal (brute-force allocation: --batch-size 1, "
        "<= 8 workers)",
        choices=SCHEDULES,
    )
    budget: str | float | None = setting(
        None,
        "adaptive LAIA (Herald §4.3; --schedule herald, laia or costaware): allocation scores only the "
        "tables with the highest degree of infrequency that fit a scheduling time per global batch of: auto "
        "(half of the measured training step, so the scheduler stays off the critical path) or MS "
        "milliseconds; k is never lowered when even one table would not fit; k over time is in the report "
        "(default: static, every table). With CPU workers auto keeps every table, so it trains as static: "
        "scoring is not the cost (measured: scheduling ~1.5 ms of a 35-45 ms step, docs/scheduler.md); k "
        "drops only where scheduling takes over half a step (short GPU steps)",
        metavar="auto|MS",
        type=scheduling_budget_value,
        dest="scheduling_budget",
    )
    threads: int = setting(
        1,
        "threads of the scheduler's per-table, per-sample and per-worker passes "
        "(Herald §4.4); the plans do not depend on it",
        metavar="N",
        dest="scheduler_threads",
    )

    def __post_init__(self) -> None:
        _choice(self, "schedule", SCHEDULES)
        _integer(self, "threads", 1, 256, flag="--scheduler-threads")
        budget = self.budget
        require(
            budget is None
            or budget == "auto"
            or (
                isinstance(budget, numbers.Real)
                and not isinstance(budget, bool)
                and math.isfinite(budget)
                and budget > 0
            ),
            f"--scheduling-budget must be auto or a number of milliseconds > 0, got {budget!r}",
        )
        require(
            budget is None or self.schedule in ADAPTIVE_SCHEDULES,
            f"--scheduling-budget adapts the LAIA / costaware allocation: use it with --schedule herald, laia "
            f"or costaware, not {self.schedule}",
        )


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """Each worker's embedding cache (HET §4.3; NOTE [worker devices] in herald/worker/devices.py).

    Attributes:
        ratio: its size as a fraction of the training split's distinct keys, in (0, 1].
        rows: its size in rows (>= 1; overrides ``ratio``), or None.
        policy: eviction, one of :data:`~herald.contracts.vocab.CACHE_POLICIES`.
        device: where its rows live, one of :data:`~herald.contracts.vocab.CACHE_DEVICES`.

    Raises:
        ConfigError: a value out of range.
    """

    ratio: float = setting(0.1, "worker cache size as a fraction of the distinct keys in the training split")
    rows: int | None = setting(
        None, f"worker cache size in rows (overrides --cache-ratio; default for a kafka:// stream: {STREAM_CACHE_ROWS})"
    )
    policy: str = setting("lru", "worker cache eviction policy", choices=CACHE_POLICIES)
    device: str = setting(
        "auto",
        "where each worker's embedding cache lives: auto (on the GPU when the "
        "device is one, else host memory), cpu (host memory: caches larger than "
        "GPU memory), torch (torch rows on the training device, also on the CPU)",
        choices=CACHE_DEVICES,
    )

    def __post_init__(self) -> None:
        _choice(self, "policy", CACHE_POLICIES, flag="--cache-policy")
        _integer(self, "rows", 1, optional=True, flag="--cache-rows")
        _choice(self, "device", CACHE_DEVICES, flag="--cache-device")
        _number(self, "ratio", "in (0, 1]", lambda x: 0 < x <= 1, flag="--cache-ratio")


@dataclasses.dataclass(frozen=True)
class EmbeddingSettings:
    """The embedding tables: one dim and sparse optimizer for every table (Persia §4.2.2: the
    optimizer state lives in the row; herald/contracts/tables.py).

    Attributes:
        dim: 1..:data:`~herald.contracts.vocab.MAX_EMBEDDING_DIM`; optimizer: one of
            :data:`~herald.contracts.vocab.SPARSE_OPTIMIZERS`; lr: its learning rate, > 0.

    Raises:
        ConfigError: a value out of range.
    """

    dim: int = setting(16, "embedding dimension of every table a --tables file does not size", dest="embedding_dim")
    optimizer: str = setting("rowwise_adagrad", "sparse optimizer of the embeddings", choices=SPARSE_OPTIMIZERS)
    lr: float = setting(0.05, "sparse learning rate")
    tables_file: str | None = setting(
        None,
        "TOML or JSON file declaring tables (dim, optimizer, lr, init) and the features that read them "
        "(table, pooling sum|mean|none, max_length): features may share a table, pool by mean, or be "
        "sequences (docs/models.md, 'Tables and features'); a feature it does not name keeps a table of "
        "its own at --embedding-dim (default: one table per feature)",
        metavar="FILE",
        dest="tables",
    )

    def __post_init__(self) -> None:
        _choice(self, "optimizer", SPARSE_OPTIMIZERS)
        _integer(self, "dim", 1, MAX_EMBEDDING_DIM, flag="--embedding-dim")
        _number(self, "lr", "> 0", lambda x: x > 0)
        # read once, here: a bad file is named before anything starts, and every later use
        # (the schema checks, the job data, the job spec) resolves the same declarations
        decl = Declarations() if self.tables_file is None else Declarations.from_file(self.tables_file)
        object.__setattr__(self, "_declarations", decl)  # not a field: not compared, not a flag

    def declarations(self) -> Declarations:
        """The ``--tables`` file's :class:`~herald.contracts.features.Declarations` (empty without
        one), as read when these settings were made."""
        decl: Declarations = self.__dict__["_declarations"]  # set by __post_init__ (not a field)
        return decl


@dataclasses.dataclass(frozen=True)
class DenseSettings:
    """The dense parameters' optimizer (torch.optim): one of :data:`~herald.contracts.vocab.DENSE_OPTIMIZERS`
    and its learning rate ``lr`` > 0.

    Raises:
        ConfigError: a value out of range.
    """

    optimizer: str = setting("adam", "optimizer of the dense parameters", choices=DENSE_OPTIMIZERS)
    lr: float = setting(0.001, "dense learning rate")

    def __post_init__(self) -> None:
        _choice(self, "optimizer", DENSE_OPTIMIZERS, flag="--dense-optimizer")
        _number(self, "lr", "> 0", lambda x: x > 0, flag="--dense-lr")


@dataclasses.dataclass(frozen=True)
class RecoverySettings:
    """Restart budgets: a job rolls back to its latest checkpoint when one of its processes is
    lost, each cause its own budget (NOTE [worker failover] in herald/job/recovery/rollback.py).

    Attributes:
        ps_restarts, worker_restarts: rollbacks at most (>= 0) for a lost PS shard, a lost worker.

    Raises:
        ConfigError: a budget below 0; from :meth:`check`, a budget without checkpoints.
    """

    ps_restarts: int = setting(
        0,
        "when a PS shard dies, roll the whole job back to its latest checkpoint and go on, at "
        "most this many times (Persia-style failover; needs --checkpoint-every)",
        metavar="N",
    )
    worker_restarts: int = setting(
        0,
        "when a worker process dies (killed by a signal, crashed) or goes silent, roll "
        "the whole job back to its latest checkpoint and go on, at most this many "
        "times (needs --checkpoint-every); a worker that reports an error of its own "
        "(a diverged loss, a bad setting) still ends the job (docs/operations.md)",
        metavar="N",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _integer(self, f.name, 0)

    def check(self, checkpoint_every: int) -> None:
        """A budget needs a checkpoint to roll back to (``checkpoint_every`` > 0)."""
        for f in dataclasses.fields(self):
            budget = getattr(self, f.name)
            require(
                budget == 0 or checkpoint_every > 0,
                f"{_flag(f.name)} {budget} rolls the job back to its latest checkpoint, and without "
                f"--checkpoint-every there is none: add --checkpoint-every STEPS (and --run-dir) or leave "
                f"{_flag(f.name)} out",
            )


@dataclasses.dataclass(frozen=True)
class SecuritySettings:
    """Transport security (NOTE [transport security] in herald/auth.py, docs/operations.md).

    Attributes:
        keys_dir: the CURVE keys folder (``--keys``), or None.
        insecure: let a role bind a non-loopback address without keys.

    Raises:
        ConfigError: an empty folder path, or ``insecure`` not a bool.
    """

    keys_dir: str | None = setting(
        None,
        "CURVE keys folder (herald keys generate DIR): every role authenticates "
        "and encrypts its ZeroMQ traffic with it (NOTE [transport security], "
        "docs/operations.md)",
        flag="--keys",
        metavar="DIR",
    )
    insecure: bool = setting(
        False, "let a role bind a non-loopback address without --keys (unauthenticated, unencrypted; warns)"
    )

    def __post_init__(self) -> None:
        require(
            self.keys_dir is None or (isinstance(self.keys_dir, str) and self.keys_dir.strip() != ""),
            f"--keys must be a folder path, got {self.keys_dir!r}",
        )
        require(isinstance(self.insecure, bool), f"--insecure is a switch (True/False), got {self.insecure!r}")


@dataclasses.dataclass(frozen=True)
class LauncherSettings:
    """Who runs a job's PS shards and workers (docs/cluster.md).

    Attributes:
        name: one of :data:`~herald.contracts.vocab.LAUNCHERS` (``--launcher``).
        ray_address, storage_path: the Ray launcher's cluster and shared folder, or None.

    Raises:
        ConfigError: an unknown launcher, an empty string, or a Ray setting without ``--launcher ray``.
    """

    name: str = setting(
        "local",
        "who runs the PS shards and the workers: local (processes of this host) or ray "
        "(Ray actors with resource requests, placed over the nodes of a Ray cluster; "
        "the dispatcher stays in this process: docs/cluster.md)",
        choices=LAUNCHERS,
        dest="launcher",
    )
    ray_address: str | None = setting(
        None,
        "--launcher ray: the Ray cluster to run on, as ray.init takes it (auto: "
        "the cluster of this node; host:port of its head); default: $RAY_ADDRESS "
        "when set (ray job submit sets it), else a local Ray instance started for "
        "the job and stopped after. Not ray:// (Ray Client): this process runs "
        "the dispatcher, which the workers must reach",
        metavar="ADDRESS",
    )
    storage_path: str | None = setting(
        None,
        "--launcher ray: a folder every node of the cluster mounts at the same "
        "path (NFS, a shared volume); the run folder (--run-dir) is then "
        "STORAGE_PATH/RUN_DIR. Default: --run-dir itself, which every node "
        "running a role must then see (checked before the roles start)",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        _choice(self, "name", LAUNCHERS, flag="--launcher")
        for name in ("ray_address", "storage_path"):
            value = getattr(self, name)
            require(
                value is None or (isinstance(value, str) and value.strip() != ""),
                f"{_flag(name)} must be a non-empty string, got {value!r}",
            )
            require(
                value is None or self.is_ray,
                f"{_flag(name)} is a setting of the Ray launcher: add --launcher ray, or leave {_flag(name)} out",
            )
        require(
            not (self.ray_address or "").startswith("ray://"),
            f"--ray-address {self.ray_address}: Ray Client (ray://) runs this process off the cluster, and the "
            "workers must reach its dispatcher: run herald train on a node of the cluster (ray job submit -- "
            "herald train --launcher ray --ray-address auto ..., or a KubeRay RayJob: docs/cluster.md)",
        )

    def check(self, device: str, pin_cores: bool, run_dir: str) -> str:
        """Check the Ray launcher against the job's ``--device``, ``--pin-cores`` and ``--run-dir``
        (docs/cluster.md); returns the run folder: with ``--storage-path``
        ``STORAGE_PATH/RUN_DIR`` (a path already inside it is kept, so a copy of the settings
        keeps it too), else ``run_dir``.

        Raises:
            ConfigError: a setting the Ray launcher cannot run, naming the flag and the fix.
        """
        if not self.is_ray:
            return run_dir
        require(
            not re.fullmatch(r"cuda:[0-9]+", device),
            f"--device {device}: under --launcher ray each worker is given one GPU of its own by Ray: use "
            "--device cuda (or auto: GPUs when the cluster has one per worker)",
        )
        require(
            not pin_cores,
            "--pin-cores pins the processes of this host; under --launcher ray Ray places "
            "the PS shards and workers, each with its CPU request: leave --pin-cores out",
        )
        if self.storage_path is None:
            return run_dir
        storage = os.path.normpath(os.path.abspath(self.storage_path))
        run = os.path.normpath(os.path.join(storage, run_dir))
        require(
            os.path.commonpath([storage, run]) == storage,
            f"--run-dir {run_dir} is outside --storage-path {self.storage_path}: give a --run-dir "
            "relative to the storage path (the run folder is STORAGE_PATH/RUN_DIR)",
        )
        return run

    @property
    def is_ray(self) -> bool:
        """Whether Ray runs the roles (``--launcher ray``)."""
        return self.name == "ray"
