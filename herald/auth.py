"""Who may talk to herald's ZeroMQ sockets, and who can read the traffic (ZeroMQ CURVE).

NOTE [transport security] (docs/operations.md, "Securing a multi-host job"):

- A role that binds (a PS shard, a dispatcher) on a loopback endpoint (``tcp://127.x``,
  ``tcp://localhost``, ``tcp://[::1]``, ``ipc://``, ``inproc://``) needs no keys: only
  processes of this machine reach it (any local user of the machine, for TCP).
- A role that binds any other endpoint needs a keys folder (``--keys DIR``, made by
  ``herald keys generate DIR``) or an explicit ``--insecure`` (one warning line);
  otherwise it refuses to start with :class:`~herald.errors.ConfigError` naming both.
- With a keys folder every server socket is a CURVE server (RFC 26, CurveZMQ:
  Curve25519 key exchange, XSalsa20-Poly1305 per message): it holds the server key pair
  and accepts only clients whose public key is in ``DIR/clients/`` (ZAP, checked by
  one ``zmq.auth.thread.ThreadAuthenticator`` per context). Every client socket (PS
  client, shard watch, worker) holds the client key pair and the server's public key.
  Traffic is then encrypted and authenticated even on loopback.
- Keys are read from the folder on every host; no key material ever travels on the
  wire (the job spec carries the folder's path, not its contents).

Keys folder (every file 0600, the folders 0700)::

    DIR/server.key          public key of the servers: every client needs it
    DIR/server.key_secret   secret key of the servers: PS shards and dispatchers only
    DIR/client.key_secret   key pair of the clients: workers, launchers, PS clients
    DIR/clients/client.key  public keys of the authorised clients (add more ``*.key``)
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import pathlib
import socket
import sys
import tempfile
import threading
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from herald.errors import ConfigError
from herald.inputs import check_output_folder

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_SECRET = "client.key_secret"
CLIENTS = "clients"
CLIENT_PUBLIC = "client.key"
#: Files ``herald keys generate`` writes, relative to the keys folder.
KEY_FILES = (SERVER_PUBLIC, SERVER_SECRET, CLIENT_SECRET, f"{CLIENTS}/{CLIENT_PUBLIC}")
#: ``IFF_LOOPBACK`` in ``/sys/class/net/<name>/flags`` (linux/if.h).
IFF_LOOPBACK = 0x8
GUIDE = "docs/operations.md, 'Securing a multi-host job'"


def _fix(keys_dir: str | os.PathLike | None = None) -> str:
    where = keys_dir or "DIR"
    return f"run `herald keys generate {where}` and pass `--keys {where}` to every role"


# ----------------------------------------------------------------- key folder
def generate_keys(keys_dir: str | os.PathLike, force: bool = False) -> list[pathlib.Path]:
    """Write a server and a client CURVE key pair into ``keys_dir`` (:data:`KEY_FILES`).

    The folder (and ``clients/``) is made mode 0700, every file 0600; the keys are
    written into a private temporary folder first, so no secret is ever readable by others.

    Args:
        keys_dir: the folder (created if missing).
        force: replace existing keys (every holder of the old ones must get the new ones).

    Returns:
        The paths written, in :data:`KEY_FILES` order.

    Raises:
        ConfigError: a key file exists and ``force`` is False, or the folder cannot be written.
    """
    root = pathlib.Path(keys_dir)
    existing = [root / name for name in KEY_FILES if (root / name).exists()]
    if existing and not force:
        raise ConfigError(
            f"{existing[0]} exists: refusing to overwrite keys that other hosts may hold; pass "
            "--force to replace them (then copy the folder to every host again) or choose "
            "another folder"
        )
    try:
        (root / CLIENTS).mkdir(parents=True, exist_ok=True)
        for folder in (root, root / CLIENTS):
            os.chmod(folder, 0o700)
        with tempfile.TemporaryDirectory(dir=root, prefix=".keys-") as tmp:  # mode 0700
            zmq.auth.create_certificates(tmp, "server")
            zmq.auth.create_certificates(tmp, "client")
            written = []
            for src, name in (
                ("server.key", SERVER_PUBLIC),
                ("server.key_secret", SERVER_SECRET),
                ("client.key_secret", CLIENT_SECRET),
                ("client.key", f"{CLIENTS}/{CLIENT_PUBLIC}"),
            ):
                os.chmod(os.path.join(tmp, src), 0o600)
                os.replace(os.path.join(tmp, src), root / name)
                written.append(root / name)
    except OSError as exc:
        raise ConfigError(f"cannot write keys into {root}: {exc}") from None
    return written


def _load(keys_dir: str | os.PathLike, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = pathlib.Path(keys_dir) / name
    if not path.is_file():
        raise ConfigError(
            f"keys folder {keys_dir} has no {name}: {_fix(keys_dir)} (copy the whole folder to "
            f"every host of the job; {GUIDE})"
        )
    if secret and path.stat().st_mode & 0o077:
        raise ConfigError(
            f"{path} holds a secret key but other users may read it (mode "
            f"{path.stat().st_mode & 0o777:o}); run `chmod 600 {path}`"
        )
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a ZeroMQ certificate ({exc}); {_fix(keys_dir)}") from None
    if secret and secret_key is None:
        raise ConfigError(f"{path} holds no secret key; {_fix(keys_dir)}")
    return public, secret_key


@dataclasses.dataclass(frozen=True)
class ServerKeys:
    """A CURVE server's keys (z85 bytes) and the folder of authorised client public keys."""

    public: bytes
    secret: bytes
    clients_dir: str


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """A CURVE client's key pair and the server's public key (z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes


def load_server_keys(keys_dir: str | os.PathLike) -> ServerKeys:
    """The server keys of ``keys_dir`` (``server.key_secret``, ``clients/*.key``).

    Raises:
        ConfigError: a file is missing, malformed or readable by other users (names the fix).
    """
    public, secret = _load(keys_dir, SERVER_SECRET, secret=True)
    clients = pathlib.Path(keys_dir) / CLIENTS
    if not clients.is_dir() or not any(clients.glob("*.key")):
        raise ConfigError(
            f"keys folder {keys_dir} has no authorised client keys ({clients}/*.key): every "
            f"client would be refused; {_fix(keys_dir)}"
        )
    return ServerKeys(public, secret, str(clients.resolve()))


def load_client_keys(keys_dir: str | os.PathLike) -> ClientKeys:
    """The client keys of ``keys_dir`` (``client.key_secret``, ``server.key``).

    Raises:
        ConfigError: a file is missing, malformed or readable by other users (names the fix).
    """
    public, secret = _load(keys_dir, CLIENT_SECRET, secret=True)
    server_public, _ = _load(keys_dir, SERVER_PUBLIC, secret=False)
    return ClientKeys(public, secret, server_public)


# ----------------------------------------------------------------- bind policy
def is_loopback(endpoint: str) -> bool:
    """True for an endpoint only this machine reaches: ``ipc://``, ``inproc://``,
    ``tcp://127.x.y.z``, ``tcp://localhost``, ``tcp://[::1]``, ``tcp://lo`` (interface).
    ``tcp://*``, ``tcp://0.0.0.0``, ``tcp://[::]`` and other addresses are not."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    rest = endpoint[len("tcp://") :].rsplit(";", 1)[-1]  # "source;destination" of a connect
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_warned: set[tuple[str, str]] = set()


def check_bind(endpoint: str, keys_dir: str | os.PathLike | None, insecure: bool, role: str) -> bool:
    """May ``role`` bind ``endpoint``? NOTE [transport security].

    Args:
        endpoint: the ZeroMQ endpoint to bind.
        keys_dir: the keys folder (``--keys``) or None.
        insecure: ``--insecure``: accept a non-loopback bind without keys.
        role: named in messages (``"ps shard 0"``, ``"dispatcher"``).

    Returns:
        True when the socket will be a CURVE server (``keys_dir`` given; its server keys
        are loaded to check them), False for plain ZeroMQ.

    Raises:
        ConfigError: a non-loopback ``endpoint`` with neither keys nor ``insecure``
            (names ``herald keys generate`` and ``--insecure``); bad keys.

    Prints one warning line to stderr (once per role and endpoint) when ``insecure``
    lets a non-loopback endpoint go without keys.
    """
    if keys_dir is not None:
        load_server_keys(keys_dir)
        return True
    if is_loopback(endpoint):
        return False
    if not insecure:
        raise ConfigError(
            f"{role}: {endpoint} is not a loopback endpoint, and without keys anyone who reaches it "
            f"could read and change the model: {_fix()}, or pass --insecure to accept "
            f"unauthenticated, unencrypted traffic ({GUIDE})"
        )
    if (role, endpoint) not in _warned:
        _warned.add((role, endpoint))
        print(
            f"herald {role}: warning: --insecure: {endpoint} is not loopback and its traffic is neither "
            "authenticated nor encrypted; anyone who reaches it can read and change the model",
            file=sys.stderr,
            flush=True,
        )
    return False


# ----------------------------------------------------------------- sockets
class _Authenticators:
    """One started ``ThreadAuthenticator`` per context, shared by its CURVE server
    sockets (reference-counted), stopped when the last one is released."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_context: dict[int, list[Any]] = {}  # id(ctx) -> [authenticator, users, clients_dir]

    def acquire(self, ctx: zmq.Context, clients_dir: str) -> None:
        with self._lock:
            entry = self._by_context.get(id(ctx))
            if entry is None:
                auth = ThreadAuthenticator(ctx)
                auth.start()
                auth.configure_curve(domain="*", location=clients_dir)
                self._by_context[id(ctx)] = [auth, 1, clients_dir]
            elif entry[2] != clients_dir:
                raise ConfigError(
                    f"this process already serves CURVE with the client keys of {entry[2]}; a second "
                    f"folder ({clients_dir}) needs another zmq.Context: use one keys folder per process"
                )
            else:
                entry[1] += 1

    def release(self, ctx: zmq.Context, timeout_s: float) -> None:
        """Drop one share of ``ctx``'s authenticator; the last stops it, waiting at most
        ``timeout_s`` (``ThreadAuthenticator.stop`` joins its thread without a bound, so it
        runs on a daemon thread of its own)."""
        with self._lock:
            entry = self._by_context.get(id(ctx))
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._by_context[id(ctx)]
                stopper = threading.Thread(target=entry[0].stop, name="herald-auth-stop", daemon=True)
                stopper.start()
                stopper.join(timeout_s)


_AUTHENTICATORS = _Authenticators()


class ServerAuth:
    """The authenticator share of one CURVE server socket; :meth:`close` releases it
    (idempotent; the context's authenticator stops with its last socket)."""

    def __init__(self, ctx: zmq.Context):
        self._ctx: zmq.Context | None = ctx

    def close(self, timeout_s: float = 5.0) -> None:
        """Release the share; the last one stops the authenticator, waiting at most ``timeout_s``."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            _AUTHENTICATORS.release(ctx, timeout_s)


def secure_server(sock: zmq.Socket, keys_dir: str | os.PathLike) -> ServerAuth:
    """Make ``sock`` (not yet bound) a CURVE server with the keys of ``keys_dir``; only
    clients whose public key is in ``keys_dir/clients/`` complete the handshake.

    Returns:
        A :class:`ServerAuth` to close after the socket.

    Raises:
        ConfigError: missing or malformed keys (names ``herald keys generate``).
    """
    keys = load_server_keys(keys_dir)
    _AUTHENTICATORS.acquire(sock.context, keys.clients_dir)
    try:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
    except BaseException:
        _AUTHENTICATORS.release(sock.context, 5.0)
        raise
    return ServerAuth(sock.context)


def secure_client(sock: zmq.Socket, keys: str | os.PathLike | ClientKeys) -> None:
    """Make ``sock`` (not yet connected) a CURVE client: ``keys`` is a keys folder or
    :func:`load_client_keys`'s result.

    Raises:
        ConfigError: missing or malformed keys (names ``herald keys generate``).
    """
    if not isinstance(keys, ClientKeys):
        keys = load_client_keys(keys)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


class _CurveServerSocket(zmq.Socket):
    """A socket whose :meth:`close` also releases its :class:`ServerAuth`."""

    _herald_auth: ServerAuth | None = None

    def close(self, linger: int | None = None) -> None:  # zmq.Socket.close's signature
        try:
            super().close(linger=linger)
        finally:
            auth, self._herald_auth = self._herald_auth, None
            if auth is not None:
                auth.close()


def server_socket(ctx: zmq.Context, socket_type: int, keys_dir: str | os.PathLike | None) -> zmq.Socket:
    """A new socket of ``socket_type`` to bind: plain without ``keys_dir``, else a CURVE
    server (:func:`secure_server`) whose ``close()`` also releases the authenticator.

    Raises:
        ConfigError: missing or malformed keys.
    """
    if keys_dir is None:
        return ctx.socket(socket_type)
    sock = ctx.socket(socket_type, socket_class=_CurveServerSocket)
    try:
        sock._herald_auth = secure_server(sock, keys_dir)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


class HandshakeMonitor:
    """Counts the handshakes a CURVE server socket refused (a client without keys, with
    a key not in ``clients/``, or with the wrong server key). Create it before the socket
    binds; :meth:`take` is non-blocking."""

    EVENTS = {
        zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "other",
    }

    def __init__(self, sock: zmq.Socket):
        self._sock = sock
        self._mon: zmq.Socket | None = sock.get_monitor_socket(sum(self.EVENTS))

    def take(self) -> dict[str, int]:
        """Refused handshakes since the last call, by kind (``auth``: key not authorised;
        ``protocol``: no keys or the wrong server key; ``other``)."""
        from zmq.utils.monitor import recv_monitor_message

        out: dict[str, int] = {}
        while self._mon is not None:
            try:
                event = recv_monitor_message(self._mon, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = self.EVENTS.get(event["event"])
            if kind is not None:
                out[kind] = out.get(kind, 0) + 1
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop monitoring (idempotent; call before closing the socket); returns at once
        (``timeout_s``: nothing here waits; docs/design.md, "Timeouts and units")."""
        if self._mon is not None:
            mon, self._mon = self._mon, None
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(linger=0)


# ----------------------------------------------------------------- the dense store
def loopback_interface() -> str | None:
    """Name of this host's loopback network interface (``lo`` on Linux), read from
    ``/sys/class/net/*/flags`` (``IFF_LOOPBACK``); None if none is found. Used for
    ``GLOO_SOCKET_IFNAME`` of local workers, so gloo listens on loopback only."""
    net = pathlib.Path("/sys/class/net")
    try:
        names = sorted(p.name for p in net.iterdir())
    except OSError:
        names = []
    for name in names:
        try:
            if int((net / name / "flags").read_text().strip(), 16) & IFF_LOOPBACK:
                return name
        except (OSError, ValueError):
            continue
    try:
        return "lo" if any(name == "lo" for _, name in socket.if_nameindex()) else None
    except OSError:
        return None


# ----------------------------------------------------------------- command line
def _generate(args) -> int:
    check_output_folder(args.dir, "DIR")  # NOTE [front doors] in herald/inputs.py
    paths = generate_keys(args.dir, force=args.force)
    root = pathlib.Path(args.dir)
    print(f"wrote CURVE keys to {root} (files 0600, folder 0700):")
    for p in paths:
        print(f"  {p}")
    print(
        f"give the whole folder to every host of the job (e.g. `scp -rp {root} HOST:{root.resolve()}`) and pass "
        f"`--keys {root}` to herald train / herald serve ps|dispatcher|worker ({GUIDE})"
    )
    return 0


def register(commands, bench, serve) -> None:
    """Add ``herald keys generate DIR``."""
    k = commands.add_parser("keys", help="CURVE keys that authenticate and encrypt the roles' traffic")
    sub = k.add_subparsers(dest="keys_command", metavar="ACTION")
    k.set_defaults(func=lambda args: (k.print_help(sys.stderr), 2)[1])
    g = sub.add_parser(
        "generate",
        help="write a server and a client key pair into DIR",
        description="Write a server key pair (PS shards, dispatchers) and a client key pair (workers, "
        "launchers) into DIR, files 0600 and DIR 0700. Copy DIR to every host and pass "
        f"--keys DIR to every role ({GUIDE}).",
    )
    g.add_argument("dir", metavar="DIR", help="folder for the keys (created if missing)")
    g.add_argument("--force", action="store_true", help="replace existing keys")
    g.set_defaults(func=_generate)


__all__ = [
    "ClientKeys",
    "HandshakeMonitor",
    "KEY_FILES",
    "ServerAuth",
    "ServerKeys",
    "check_bind",
    "generate_keys",
    "is_loopback",
    "load_client_keys",
    "load_server_keys",
    "loopback_interface",
    "secure_client",
    "secure_server",
    "server_socket",
]
