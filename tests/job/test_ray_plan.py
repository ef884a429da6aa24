"""What a Ray job asks of its cluster and tells its roles (herald/job/ray/plan.py), the role
host of its actors run as a plain object (herald/job/ray/role.py), and the launcher's word
when Ray is missing: no Ray cluster needed (tests/integration/test_ray.py runs real ones)."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from herald.auth import generate_keys, load_client_keys, load_server_keys
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError
from herald.job.ray import cluster as ray_cluster
from herald.job.ray.plan import (
    KEYS,
    PS_BASE_BYTES,
    ROW_GROWTH,
    RoleRequest,
    check_transport,
    dense_env,
    fits,
    local_ranks,
    needed_cpus,
    ps_memory_bytes,
    role_requests,
    shard_selector,
    single_node,
    split_keys,
    wants_gpus,
    worker_cpus,
    worker_strategy,
)
from herald.job.ray.role import FOLDER, RoleHost, interface_of
from herald.ps.store import ROW_OVERHEAD_BYTES

TABLES = [TableConfig(name=f"t{i}", dim=4, optimizer=OptimizerConfig(name="adagrad", lr=0.1)) for i in range(3)]


def test_each_role_asks_for_its_cpus_gpu_and_memory():
    cfg = TrainConfig.from_flags(workers=3, ps_shards=2, launcher="ray")
    roles = role_requests(cfg, TABLES, distinct_keys=1000, gpus=True, env={"OMP_NUM_THREADS": "2"})
    assert [r.name for r in roles] == ["worker-0", "worker-1", "worker-2", "ps-shard-0", "ps-shard-1"]
    assert roles[0].bundle() == {"CPU": 2.0, "GPU": 1.0}
    shard = roles[3].bundle()
    assert shard["CPU"] == 1.0 and "GPU" not in shard and shard["memory"] == ps_memory_bytes(cfg, TABLES, 1000)
    assert roles[0].describe() == "2 CPU, 1 GPU" and roles[3].describe().startswith("1 CPU, 0.5 GiB")
    assert needed_cpus(cfg, {"OMP_NUM_THREADS": "2"}) == 3 * 2 + 2


def test_ps_memory_follows_the_row_bound_else_the_distinct_keys():
    row = 4 * TABLES[0].row_width + ROW_OVERHEAD_BYTES
    bounded = TrainConfig.from_flags(ps_max_rows=500, ps_shards=2, launcher="ray")
    assert ps_memory_bytes(bounded, TABLES, distinct_keys=10**9) == PS_BASE_BYTES + ROW_GROWTH * 500 * 3 * row
    shared = TrainConfig.from_flags(ps_shards=2, launcher="ray")
    assert ps_memory_bytes(shared, TABLES, distinct_keys=1001) == PS_BASE_BYTES + ROW_GROWTH * 501 * row
    assert ps_memory_bytes(shared, TABLES, distinct_keys=None) == PS_BASE_BYTES  # a stream: no pre-pass


def test_worker_threads_come_from_omp_num_threads():
    assert worker_cpus({}) == 1 and worker_cpus({"OMP_NUM_THREADS": "4"}) == 4
    for bad in ("0", "two", ""):
        with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
            worker_cpus({"OMP_NUM_THREADS": bad})


def test_gpus_for_cuda_and_for_auto_when_each_worker_can_have_one():
    assert wants_gpus("cuda", 0, 2) and not wants_gpus("cpu", 8, 2)
    assert wants_gpus("auto", 2, 2) and not wants_gpus("auto", 1, 2)


def test_workers_spread_one_per_node_when_nodes_allow_and_shards_keep_off_them():
    worker, shard = RoleRequest("worker-0", 2), RoleRequest("ps-shard-0", 1, 0, 1 << 30)
    nodes = {"a": {"CPU": 4.0, "memory": 8e9}, "b": {"CPU": 2.0, "memory": 8e9}, "c": {"CPU": 1.0, "memory": 2e9}}
    assert fits(worker, nodes["a"]) and not fits(worker, nodes["c"]) and fits(shard, nodes["c"])
    assert worker_strategy([worker] * 2, nodes) == "STRICT_SPREAD"
    assert worker_strategy([worker] * 3, nodes) == "SPREAD"  # c cannot hold a worker
    assert shard_selector(shard, nodes, ["b", "a"]) == {"ray.io/node-id": "!in(a,b)"}
    assert shard_selector(shard, {k: nodes[k] for k in "ab"}, ["a", "b"]) is None  # no other node: beside them
    assert shard_selector(shard, {**nodes, "c": {"CPU": 1.0, "memory": 1e8}}, ["a", "b"]) is None  # c too small


def test_several_nodes_need_keys_or_insecure():
    check_transport(True, None, False, 1)
    check_transport(False, "keys", False, 2)
    check_transport(False, None, True, 2)
    with pytest.raises(ConfigError, match=r"over 3 nodes.*herald keys generate DIR.*--insecure"):
        check_transport(False, None, False, 3)
    assert single_node(["n1", "n1"], "n1") and not single_node(["n1", "n2"], "n1")


def test_each_role_gets_only_its_half_of_the_keys(tmp_path):
    generate_keys(tmp_path / "keys")
    server, client = split_keys(tmp_path / "keys")
    assert set(server) == {f"{KEYS}/server.key", f"{KEYS}/server.key_secret", f"{KEYS}/clients/client.key"}
    assert set(client) == {f"{KEYS}/server.key", f"{KEYS}/client.key_secret"}
    for name, files in (("ps", server), ("worker", client)):  # what a role writes on its node loads as keys
        for rel, data in files.items():
            path = tmp_path / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o600)
    load_server_keys(tmp_path / "ps" / KEYS)
    load_client_keys(tmp_path / "worker" / KEYS)
    with pytest.raises(ConfigError, match="cannot read"):
        split_keys(tmp_path / "missing")


def test_local_ranks_as_torchrun_numbers_them_and_a_gpu_worker_sees_its_gpu():
    assert local_ranks(["a", "b", "a", "b", "a"], gpus=False) == [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
    assert local_ranks(["a", "a"], gpus=True) == [(0, 1), (0, 1)]
    env = dense_env(1, 2, (0, 1), ("10.0.0.5", 29500), 2, "eth0")
    assert env == {
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29500",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "2",
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    assert "GLOO_SOCKET_IFNAME" not in dense_env(0, 2, (0, 2), ("10.0.0.5", 1), 1, None)
    one_node = dense_env(0, 2, (0, 2), None, 1, "lo")  # the job's FileStore: no TCP store to name
    assert "MASTER_ADDR" not in one_node and "MASTER_PORT" not in one_node and one_node["RANK"] == "0"


def test_role_host_runs_its_child_in_a_private_folder_and_cleans_up(tmp_path):
    host = RoleHost("ps-shard-0", str(tmp_path))
    assert host.poll() is None and host.read("ready") is None and host.stop() is None  # nothing started yet
    script = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('tcp://10.0.0.1:5555'); print('up')"
    out = host.start(["-c", script, f"{FOLDER}/ready"], {"X": "1"}, {"keys/server.key_secret": b"s"}, "herald-ps-")
    folder = out["folder"]
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(f"{folder}/keys/server.key_secret").st_mode) == 0o600
    host.children.procs["ps-shard-0"].wait(30)
    assert host.read("ready") == "tcp://10.0.0.1:5555" and host.poll() == 0
    assert host.exit_status() == "exited with code 0" and host.failure() is None
    assert (tmp_path / "ps-shard-0.log").read_text().strip() == "up"
    host.stop()
    assert not os.path.exists(folder)

    failing = RoleHost("worker-1", str(tmp_path))
    failing.start(["-c", "import sys; print('boom'); sys.exit(3)"], {}, {}, "herald-worker-")
    failing.children.procs["worker-1"].wait(30)
    assert "worker-1 exited with code 3" in failing.failure() and "boom" in failing.failure()
    failing.stop()


def test_role_host_checks_the_run_folder_token(tmp_path):
    host = RoleHost("worker-0", str(tmp_path))
    assert "cannot read" in host.check_run_folder("abc")
    (tmp_path / ".ray-run-check").write_text("abc\n")
    assert host.check_run_folder("abc") is None and "another job" in host.check_run_folder("xyz")
    assert 0 < host.free_port() < 65536


def test_the_loopback_address_is_on_the_loopback_interface():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None


def test_a_missing_ray_is_named_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"--launcher ray needs Ray .*pip install 'herald\[ray\]'"):
        ray_cluster._ray()
