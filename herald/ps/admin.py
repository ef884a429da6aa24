"""Who may checkpoint, restore or stop a PS shard, and where.

NOTE [ps admin ops]: ``checkpoint``, ``restore`` and ``shutdown`` (``wire.ADMIN``)
change what a shard holds or whether it runs, so a shard checks them before acting:

- **Token.** A shard started with an admin token (``HERALD_PS_TOKEN`` in its
  environment, or ``--token-file FILE``: never on the command line, where every local
  user can read it) answers an admin op only if its header carries the same token
  (``token``, compared in constant time). ``herald train`` (:class:`~herald.ps.LocalShards`)
  makes a fresh ``secrets.token_hex(32)`` per job and gives it only to the launcher's
  :class:`~herald.ps.PSClient`; workers never see it. A shard without a token refuses
  ``shutdown`` (stop it with SIGTERM) and accepts ``checkpoint`` / ``restore``.
- **Checkpoint root.** A checkpoint or restore folder must resolve (``Path.resolve``:
  ``..`` and symlinks followed) inside the shard's checkpoint root (``herald serve ps
  --checkpoint-root DIR``; ``herald train``: ``RUN_DIR/checkpoints``). A shard without
  a root refuses both, and so it does a path holding a NUL byte or one that cannot be
  resolved (a symlink loop).
- Every refusal is an error reply of kind ``refused`` naming the fix (the root, or the
  token), raised by the client as :class:`AdminRefused`, and counted in the shard's
  ``stats`` (``admin_refused_token``, ``admin_refused_path``).

With CURVE keys (NOTE [transport security] in herald/auth.py) only holders of the
client key reach the shard at all. Without keys, on loopback, any local user of the
machine can reach a TCP shard and send data ops (pull, push); the token keeps admin
ops to the job's owner, and ``ipc://`` endpoints (``herald train``) follow the
permissions of their folder.
"""

from __future__ import annotations

import collections
import hmac
import os
import pathlib
from typing import NoReturn

from herald.errors import ConfigError
from herald.ps import wire

ADMIN_OPS = wire.ADMIN
#: Environment variable holding a shard's admin token.
TOKEN_ENV = "HERALD_PS_TOKEN"
MIN_TOKEN_CHARS, MAX_TOKEN_CHARS = 16, 256


class AdminRefused(ConfigError):
    """A shard refused an admin op (wrong or missing token, or a path outside its
    checkpoint root); the message names the fix. NOTE [ps admin ops]."""


def check_token(token: str | None, where: str) -> str | None:
    """``token`` if it is None or a printable string of 16 to 256 characters.

    Raises:
        ConfigError: otherwise (naming ``where`` it came from).
    """
    if token is None:
        return None
    if (
        not isinstance(token, str)
        or not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS
        or not token.isprintable()
        or token != token.strip()
    ):
        raise ConfigError(
            f"the admin token from {where} must be {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} printable "
            "characters without surrounding spaces (e.g. python -c 'import secrets; "
            "print(secrets.token_hex(32))')"
        )
    return token


def load_token(token_file: str | os.PathLike | None = None) -> str | None:
    """A shard's admin token: the first line of ``token_file`` (readable by its owner
    only), else :data:`TOKEN_ENV`, else None.

    Raises:
        ConfigError: unreadable file, a file other users may read, or a malformed token.
    """
    if token_file is not None:
        path = pathlib.Path(token_file)
        try:
            mode = path.stat().st_mode
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {path}: {exc}") from None
        if mode & 0o077:
            raise ConfigError(
                f"the token file {path} is readable by other users (mode {mode & 0o777:o}); run `chmod 600 {path}`"
            )
        return check_token(text.strip(), str(path))
    return check_token(os.environ.get(TOKEN_ENV) or None, TOKEN_ENV)


class AdminGate:
    """NOTE [ps admin ops] for one shard.

    Args:
        checkpoint_root: folder every checkpoint / restore path must resolve inside, or
            None (both refused).
        token: the admin token, or None (``shutdown`` refused).
        counters: the shard's counters (refusals are added to them).

    Raises:
        ConfigError: a malformed token.
    """

    def __init__(self, checkpoint_root: str | os.PathLike | None, token: str | None, counters: collections.Counter):
        self.root = pathlib.Path(checkpoint_root).resolve() if checkpoint_root is not None else None
        self._token = check_token(token, "the shard's settings")
        self._counters = counters

    def check(self, op: str, header: dict) -> str | None:
        """Authorise admin op ``op``; returns the resolved folder of a checkpoint or
        restore (pass it to the storage, not the raw path), None for ``shutdown``.

        Raises:
            AdminRefused: wrong or missing token, no root, a path outside the root.
        """
        self._check_token(op, header)
        if op == "shutdown":
            return None
        return str(self._check_path(op, wire.get_str(header, "dir")))

    def _check_token(self, op: str, header: dict) -> None:
        if self._token is None:
            if op == "shutdown":
                self._refuse(
                    "token",
                    f"{op} refused: this shard was started without an admin token "
                    f"({TOKEN_ENV} or --token-file); stop it with SIGTERM",
                )
            return
        given = header.get("token")
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self._token.encode()):
            self._refuse(
                "token",
                f"{op} refused: {'wrong' if isinstance(given, str) else 'missing'} admin token; "
                "pass the job's token (PSClient(admin_token=...)) (NOTE [ps admin ops])",
            )

    def _check_path(self, op: str, raw: str) -> pathlib.Path:
        if self.root is None:
            self._refuse(
                "path",
                f"{op} refused: this shard has no checkpoint root; start it with "
                "--checkpoint-root DIR (NOTE [ps admin ops])",
            )
        if "\x00" in raw:  # no file path holds one (resolve() would raise ValueError)
            self._refuse(
                "path",
                f"{op} refused: {raw!r} holds a NUL byte, which no path may hold; use a folder "
                f"under this shard's checkpoint root {self.root}",
            )
        path = pathlib.Path(raw)
        try:
            resolved = path.resolve() if path.is_absolute() else None
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
            self._refuse(
                "path",
                f"{op} refused: {raw!r} cannot be resolved ({exc}); use a folder under this "
                f"shard's checkpoint root {self.root}",
            )
        if resolved is None or (resolved != self.root and self.root not in resolved.parents):
            self._refuse(
                "path",
                f"{op} refused: {raw!r} is not inside this shard's checkpoint root {self.root} "
                "(absolute paths only; '..' and symlinks are resolved first); use a folder "
                "under it or restart the shard with another --checkpoint-root",
            )
        return resolved

    def _refuse(self, what: str, message: str) -> NoReturn:
        self._counters[f"admin_refused_{what}"] += 1
        raise AdminRefused(message)
