"""What a Ray job asks of its cluster and what each of its roles is told (NOTE [ray job] in
herald/job/ray/parts.py): the resource request of every role, the transport its sockets
use once Ray has placed them, the keys each role is given and the torch.distributed
environment of each worker. Pure functions over the settings and the placement: no Ray.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Mapping, Sequence

from herald.auth import CLIENT_SECRET, CLIENTS, SERVER_PUBLIC, SERVER_SECRET
from herald.contracts.tables import TableConfig
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.ps.store import ROW_OVERHEAD_BYTES

#: Memory of a PS shard process before its rows: Python, numpy, numba's kernels, ZeroMQ
#: (``herald serve ps`` with the 26 tables of the demo job and no row: 155 MiB resident,
#: measured), and room for its requests' buffers.
PS_BASE_BYTES = 512 << 20
#: A table's row array grows by doubling: its memory is up to twice its rows.
ROW_GROWTH = 2
#: Where a role's half of the keys lies in its private folder (``--keys FOLDER/keys``).
KEYS = "keys"


@dataclasses.dataclass(frozen=True)
class RoleRequest:
    """What one role asks of Ray: ``cpus`` (logical CPUs), ``gpus`` (0 or 1) and
    ``memory_bytes`` (0: none asked; Ray's ``memory`` resource, for placement only)."""

    name: str
    cpus: int
    gpus: int = 0
    memory_bytes: int = 0

    def bundle(self) -> dict[str, float]:
        """The placement group bundle of this role (Ray's resource names)."""
        out: dict[str, float] = {"CPU": float(self.cpus)}
        if self.gpus:
            out["GPU"] = float(self.gpus)
        if self.memory_bytes:
            out["memory"] = float(self.memory_bytes)
        return out

    def describe(self) -> str:
        """``1 CPU``, ``1 CPU, 1 GPU``, ``1 CPU, 0.9 GiB``."""
        parts = [f"{self.cpus} CPU"] + (["1 GPU"] if self.gpus else [])
        if self.memory_bytes:
            parts.append(f"{self.memory_bytes / (1 << 30):.1f} GiB")
        return ", ".join(parts)


def worker_cpus(env: Mapping[str, str] | None = None) -> int:
    """CPUs one worker asks for: its torch intra-op threads, ``OMP_NUM_THREADS`` when set
    for the job, else 1 (what the local launcher gives a worker: herald.job.parts.worker_env).

    Raises:
        ConfigError: ``OMP_NUM_THREADS`` is not an integer >= 1.
    """
    text = (os.environ if env is None else env).get("OMP_NUM_THREADS", "1")
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(
            f"OMP_NUM_THREADS={text!r}: the workers' threads (and the CPUs each asks of Ray) must "
            "be an integer >= 1; unset it for 1"
        )
    return int(text)


def needed_cpus(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> int:
    """Logical CPUs the job's roles ask for in all: every worker's and one per PS shard."""
    return cfg.workers * worker_cpus(env) + cfg.num_ps_shards


def wants_gpus(device: str, cluster_gpus: float, workers: int) -> bool:
    """Whether every worker asks for a GPU of its own: ``--device cuda`` always; ``auto``
    when the cluster has a GPU for each worker (as ``auto`` trains on CUDA when there is
    one); ``cpu`` never (``cuda:N`` is refused by the settings under Ray)."""
    return device == "cuda" or (device == "auto" and cluster_gpus >= workers)


def ps_memory_bytes(cfg: TrainConfig, tables: Sequence[TableConfig], distinct_keys: int | None) -> int:
    """Memory one PS shard asks for: :data:`PS_BASE_BYTES` plus its rows at their largest,
    each ``4 x row width + ROW_OVERHEAD_BYTES`` bytes, ``ROW_GROWTH`` times over: with
    ``--ps-max-rows R``, R rows of every table; else an equal share of the training split's
    distinct keys (``distinct_keys``, from the data's pre-pass); neither (a stream, or
    ``--cache-rows`` given, which skips the pre-pass): the base alone."""
    row_bytes = 4 * max(t.row_width for t in tables) + ROW_OVERHEAD_BYTES
    if cfg.ps_max_rows:
        rows = cfg.ps_max_rows * len(tables)
    elif distinct_keys:
        rows = math.ceil(distinct_keys / cfg.num_ps_shards)
    else:
        rows = 0
    return PS_BASE_BYTES + ROW_GROWTH * rows * row_bytes


def role_requests(
    cfg: TrainConfig,
    tables: Sequence[TableConfig],
    distinct_keys: int | None,
    gpus: bool,
    env: Mapping[str, str] | None = None,
) -> list[RoleRequest]:
    """The roles of the job in placement order, the workers first (``worker-0`` ..), then
    the PS shards (``ps-shard-0`` ..): :func:`worker_cpus` CPUs (and one GPU with ``gpus``)
    per worker; one CPU (a shard serves on one thread) and :func:`ps_memory_bytes` per shard."""
    threads, memory = worker_cpus(env), ps_memory_bytes(cfg, tables, distinct_keys)
    return [RoleRequest(f"worker-{r}", threads, int(gpus)) for r in range(cfg.workers)] + [
        RoleRequest(f"ps-shard-{i}", 1, 0, memory) for i in range(cfg.num_ps_shards)
    ]


def fits(request: RoleRequest, resources: Mapping[str, float]) -> bool:
    """Whether a node of ``resources`` (Ray's totals: ``CPU``, ``GPU``, ``memory``) can hold ``request``."""
    return all(resources.get(name, 0.0) >= amount for name, amount in request.bundle().items())


def worker_strategy(workers: Sequence[RoleRequest], nodes: Mapping[str, Mapping[str, float]]) -> str:
    """The placement strategy of the workers' group: ``STRICT_SPREAD`` (one worker per
    node) when at least as many alive ``nodes`` (node id -> total resources) can each hold
    a worker, else ``SPREAD`` (Ray's best effort: it may put two on a node that has room
    while another node has room too)."""
    able = sum(1 for resources in nodes.values() if fits(workers[0], resources))
    return "STRICT_SPREAD" if able >= len(workers) else "SPREAD"


def shard_selector(
    shard: RoleRequest, nodes: Mapping[str, Mapping[str, float]], worker_nodes: Sequence[str]
) -> dict[str, str] | None:
    """The label selector of each PS shard's bundle: nodes without a worker
    (``ray.io/node-id`` not among ``worker_nodes``) when one of the alive ``nodes`` can
    hold a shard; None (anywhere: beside the workers) when none can."""
    if not any(node not in worker_nodes and fits(shard, resources) for node, resources in nodes.items()):
        return None
    return {"ray.io/node-id": f"!in({','.join(sorted(set(worker_nodes)))})"}


def single_node(role_nodes: Sequence[str], driver_node: str) -> bool:
    """True when every role was placed on the node of this process (the dispatcher's):
    the job's sockets are then ipc (NOTE [local job sockets]), else TCP on each node's IP."""
    return all(node == driver_node for node in role_nodes)


def check_transport(single: bool, keys_dir: str | None, insecure: bool, nodes: int) -> None:
    """NOTE [transport security] for a job placed over ``nodes`` nodes, before any role
    starts: on one node every socket is ipc; over several each PS shard and the dispatcher
    bind TCP on their node's IP, which needs ``--keys`` (or ``--insecure``): the rule every
    role would apply itself, said once here.

    Raises:
        ConfigError: several nodes, no keys and not insecure (names both fixes).
    """
    if single or keys_dir is not None or insecure:
        return
    raise ConfigError(
        f"Ray placed the job's roles over {nodes} nodes, so the PS shards and the dispatcher must "
        "listen on their nodes' network addresses, and without keys anyone who reaches them could "
        "read and change the model: run `herald keys generate DIR` and add `--keys DIR` (the keys "
        "reach every role through Ray), or add --insecure to accept unauthenticated, unencrypted "
        "traffic on a network you trust (docs/cluster.md, 'Security')"
    )


def split_keys(keys_dir: str | os.PathLike) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The halves of a keys folder (NOTE [transport security]) that the roles are given,
    as ``{path in the role's private folder: bytes}``: a PS shard's (the servers' key pair,
    the authorised clients' public keys) and a worker's (the clients' key pair, the
    servers' public key). A worker never holds the servers' secret key.

    Raises:
        ConfigError: a file cannot be read.
    """
    root = pathlib.Path(keys_dir)

    def read(rel: str) -> bytes:
        try:
            return (root / rel).read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"cannot read {root / rel} ({exc.strerror or exc}): the keys folder of --keys must "
                "be readable by herald train, which sends each role its half"
            ) from None

    clients = sorted(p.relative_to(root).as_posix() for p in (root / CLIENTS).glob("*.key"))
    server = {f"{KEYS}/{rel}": read(rel) for rel in (SERVER_PUBLIC, SERVER_SECRET, *clients)}
    client = {f"{KEYS}/{rel}": read(rel) for rel in (SERVER_PUBLIC, CLIENT_SECRET)}
    return server, client


def local_ranks(role_nodes: Sequence[str], gpus: bool) -> list[tuple[int, int]]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` of each worker (rank order) placed on
    ``role_nodes``: as torchrun numbers them, the rank among the workers of its node and
    their number; ``(0, 1)`` for a worker given a GPU, which sees only that GPU (Ray sets
    its ``CUDA_VISIBLE_DEVICES``), so that it trains on it and the group is NCCL (NOTE
    [worker devices])."""
    if gpus:
        return [(0, 1)] * len(role_nodes)
    counts = {node: role_nodes.count(node) for node in role_nodes}
    return [(role_nodes[:rank].count(node), counts[node]) for rank, node in enumerate(role_nodes)]


def dense_env(
    rank: int,
    world_size: int,
    local: tuple[int, int],
    master: tuple[str, int] | None,
    threads: int,
    ifname: str | None,
) -> dict[str, str]:
    """The environment of worker ``rank`` (of ``world_size``) for its dense group, as
    torchrun sets it: ``MASTER_ADDR``/``MASTER_PORT`` (``master``: rank 0's node and a
    port free there, where torch's TCP store listens; None: neither, the job's ``dist_init``
    is the store, as on one node), ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (``local``), the intra-op threads
    (``OMP_NUM_THREADS``) and gloo's interface (``GLOO_SOCKET_IFNAME`` = ``ifname``: the
    node's, or loopback on one node; None: gloo's own choice)."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local[0]),
        "LOCAL_WORLD_SIZE": str(local[1]),
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
    if master is not None:
        env["MASTER_ADDR"], env["MASTER_PORT"] = master[0], str(master[1])
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def script_file(path: str, single: bool, folder: str) -> tuple[str, dict[str, bytes]]:
    """Where a worker finds ``--script``'s file (NOTE [own script] in herald/worker/script.py),
    and the role files that carry it: on one node the file itself (absolute), none; on
    several, a copy in the role's private folder (``folder``, the role's placeholder for it:
    ``folder/script/NAME``, the file alone,
    not its folder's other modules).

    Raises:
        ConfigError: the file cannot be read on this node.
    """
    source = os.path.abspath(path)
    if single:
        return source, {}
    name = f"script/{os.path.basename(source)}"
    try:
        data = pathlib.Path(source).read_bytes()
    except OSError as exc:
        raise ConfigError(f"--script {path}: cannot be read ({exc.strerror or exc}); check the path") from None
    return f"{folder}/{name}", {name: data}
