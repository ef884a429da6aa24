"""The Ray side of a ``herald train --launcher ray`` job (NOTE [ray job] in
herald/job/ray/parts.py): :class:`RayCluster` connects to Ray (or starts a local
instance), places the job's roles with two placement groups, starts one
:class:`~herald.job.ray.role.RoleHost` actor per role, calls them, and takes all of it
down at the end of the job. :class:`herald.job.ray.parts.RayPS` and
:class:`~herald.job.ray.parts.RayWorkers` share one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from herald.contracts.train import TrainConfig
from herald.errors import ConfigError, HeraldError
from herald.files import write_private
from herald.job.ray.plan import (
    RoleRequest,
    check_transport,
    needed_cpus,
    role_requests,
    shard_selector,
    single_node,
    wants_gpus,
    worker_strategy,
)
from herald.job.ray.role import RUN_CHECK_FILE, RoleHost
from herald.job.recovery import leftovers

#: Object store of the local Ray instance (bytes): the job passes only small arguments.
LOCAL_OBJECT_STORE_BYTES = 256 << 20
#: Longest wait for one answer of a role's actor during the job (s); longer: it is lost.
ACTOR_CALL_S = 10.0


def _ray() -> Any:
    """The ``ray`` module. Imported on use: it is an optional dependency, and its import
    (0.8 s here) would otherwise delay every local job's start.

    Raises:
        ConfigError: Ray is not installed (names the fix).
    """
    try:
        import ray
        import ray.util.scheduling_strategies  # noqa: F401  (PlacementGroupSchedulingStrategy)
    except ImportError as exc:
        raise ConfigError(
            f"--launcher ray needs Ray ({exc}): pip install 'herald[ray]' (or `make ray`), on this "
            "host and in every node's image"
        ) from None
    return ray


def _reset_token_cache() -> None:
    """Make this process's Ray read its authentication settings again (Ray caches its token)."""
    # Ray: an optional dependency whose import takes 0.8 s (see _ray(), which loaded it already)
    from ray._private.authentication.authentication_token_setup import Config
    from ray._raylet import AuthenticationTokenLoader

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _token_auth(stack: contextlib.ExitStack) -> None:
    """Ray's token authentication for the instance this job starts, with a fresh token of
    its own (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN`` in this process's environment,
    which Ray's services inherit; put back with ``stack``), unless the caller set
    ``RAY_AUTH_MODE``: no process of the host but the job's own reaches Ray's loopback ports
    without it (docs/cluster.md, "Security")."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"] = "token", secrets.token_hex(32)
    _reset_token_cache()

    def restore() -> None:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reset_token_cache()

    stack.callback(restore)


#: Ray's switch (ray/_private/ray_constants.py) that, off, keeps a local node on the address it
#: is given: on (Ray's default on Linux) ``_node_ip_address="127.0.0.1"`` is replaced by the
#: host's outward address, on which every service then listens.
_RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """While a local instance starts: Ray keeps its node on loopback, so each of its services
    (GCS, raylet, object manager, core workers, agents) listens on loopback only (they bind
    the node's address when it is loopback, every interface otherwise). Ray's switch is set
    in the environment its services inherit and in this process's Ray (which read it at
    import), both put back after."""
    # Ray: an optional dependency whose import takes 0.8 s (see _ray(), which loaded it already)
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_RAY_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_CLUSTER_SWITCH], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_RAY_CLUSTER_SWITCH, None)
        else:
            os.environ[_RAY_CLUSTER_SWITCH] = saved_env


class CallFailed(str):
    """What a call to a role's actor gave instead of its answer, the reason in words: the
    actor died (with its node, perhaps), answered nothing within :data:`ACTOR_CALL_S`, or
    the call raised in it."""


class RayCluster:
    """The Ray side of one job attempt, shared by :class:`RayPS` (which opens it) and
    :class:`RayWorkers`: the connection, the placement groups and one
    :class:`~herald.job.ray.role.RoleHost` actor per role (NOTE [ray job]).

    Attributes (once opened): requests: the roles (:class:`~herald.job.ray.plan.RoleRequest`,
    workers first); actors; nodes: each role's ``{"node_id", "ip", "hostname", "pid",
    "ifname"}``; single: every role on this process's node; gpus: each worker has a GPU;
    driver_ip: this node's address.
    """

    def __init__(self) -> None:
        self.actors: list[Any] = []
        self.folders: dict[int, str] = {}  # role -> its private folder on its node (RoleHost.start)

    def open(self, cfg: TrainConfig, data: Any, stack: contextlib.ExitStack) -> None:
        """Connect to Ray, place the job's roles and start their actors (cleanups on
        ``stack``); ``data``: the job's data (its ``schema`` and ``distinct_keys`` size the
        PS shards' memory).

        Raises:
            ConfigError: Ray missing, a setting the cluster cannot serve (GPUs, keys, a
                run folder the nodes do not share); HeraldError: the cluster cannot hold
                the job in time, or cannot be reached.
        """
        ray = self.ray = _ray()
        self.cfg, self.run_dir = cfg, pathlib.Path(cfg.run_dir).resolve()
        self.startup_s = max(60.0, cfg.timeout_ms / 1000)
        ours = self._connect(ray, cfg, stack)
        self.gpus = self._gpus(ray, cfg, ours)
        self.requests = role_requests(cfg, cfg.tables(data.schema), getattr(data, "distinct_keys", None), self.gpus)
        groups, node_ids = self._place(ray, stack)
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        self.driver_ip = ray.util.get_node_ip_address()
        self.single = single_node(node_ids, ray.get_runtime_context().get_node_id())
        check_transport(self.single, cfg.security.keys_dir, cfg.security.insecure, len(set(node_ids)))
        stack.callback(self._kill_actors)
        self.actors = self._actors(ray, groups)
        self._check_nodes(node_ids, ips, stack)
        self._say_where(len(set(node_ids)))

    @staticmethod
    def _gpus(ray: Any, cfg: TrainConfig, ours: bool) -> bool:
        """Whether each worker asks Ray for a GPU (:func:`~herald.job.ray.plan.wants_gpus`).

        Raises:
            ConfigError: a local instance (``ours``) with fewer GPUs than workers that want one.
        """
        gpus_there = float(ray.cluster_resources().get("GPU", 0))
        gpus = wants_gpus(cfg.device, gpus_there, cfg.workers)
        if gpus and ours and gpus_there < cfg.workers:
            raise ConfigError(
                f"--device {cfg.device}: each of the {cfg.workers} workers asks Ray for a GPU of its own "
                f"and this host has {gpus_there:g}: use fewer --workers, --device cpu, or --ray-address "
                "a cluster with more GPUs"
            )
        return gpus

    def _actors(self, ray: Any, groups: list[Any]) -> list[Any]:
        """One :class:`~herald.job.ray.role.RoleHost` actor per role, in its bundle: the workers'
        placement group (``groups[0]``) then the shards' (``groups[1]``)."""
        cfg = self.cfg
        host = ray.remote(RoleHost)
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        bundles = [(groups[0], r) for r in range(cfg.workers)] + [(groups[1], i) for i in range(cfg.num_ps_shards)]
        return [
            host.options(
                num_cpus=r.cpus,
                num_gpus=r.gpus,
                memory=r.memory_bytes or None,
                scheduling_strategy=strategy(pg, placement_group_bundle_index=b),
                max_restarts=0,
            ).remote(r.name, str(self.run_dir))
            for r, (pg, b) in zip(self.requests, bundles)
        ]

    def _say_where(self, nodes: int) -> None:
        """One line on stderr: each role's node and resources, and the transport."""
        where = ", ".join(
            f"{r.name} on {n['ip']} (node {n['node_id'][:8]}, {r.describe()})"
            for r, n in zip(self.requests, self.nodes)
        )
        how = (
            "ipc sockets (one node)"
            if self.single
            else f"TCP on the nodes' addresses, {'CURVE keys' if self.cfg.security.keys_dir else '--insecure: no keys'}"
        )
        print(
            f"herald train: ray: {len(self.requests)} roles on {nodes} node(s): {where}; {how}",
            file=sys.stderr,
            flush=True,
        )

    def _connect(self, ray: Any, cfg: TrainConfig, stack: contextlib.ExitStack) -> bool:
        """Connect this process to Ray (NOTE [ray job]); True when it started a local
        instance (stopped with ``stack``)."""
        if ray.is_initialized():
            if cfg.launcher.ray_address:
                raise ConfigError(
                    f"--ray-address {cfg.launcher.ray_address}: this process is already connected to Ray; "
                    "leave ray_address out to run on that connection"
                )
            return False
        address = cfg.launcher.ray_address or os.environ.get("RAY_ADDRESS") or None
        if address is not None and address.startswith("ray://"):  # from RAY_ADDRESS: TrainConfig checked the flag
            raise ConfigError(
                f"RAY_ADDRESS={address}: Ray Client (ray://) runs this process off the cluster, and "
                "the workers must reach its dispatcher: run herald train on a node of the cluster "
                "(docs/cluster.md)"
            )
        options: dict[str, Any] = dict(namespace="herald", log_to_driver=False, logging_level=logging.WARNING)
        if address is None:  # a new instance for this job ("local": even beside a cluster of `ray start`)
            options.update(
                num_cpus=max(os.cpu_count() or 1, needed_cpus(cfg)),
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                _node_ip_address="127.0.0.1",
            )
            _token_auth(stack)
        try:
            with _loopback_node() if address is None else contextlib.nullcontext():
                ray.init(address=address or "local", **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise HeraldError(
                f"cannot {'connect to the Ray cluster at ' + address if address else 'start Ray'}: {exc}"
            ) from None
        stack.callback(ray.shutdown)  # a cluster's connection closed; a local instance stopped
        return address is None

    def _place(self, ray: Any, stack: contextlib.ExitStack) -> tuple[list[Any], list[str]]:
        """Place the roles (NOTE [ray job]): the workers' placement group first (spread over
        the nodes), then the shards' (on nodes without a worker where one can hold them),
        each ready within the start-up wait, removed with ``stack``. Returns the groups and
        each role's node id.

        Raises:
            HeraldError: not placed in time (names what the job asks and what the cluster has).
        """
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        workers, shards = self.requests[: self.cfg.workers], self.requests[self.cfg.workers :]
        deadline = time.monotonic() + self.startup_s
        worker_pg = self._group(ray, stack, workers, worker_strategy(workers, nodes), None, deadline)
        worker_nodes = self._nodes_of(ray, worker_pg, len(workers))
        selector = shard_selector(shards[0], nodes, worker_nodes)
        shard_pg = self._group(ray, stack, shards, "SPREAD", selector, deadline)
        return [worker_pg, shard_pg], worker_nodes + self._nodes_of(ray, shard_pg, len(shards))

    def _group(
        self,
        ray: Any,
        stack: contextlib.ExitStack,
        requests: list[RoleRequest],
        strategy: str,
        selector: dict[str, str] | None,
        deadline: float,
    ) -> Any:
        """A placement group of ``requests`` (``selector``: every bundle's label selector),
        ready by ``deadline``, removed with ``stack``."""
        pg = ray.util.placement_group(
            [r.bundle() for r in requests],
            strategy=strategy,
            bundle_label_selector=[selector] * len(requests) if selector else None,
        )
        stack.callback(self._remove, pg)
        try:
            ray.get(pg.ready(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            asked = "; ".join(f"{r.name}: {r.describe()}" for r in self.requests)
            have = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "memory")}
            raise HeraldError(
                f"Ray could not place the job's {len(self.requests)} roles within {self.startup_s:.0f} s "
                f"({asked}; {strategy}); the cluster has {have} available: add nodes, or lower "
                "--workers / --ps-shards (a worker asks OMP_NUM_THREADS CPUs)"
            ) from None
        return pg

    @staticmethod
    def _nodes_of(ray: Any, pg: Any, n: int) -> list[str]:
        placed = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        return [placed[i] for i in range(n)]

    def _remove(self, pg: Any) -> None:
        with contextlib.suppress(Exception):  # the connection may be gone already: so is the group
            self.ray.util.remove_placement_group(pg)

    def _check_nodes(self, node_ids: list[str], ips: dict[str, str], stack: contextlib.ExitStack) -> None:
        """Every actor up (bounded), where it runs (:attr:`nodes`), and the run folder the same on its node.

        Raises:
            ConfigError: a node sees another run folder (names the node and ``--storage-path``).
        """
        token = secrets.token_hex(16)
        check = self.run_dir / RUN_CHECK_FILE
        write_private(check, token, "run folder check", sync=False)
        stack.callback(check.unlink, missing_ok=True)
        ip_of = [ips.get(n, "?") for n in node_ids]
        answers = self.call(range(len(self.actors)), "node", args_of=lambda i: (ip_of[i],), timeout_s=self.startup_s)
        for i, answer in enumerate(answers):
            if isinstance(answer, CallFailed):
                raise HeraldError(f"the Ray actor of {self.requests[i].name} on {ip_of[i]} did not start: {answer}")
        self.nodes = [{"node_id": n, "ip": ip, **a} for n, ip, a in zip(node_ids, ip_of, answers)]
        for i, why in enumerate(self.call(range(len(self.actors)), "check_run_folder", token)):
            if why is not None:
                raise ConfigError(
                    f"the run folder {self.run_dir} is not the same folder on node {ip_of[i]} (where "
                    f"{self.requests[i].name} runs): {why}. Every node of a Ray job writes there (PS "
                    "checkpoints, dense replicas, logs): give --storage-path a folder every node mounts "
                    "at the same path (docs/cluster.md)"
                )

    # ------------------------------------------------------------------ calls to the roles
    def call(
        self,
        roles: Sequence[int],
        method: str,
        *args: Any,
        args_of: Callable[[int], tuple] | None = None,
        timeout_s: float = ACTOR_CALL_S,
    ) -> list[Any]:
        """``method(*args)`` (or ``method(*args_of(i))``) on the actor of each role in
        ``roles``, at once; the answers in that order, a :class:`CallFailed` for an actor
        that died, did not answer within ``timeout_s`` in all, or raised."""
        ray = self.ray
        refs = [getattr(self.actors[i], method).remote(*(args_of(i) if args_of else args)) for i in roles]
        deadline, out = time.monotonic() + timeout_s, []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                out.append(CallFailed(f"its Ray actor answered nothing within {timeout_s:.0f} s"))
            except ray.exceptions.RayTaskError as exc:  # the call raised in the actor: its error
                cause = exc.cause if exc.cause is not None else exc
                out.append(CallFailed(f"{type(cause).__name__}: {cause}"))
            except ray.exceptions.RayError as exc:  # the actor died (its node too, perhaps)
                out.append(CallFailed(f"its Ray actor died ({str(exc).strip().splitlines()[0]})"))
        return out

    def start(
        self, roles: Sequence[int], spec: Callable[[int], tuple[list[str], dict[str, str], dict[str, bytes], str]]
    ) -> list[dict]:
        """Start each role of ``roles`` as ``spec(i) = (args, env, files, folder prefix)``
        (:meth:`herald.job.ray.role.RoleHost.start`); returns each ``{"pid", "folder"}``.

        Raises:
            HeraldError: an actor was lost, or refused (its error).
        """
        answers = self.call(roles, "start", args_of=spec)
        for i, answer in zip(roles, answers):
            if isinstance(answer, CallFailed):
                raise HeraldError(f"{self.requests[i].name} on {self.nodes[i]['ip']} could not start: {answer}")
            self.folders[i] = answer["folder"]
            if self.single:  # NOTE [run leftovers]: on this host, removed by the next job if this one is killed
                leftovers.record(self.run_dir, answer["folder"])
        return answers

    def describe(self, i: int) -> str:
        """Role ``i``'s node and actor, in words."""
        node = self.nodes[i]
        return f"Ray actor pid {node['pid']} on {node['ip']} ({node['hostname']})"

    def log_tail(self, i: int, lines: int = 15) -> str:
        """The end of role ``i``'s log (the run folder is the same on every node)."""
        path = self.run_dir / f"{self.requests[i].name}.log"
        try:
            return f"last lines of {path}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"its log {path} cannot be read ({exc.strerror or exc})"

    def ended(self, roles: Sequence[int]) -> dict[int, str]:
        """How each role of ``roles`` whose child ended on its own ended (``"exited with code
        1"``, ``"was killed by signal 9"``, exit code 0 included), or why its actor could not say
        (a :class:`CallFailed`)."""
        return {i: a for i, a in zip(roles, self.call(roles, "exit_status")) if a is not None}

    def stop(self, roles: Sequence[int]) -> None:
        """Stop the children of ``roles`` (SIGTERM, SIGKILL after 5 s; bounded). On one node the
        private folder of a role whose actor died (``kill -9``, the OOM killer: its
        :meth:`~herald.job.ray.role.RoleHost.stop` never ran) is removed from here."""
        if not self.actors:
            return
        roles = list(roles)
        for i, answer in zip(roles, self.call(roles, "stop", 5.0, timeout_s=15.0)):
            folder = self.folders.pop(i, None)
            if folder is None or not self.single:
                continue
            if isinstance(answer, CallFailed):  # its actor died before it could: remove the folder here
                shutil.rmtree(folder, ignore_errors=True)
            leftovers.forget(self.run_dir, folder)

    def _kill_actors(self) -> None:
        """The end of the job: every child stopped, every actor killed (bounded)."""
        self.stop(range(len(self.actors)))
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead: its children died with it
                self.ray.kill(actor)
        self.actors = []
