"""``herald train --launcher ray`` on real Ray clusters (NOTE [ray job] in herald/job/ray/parts.py).

- Two Ray nodes (``ray.cluster_utils.Cluster``, 2 logical CPUs each, on this machine):
  the workers are spread over both, every role binds TCP on its node's address with
  CURVE keys that reached it through Ray, and the 2-worker job equals the
  single-process reference with test_train_exact.py's tolerances (Herald §3.3).
  Without keys the same placement is refused before any role starts; with --insecure it
  runs on plain TCP (the dispatcher warns).
- No address: a local Ray instance is started for the job (ipc sockets, one node) and
  stopped after it.

After each job no actor of it is alive, no placement group is left and no ``herald
serve`` process it started remains. Ray is an optional dependency (``herald[ray]``,
installed by ``make test``): under ``CI=true`` its absence fails these tests, elsewhere
it skips them with the reason.
"""

from __future__ import annotations

import ipaddress
import os
import re
import threading

import numpy as np
import pytest
from proc_tree import children, descendants
from test_train_exact import BATCH, LR, STEPS, _reference, assert_matches_reference

from herald.auth import generate_keys
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job.launcher import run_train
from herald.ps import PSClient

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_nodes(ray):
    """A Ray cluster of two nodes on this machine (2 logical CPUs each, no dashboard); its address."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": 100 << 20},
    )
    try:
        cluster.add_node(num_cpus=2, object_store_memory=100 << 20)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def _serving() -> set[int]:
    """Pids of the live ``python -m herald serve ...`` processes below this one (a Ray
    cluster of a test is this process's child, its actors the cluster's, their roles theirs)."""
    out, parents = set(), {os.getpid()}
    while parents:
        found = {pid: cmd for parent in parents for pid, cmd in children(parent)}
        out |= {pid for pid, cmd in found.items() if "-m herald serve" in cmd}
        parents = set(found)
    return out


def _ray_services() -> set[int]:
    """Pids of the Ray services (``raylet``, ``gcs_server``) this process started."""
    return {pid for pid, cmd in children(os.getpid()) if "raylet" in cmd or "gcs_server" in cmd}


def _left_on(ray, address: str) -> tuple[list, list]:
    """The actors still alive and the placement groups not removed on the cluster at ``address``."""
    from ray._private import state  # the GCS's own tables: ray.util.state needs the dashboard

    ray.init(address=address, log_to_driver=False)
    try:
        actors = [a for a in state.actors().values() if a["State"] != "DEAD"]
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    finally:
        ray.shutdown()
    return actors, groups


def _config(tmp_path, source, **overrides) -> TrainConfig:
    settings = dict(
        source=source,
        schedule="herald",
        workers=2,
        batch_size=BATCH,
        cache_rows=260,
        embedding_dim=4,
        optimizer="adagrad",
        lr=LR["adagrad"],
        dense_optimizer="sgd",
        dense_lr=0.05,
        model="dlrm",
        steps=STEPS,
        eval_fraction=0.0,
        seed=3,
        run_dir=str(tmp_path / "run"),
        timeout_ms=60_000,
        launcher="ray",
        ps_shards=1,
    )
    return TrainConfig.from_flags(**{**settings, **overrides})


def _grab(seen: dict, source: str, workers: int, keys_dir: str | None):
    """``on_finish``: the trained PS rows against the single-process reference (into
    ``seen``, for :func:`assert_matches_reference`) and the shards' addresses."""

    def grab(addresses, job):
        seen["addresses"] = list(addresses)
        seen["ref_model"], ref_rows = _reference(job, source, workers * BATCH)
        by_table: dict[int, list[int]] = {}
        for t, k in ref_rows:
            by_table.setdefault(t, []).append(k)
        with PSClient(addresses, tables=list(job.tables), timeout_ms=10_000, keys_dir=keys_dir) as client:
            got = client.pull_async({t: np.array(ks, np.uint64) for t, ks in by_table.items()}).wait()
        dim = job.tables[0].dim
        pairs = [(got[t][i], ref_rows[(t, k)]) for t, ks in by_table.items() for i, k in enumerate(ks)]
        seen["diff"] = max(float(np.abs(a[:dim] - b[:dim]).max()) for a, b in pairs)
        seen["state_rel"] = max(
            float((np.abs(a[dim:] - b[dim:]) / np.maximum(1.0, np.abs(b[dim:]))).max()) for a, b in pairs
        )

    return grab


@pytest.mark.slow  # ~30 s on 2 cores: two Ray nodes, 3 actors, the reference
def test_two_node_job_equals_single_process(ray, two_nodes, tmp_path, data_dir, capfd):
    source = str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv")
    keys = tmp_path / "keys"
    generate_keys(keys)
    cfg = _config(tmp_path, source, ray_address=two_nodes, keys_dir=str(keys))
    before, seen = _serving(), {}
    rep = run_train(cfg, progress=False, on_finish=_grab(seen, source, cfg.workers, str(keys)))
    placed = next(line for line in capfd.readouterr().err.splitlines() if line.startswith("herald train: ray:"))

    assert "2 node(s)" in placed and "CURVE keys" in placed, placed
    worker_nodes = set(re.findall(r"worker-\d+ on \S+ \(node (\w+)", placed))
    assert len(worker_nodes) == 2, f"the workers were not spread over the 2 nodes: {placed}"
    assert all(a.startswith("tcp://") and not a.startswith("tcp://127.") for a in seen["addresses"]), seen
    assert rep["steps"] == STEPS
    assert rep["transmissions"]["evict_push"] + rep["transmissions"]["update_pull"] > 0, "no cache pressure"
    assert_matches_reference(seen, tmp_path / "run", cfg.workers)
    assert f"trained {STEPS} steps" in (tmp_path / "run" / "worker-1.log").read_text(), (
        "no worker log in the run folder"
    )
    assert not list((tmp_path / "run").glob(".ray-run-check")), "the run folder check outlived the job"

    assert not (_serving() - before), "a herald serve process of the job outlived it"
    actors, groups = _left_on(ray, two_nodes)
    assert not actors, f"actors outlived the job: {actors}"
    assert not groups, f"placement groups outlived the job: {groups}"


def test_several_nodes_without_keys_are_refused(ray, two_nodes, tmp_path, data_dir):
    source = str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv")
    before = _serving()
    with pytest.raises(ConfigError, match=r"over 2 nodes.*--keys DIR.*--insecure"):
        run_train(_config(tmp_path, source, ray_address=two_nodes, steps=2), progress=False)
    assert not (_serving() - before), "a role started before the refusal"
    actors, groups = _left_on(ray, two_nodes)
    assert not actors and not groups, (actors, groups)


@pytest.mark.slow  # ~10 s on 2 cores
def test_several_nodes_with_insecure_run_on_plain_tcp(ray, two_nodes, tmp_path, data_dir, capfd):
    source = str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv")
    rep = run_train(_config(tmp_path, source, ray_address=two_nodes, insecure=True, steps=5), progress=False)
    assert rep["steps"] == 5
    err = capfd.readouterr().err
    assert "--insecure: no keys" in err and "is not loopback and its traffic is neither" in err, err[-2000:]
    actors, groups = _left_on(ray, two_nodes)
    assert not actors and not groups, (actors, groups)


def _listening(pids) -> dict[int, list[str]]:
    """The TCP addresses each of ``pids`` listens on (``"HOST:PORT"``)."""
    import psutil

    out: dict[int, list[str]] = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections("inet")
        except psutil.Error:
            continue
        out[pid] = [f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _loopback(address: str) -> bool:
    """Whether ``"HOST:PORT"`` is a loopback address (``127.x``, ``::1``, or IPv4's loopback
    mapped into IPv6, ``::ffff:127.0.0.1``, as an IPv6 socket bound to it shows)."""
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _short(command: str) -> str:
    """A process's command line kept short for a message: its program's base name (whatever
    folder the checkout lies in) and the start of its arguments."""
    program, _, rest = command.partition(" ")
    return f"{os.path.basename(program)} {rest}"[:80]


def _auth_mode(pid: int) -> str | None:
    import psutil

    try:
        return psutil.Process(pid).environ().get("RAY_AUTH_MODE")
    except psutil.Error:
        return None


@pytest.mark.slow  # ~15 s on 2 cores: a Ray instance started and stopped
def test_local_ray_instance_is_started_and_stopped(ray, tmp_path, data_dir):
    """... and the job's roles listen on no address but loopback (the dense group's store is a
    file; gloo binds loopback), nor does any process of the Ray instance (GCS, raylet, core
    workers, agents, this process's core worker), and the instance runs with Ray's token
    authentication."""
    source = str(data_dir / "criteo" / "criteo_kaggle_sample_train.tsv")
    seen: dict = {}
    before = _ray_services()
    serving_before = _serving()
    tree_before = {pid for pid, _ in descendants(os.getpid())}
    own_before = set(_listening([os.getpid()]).get(os.getpid(), []))

    def on_finish(addresses, job):
        seen.update(addresses=list(addresses), dist_init=job.dist_init)
        seen["auth"] = {pid: _auth_mode(pid) for pid in _ray_services() - before}

    listening: dict[int, set[str]] = {}
    instance: dict[tuple[int, str], set[str]] = {}  # (pid, command) -> its listening addresses
    done = threading.Event()

    def watch():  # every process's listening sockets while the job runs (the workers end before on_finish)
        while not done.wait(0.1):
            for pid, addresses in _listening(_serving() - serving_before).items():
                listening.setdefault(pid, set()).update(addresses)
            tree = {pid: cmd for pid, cmd in descendants(os.getpid()) if pid not in tree_before}
            for pid, addresses in _listening([*tree, os.getpid()]).items():
                ours = set(addresses) - own_before if pid == os.getpid() else set(addresses)
                instance.setdefault((pid, _short(tree.get(pid, "herald train"))), set()).update(ours)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rep = run_train(_config(tmp_path, source, steps=10), progress=False, on_finish=on_finish)
    finally:
        done.set()
        watcher.join(10)
    seen["listening"] = listening
    assert len(listening) == 3, seen  # the shard and both workers
    wide = {pid: a for pid, a in seen["listening"].items() if not all(map(_loopback, a))}
    assert not wide, f"a role of the job listens beyond loopback: {wide}"
    services = {who: a for who, a in instance.items() if a}
    assert any("gcs_server" in cmd for _, cmd in services) and any("raylet" in cmd for _, cmd in services), services
    wide = {who: a for who, a in services.items() if not all(map(_loopback, a))}
    assert not wide, f"a process of the job's Ray instance listens beyond loopback: {wide}"
    assert seen["dist_init"].startswith("file://"), seen["dist_init"]
    assert seen["auth"] and set(seen["auth"].values()) == {"token"}, seen["auth"]
    assert "RAY_AUTH_TOKEN" not in os.environ or os.environ.get("RAY_AUTH_MODE"), "the job's token outlived it"
    assert rep["steps"] == 10
    assert all(a.startswith("ipc://") for a in seen["addresses"]), "one node: ipc sockets (NOTE [local job sockets])"
    assert set(rep["startup"]) >= {"ps_ready", "workers_ready", "first_step"}
    assert not ray.is_initialized(), "the job's Ray connection outlived it"
    assert not (_ray_services() - before), f"the job's Ray instance outlived it: {_ray_services() - before}"
