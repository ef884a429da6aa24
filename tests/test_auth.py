"""NOTE [transport security] (herald/auth.py) and NOTE [ps admin ops] (herald/ps/admin.py)
as pure functions and in-process sockets; the roles as real processes are in
tests/integration/test_security.py."""

from __future__ import annotations

import collections
import os
import stat

import pytest
import zmq

from herald import auth
from herald.cli import main
from herald.errors import ConfigError
from herald.ps.admin import TOKEN_ENV, AdminGate, AdminRefused, load_token

TOKEN = "0123456789abcdef" * 2


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_generate_writes_private_key_pairs_and_refuses_to_overwrite(tmp_path):
    keys = tmp_path / "keys"
    written = auth.generate_keys(keys)
    assert [p.relative_to(keys).as_posix() for p in written] == list(auth.KEY_FILES)
    assert _mode(keys) == 0o700 and _mode(keys / "clients") == 0o700
    assert all(_mode(p) == 0o600 for p in written)
    assert sorted(p.name for p in keys.iterdir()) == [
        "client.key_secret",
        "clients",
        "server.key",
        "server.key_secret",
    ]  # no temporary folder left
    server, client = auth.load_server_keys(keys), auth.load_client_keys(keys)
    assert client.server_public == server.public and client.public != server.public
    with pytest.raises(ConfigError, match="refusing to overwrite.*--force"):
        auth.generate_keys(keys)
    assert auth.load_server_keys(keys) == server  # untouched
    auth.generate_keys(keys, force=True)
    assert auth.load_server_keys(keys).public != server.public


def test_keys_generate_command(tmp_path, capsys):
    keys = tmp_path / "k"
    assert main(["keys", "generate", str(keys)]) == 0
    assert f"--keys {keys}" in capsys.readouterr().out
    assert main(["keys", "generate", str(keys)]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["keys", "generate", str(keys), "--force"]) == 0


def test_missing_or_exposed_keys_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="herald keys generate"):
        auth.load_client_keys(tmp_path)
    keys = tmp_path / "keys"
    auth.generate_keys(keys)
    os.chmod(keys / "client.key_secret", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        auth.load_client_keys(keys)
    for p in (keys / "clients").iterdir():
        p.unlink()
    with pytest.raises(ConfigError, match="no authorised client keys"):
        auth.load_server_keys(keys)


@pytest.mark.parametrize(
    "endpoint,loopback",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.2:*", True),
        ("tcp://localhost:1", True),
        ("tcp://[::1]:5", True),
        ("tcp://lo:5", True),
        ("ipc:///tmp/x.ipc", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:0", False),
        ("tcp://*:5555", False),
        ("tcp://[::]:5", False),
        ("tcp://10.1.2.3:5", False),
        ("tcp://eth0:5", False),
        ("tcp://host.example:5", False),
        ("ws://127.0.0.1:5", False),
    ],
)
def test_is_loopback(endpoint, loopback):
    assert auth.is_loopback(endpoint) is loopback


def test_check_bind_policy(tmp_path, capsys):
    assert auth.check_bind("tcp://127.0.0.1:0", None, False, "ps shard 0") is False  # loopback: no keys needed
    with pytest.raises(ConfigError) as info:
        auth.check_bind("tcp://0.0.0.0:0", None, False, "dispatcher")
    message = str(info.value)
    assert "dispatcher" in message and "herald keys generate DIR" in message and "--keys DIR" in message
    assert "--insecure" in message
    assert auth.check_bind("tcp://*:7001", None, True, "ps shard 3") is False
    assert auth.check_bind("tcp://*:7001", None, True, "ps shard 3") is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ps shard 3: warning: --insecure: tcp://*:7001" in err  # one line, once
    auth.generate_keys(tmp_path / "keys")
    assert auth.check_bind("tcp://0.0.0.0:0", tmp_path / "keys", False, "dispatcher") is True
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="herald keys generate"):
        auth.check_bind("tcp://127.0.0.1:0", tmp_path / "nothing", False, "dispatcher")


def _exchange(ctx, server, keys) -> bool:
    """A DEALER (CURVE client with ``keys``, plain when None) sends one frame: did ``server`` get it?"""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if keys is not None:
            auth.secure_client(sock, keys)
        sock.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
        sock.send(b"ping")
        return server.poll(1500) != 0 and server.recv_multipart()[1] == b"ping"
    finally:
        sock.close()


def test_curve_server_accepts_only_authorised_clients_and_counts_the_rest(tmp_path):
    good, other = tmp_path / "good", tmp_path / "other"
    auth.generate_keys(good)
    auth.generate_keys(other)
    ctx = zmq.Context()
    try:
        server = auth.server_socket(ctx, zmq.ROUTER, good)
        monitor = auth.HandshakeMonitor(server)
        server.bind("tcp://127.0.0.1:*")
        mine = auth.load_client_keys(good)
        stranger = auth.load_client_keys(other)
        assert _exchange(ctx, server, good)
        assert not _exchange(ctx, server, None)  # no keys
        assert not _exchange(
            ctx, server, auth.ClientKeys(stranger.public, stranger.secret, mine.server_public)
        )  # key not in clients/
        assert not _exchange(ctx, server, other)  # another server key
        refused = monitor.take()
        assert refused.get("auth", 0) >= 1 and refused.get("protocol", 0) >= 2, refused
        monitor.close()
        monitor.close()
        server.close()
        assert auth._AUTHENTICATORS._by_context == {}  # stopped with its last socket
        plain = auth.server_socket(ctx, zmq.ROUTER, None)
        assert type(plain) is zmq.Socket
        plain.close()
    finally:
        ctx.destroy(linger=0)


def test_one_keys_folder_per_context(tmp_path):
    auth.generate_keys(tmp_path / "a")
    auth.generate_keys(tmp_path / "b")
    ctx = zmq.Context()
    try:
        first = auth.server_socket(ctx, zmq.ROUTER, tmp_path / "a")
        second = auth.server_socket(ctx, zmq.ROUTER, tmp_path / "a")  # shares the authenticator
        with pytest.raises(ConfigError, match="one keys folder per process"):
            auth.server_socket(ctx, zmq.ROUTER, tmp_path / "b")
        first.close()
        assert auth._AUTHENTICATORS._by_context  # still serving `second`
        second.close()
        assert auth._AUTHENTICATORS._by_context == {}
    finally:
        ctx.destroy(linger=0)


def test_loopback_interface_is_a_loopback_device():
    name = auth.loopback_interface()
    assert name is not None
    assert int(open(f"/sys/class/net/{name}/flags").read(), 16) & auth.IFF_LOOPBACK


# ----------------------------------------------------------------- NOTE [ps admin ops]
def _gate(root, token=TOKEN):
    counters = collections.Counter()
    return AdminGate(root, token, counters), counters


def test_admin_paths_must_resolve_inside_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "inside").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    gate, counters = _gate(root)
    ok = {"token": TOKEN}
    assert gate.check("checkpoint", dict(ok, dir=str(root / "inside" / "new"))) == str(root.resolve() / "inside/new")
    assert gate.check("restore", dict(ok, dir=str(root))) == str(root.resolve())
    for bad in (str(outside), str(root / ".." / "outside"), str(root / "escape" / "ckpt"), "inside/relative", "/"):
        with pytest.raises(AdminRefused, match=f"checkpoint root {root.resolve()}"):
            gate.check("checkpoint", dict(ok, dir=bad))
    assert counters["admin_refused_path"] == 5
    no_root, counters = _gate(None)
    with pytest.raises(AdminRefused, match="--checkpoint-root"):
        no_root.check("restore", dict(ok, dir=str(root)))
    assert counters["admin_refused_path"] == 1


def test_admin_paths_with_a_nul_byte_or_a_symlink_loop_are_refused(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    gate, counters = _gate(tmp_path)
    for op in ("checkpoint", "restore"):
        with pytest.raises(AdminRefused, match=f"NUL byte.*checkpoint root {tmp_path.resolve()}"):
            gate.check(op, {"token": TOKEN, "dir": str(tmp_path / "step\x00-1")})
        with pytest.raises(AdminRefused, match=f"cannot be resolved.*checkpoint root {tmp_path.resolve()}"):
            gate.check(op, {"token": TOKEN, "dir": str(tmp_path / "a" / "ckpt")})
    assert counters["admin_refused_path"] == 4


def test_admin_ops_need_the_token(tmp_path):
    gate, counters = _gate(tmp_path)
    for header in ({}, {"token": "x" * 32}, {"token": 7}):
        with pytest.raises(AdminRefused, match="admin token"):
            gate.check("shutdown", header)
        with pytest.raises(AdminRefused, match="admin token"):
            gate.check("checkpoint", dict(header, dir=str(tmp_path)))
    assert counters["admin_refused_token"] == 6 and counters["admin_refused_path"] == 0
    assert gate.check("shutdown", {"token": TOKEN}) is None
    tokenless, counters = _gate(tmp_path, token=None)
    with pytest.raises(AdminRefused, match="SIGTERM"):
        tokenless.check("shutdown", {"token": TOKEN})
    assert tokenless.check("checkpoint", {"dir": str(tmp_path)}) == str(tmp_path.resolve())


def test_token_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_token() is None
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert load_token() == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match="16 to 256"):
        load_token()
    f = tmp_path / "token"
    f.write_text(TOKEN[::-1] + "\n")
    os.chmod(f, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_token(f)
    os.chmod(f, 0o600)
    assert load_token(f) == TOKEN[::-1]
