"""NOTE [transport security] and NOTE [ps admin ops] with the roles as real processes:
CURVE shards answer only key holders, open binds are refused, admin ops are confined,
a job with keys trains exactly as one without, and no process of a local job listens on
every interface."""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from proc_tree import children

from herald.auth import generate_keys
from herald.contracts.tables import OptimizerConfig, TableConfig
from herald.errors import PeerTimeout
from herald.ps import LocalShards, PSClient
from herald.ps.admin import AdminRefused
from tests.fakes import wait_until

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[2]
TABLES = [TableConfig("t", 4, OptimizerConfig("sgd", lr=0.1))]
KEYS = np.arange(100, dtype=np.uint64)
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
ENV.pop("GLOO_SOCKET_IFNAME", None)


@pytest.fixture
def keys(tmp_path) -> pathlib.Path:
    generate_keys(tmp_path / "keys")
    return tmp_path / "keys"


def _herald(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "herald", *args],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_curve_shards_answer_only_clients_holding_the_keys(tmp_path, keys):
    generate_keys(tmp_path / "other")
    with LocalShards(num_shards=2, tables=TABLES, seed=1, keys_dir=keys) as sh:
        with PSClient(sh.addresses, TABLES, timeout_ms=10_000, keys_dir=keys) as client:
            rows = client.pull("t", KEYS)
            assert rows.shape == (100, 4)
            alive = sh.watch(silent_ms=5_000)  # the liveness pings hold the keys too
            for _ in range(5):
                alive()
                time.sleep(0.1)

            def refused() -> list[int]:
                return [s["counters"].get("handshakes_refused", 0) for s in client.stats()]

            for wrong in (None, tmp_path / "other"):
                for settle in (False, True):  # True: the refused handshake has dropped the socket's only peer
                    before = refused()
                    with PSClient(
                        sh.addresses, TABLES, timeout_ms=600, retries=1, declare=False, keys_dir=wrong
                    ) as stranger:
                        if settle:  # both shards counted a refused handshake of this client
                            wait_until(
                                lambda: all(a > b for a, b in zip(refused(), before)),
                                30,
                                "both shards refusing the stranger's handshake",
                            )
                        start = time.monotonic()
                        with pytest.raises(PeerTimeout, match="hold its keys"):
                            stranger.pull("t", KEYS)  # a send with no peer to take it is bounded too
                        # generous: a send that blocked would never return; a loaded machine adds seconds
                        assert time.monotonic() - start < 30
            alive()
            counters = [s["counters"] for s in client.stats()]
            assert all(c["handshakes_refused"] >= 2 and c["handshakes_refused_protocol"] >= 2 for c in counters)
            assert np.array_equal(client.pull("t", KEYS), rows)  # nothing a stranger sent arrived


def test_an_open_bind_is_refused_without_keys_and_insecure_warns(tmp_path, keys):
    refused = _herald("serve", "ps", "--shard", "0", "--num-shards", "1", "--bind", "tcp://0.0.0.0:0")
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 1
    assert "not a loopback endpoint" in err and "herald keys generate DIR" in err and "--insecure" in err
    disp = _herald(
        "serve",
        "dispatcher",
        "--bind",
        "tcp://0.0.0.0:0",
        "--ps",
        "tcp://127.0.0.1:1",
        "--source",
        "synthetic://criteo?rows=1000000000",
    )  # refused before a row is read
    _, err = disp.communicate(timeout=120)
    assert disp.returncode == 1 and "dispatcher: tcp://0.0.0.0:0 is not a loopback" in err
    ready = tmp_path / "ready"
    shard = _herald(
        "serve",
        "ps",
        "--shard",
        "0",
        "--num-shards",
        "1",
        "--bind",
        "tcp://0.0.0.0:*",
        "--insecure",
        "--ready-file",
        str(ready),
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert shard.poll() is None and time.monotonic() < deadline, shard.communicate()[1]
            time.sleep(0.05)
    finally:
        shard.send_signal(signal.SIGTERM)
        _, err = shard.communicate(timeout=30)
    assert shard.returncode == 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--insecure" in warnings[0] and "neither authenticated nor encrypted" in warnings[0]
    with_keys = _herald(
        "serve",
        "ps",
        "--shard",
        "0",
        "--num-shards",
        "1",
        "--bind",
        "tcp://0.0.0.0:0",
        "--keys",
        str(tmp_path / "missing"),
    )
    _, err = with_keys.communicate(timeout=120)
    assert with_keys.returncode == 1 and "herald keys generate" in err


def test_admin_ops_need_the_token_and_stay_inside_the_checkpoint_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with LocalShards(num_shards=2, tables=TABLES, seed=1, transport="tcp", checkpoint_root=root) as sh:
        with (
            PSClient(sh.addresses, TABLES, timeout_ms=10_000, admin_token=sh.admin_token) as owner,
            PSClient(sh.addresses, TABLES, timeout_ms=10_000, admin_token="f" * 64) as wrong,
            PSClient(sh.addresses, TABLES, timeout_ms=10_000) as tokenless,
        ):
            before = owner.pull("t", KEYS)
            assert len(owner.checkpoint(str(root / "step-1"))) == 2
            for bad in (outside / "ckpt", root / ".." / "outside", root / "link" / "ckpt"):
                with pytest.raises(AdminRefused, match=f"checkpoint root {root.resolve()}"):
                    owner.checkpoint(str(bad))
                with pytest.raises(AdminRefused, match="not inside"):
                    owner.restore(str(bad))
            assert list(outside.iterdir()) == []  # nothing was written there
            with pytest.raises(AdminRefused, match="NUL byte"):  # refused like any bad path, not an internal error
                owner.checkpoint(str(root / "step\x00-2"))
            for client in (wrong, tokenless):
                for call in (
                    lambda c: c.checkpoint(str(root / "x")),
                    lambda c: c.restore(str(root / "step-1")),
                    lambda c: c.shutdown(),
                ):
                    with pytest.raises(AdminRefused, match="admin token"):
                        call(client)
            owner.push_grad("t", KEYS, np.ones((100, 4), np.float32), step=0, contributors=np.ones(100, np.uint16))
            owner.restore(str(root / "step-1"))
            assert np.array_equal(owner.pull("t", KEYS), before)
            counters = [s["counters"] for s in owner.stats()]
            assert sum(c["admin_refused_path"] for c in counters) == 2 * 7  # 3 paths x (checkpoint, restore), NUL
            assert sum(c.get("errors_internal", 0) for c in counters) == 0
            assert sum(c["admin_refused_token"] for c in counters) == 2 * 6  # 2 clients x 3 ops
            assert all(p.poll() is None for p in sh.procs)  # a refused shutdown stopped nothing
            owner.shutdown()
            assert [p.wait(timeout=30) for p in sh.procs] == [0, 0]


# ----------------------------------------------------------------- a whole job
def _address(hex_addr: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return ip.ipv4_mapped or ip


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` holds in LISTEN state."""
    inodes = set()
    try:
        for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    except OSError:  # the process ended
        return set()
    out = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = pathlib.Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:
                addr, port = local.split(":")
                out.add((str(_address(addr)), int(port, 16)))
    return out


def _train(run_dir: pathlib.Path, source: pathlib.Path, *extra: str) -> tuple[dict, dict]:
    """Run a 2-worker `herald train`; returns (its report, what its processes listened on and ran)."""
    job = _herald(
        "train",
        "--quiet",
        "--source",
        str(source),
        "--workers",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "25",
        "--embedding-dim",
        "4",
        "--model",
        "dlrm",
        "--cache-rows",
        "260",
        "--eval-fraction",
        "0.1",
        "--seed",
        "3",
        "--timeout-ms",
        "60000",
        "--run-dir",
        str(run_dir),
        *extra,
    )
    seen: dict = {"listen": {}, "commands": set()}
    while job.poll() is None:
        for pid, cmd in [(job.pid, "herald train")] + children(job.pid):
            role = "worker" if "serve worker" in cmd else "ps" if "serve ps" in cmd else "launcher"
            seen["commands"].add(cmd)
            seen["listen"].setdefault(role, set()).update(_listening(pid))
        time.sleep(0.05)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]
    return json.loads((run_dir / "report.json").read_text()), seen


@pytest.mark.slow  # ~41 s (2 shared cores)
def test_a_job_with_keys_trains_exactly_as_without_and_listens_on_loopback_only(tmp_path, keys, data_dir):
    source = data_dir / "criteo" / "criteo_kaggle_sample_train.tsv"
    plain, seen = _train(tmp_path / "plain", source)
    curve, seen_curve = _train(tmp_path / "curve", source, "--keys", str(keys))
    for listened in (seen, seen_curve):
        everywhere = {
            (a, p) for role in listened["listen"].values() for a, p in role if ipaddress.ip_address(a).is_unspecified
        }
        assert not everywhere, f"listening on every interface: {everywhere} ({listened['listen']})"
        assert listened["listen"].get("worker"), "no gloo listener seen: the check saw nothing"
        # NOTE [local job sockets]: the dispatcher and the PS shards bind ipc sockets in 0700 folders
        assert not listened["listen"].get("launcher") and not listened["listen"].get("ps"), listened["listen"]
        assert all(ipaddress.ip_address(a).is_loopback for role in listened["listen"].values() for a, _ in role)
    workers = [c for c in seen_curve["commands"] if "serve worker" in c]
    shards = [c for c in seen_curve["commands"] if "serve ps" in c]
    assert len(workers) == 2 and shards
    assert all(f"--keys {keys}" in c for c in workers + shards), workers + shards
    assert not any("--keys" in c for c in seen["commands"] if "serve" in c)
    assert curve["steps"] == plain["steps"] == 25
    assert curve["final_loss"] == plain["final_loss"]
    assert curve["metrics"] == plain["metrics"] and curve["metrics"]["eval_rows"] > 0  # held-out: PS rows read
    assert curve["progressive_validation"] == plain["progressive_validation"]
    assert curve["transmissions"] == plain["transmissions"]
    for rank in range(2):
        a = torch.load(tmp_path / "plain" / f"dense-rank{rank}.pt", weights_only=True)
        b = torch.load(tmp_path / "curve" / f"dense-rank{rank}.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank}'s dense model differs with keys"
    assert not list((tmp_path / "plain").glob(".dist-store-*"))  # the file store is removed
