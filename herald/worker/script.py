"""``python -m herald.worker.script FILE [ARGS]``: a user's own training script run as one
worker of a ``herald train --script FILE`` job (docs/job.md, "Your own script").

NOTE [own script]
~~~~~~~~~~~~~~~~~
The launcher starts every rank as this module (:func:`script_launch`, the one builder of its
command line and environment, beside :func:`herald.worker.cli.worker_args`) in place of
``herald serve worker``. It runs ``FILE`` as ``python FILE ARGS`` would: ``runpy.run_path``
with ``run_name="__main__"``, ``sys.argv = [FILE, *ARGS]`` and FILE's folder first on
``sys.path``; the current folder is not on it (``PYTHONSAFEPATH``, NOTE [no code from the
current folder] in herald/procs.py). The environment is torchrun's (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and the job's (:data:`DISPATCHER_ENV` and the others of
:func:`script_env`), so :meth:`herald.worker.api.ScheduledLoader.connect` needs no arguments.
The script's output goes to the worker's log. A script that raises (or exits non-zero) writes
a :data:`MARKER` line with the time, its rank and path before the traceback and exits with
:data:`SCRIPT_FAILED_EXIT`; the launcher names the first rank whose script failed, the
script and the traceback's last lines (:func:`script_failure`) rather than an exit code.
Loaders the script left open are closed, each within a bound.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys
import time
import traceback

from herald.contracts.vocab import DEFAULT_TIMEOUT_MS, MAX_TIMEOUT_MS, MAX_WORKERS
from herald.errors import UsageError

#: The job's settings a script's :meth:`~herald.worker.api.ScheduledLoader.connect` reads.
DISPATCHER_ENV = "HERALD_DISPATCHER"
KEYS_ENV = "HERALD_KEYS"
DEVICE_ENV = "HERALD_DEVICE"
CACHE_DEVICE_ENV = "HERALD_CACHE_DEVICE"
TIMEOUT_ENV = "HERALD_TIMEOUT_MS"
#: Exit status of a worker whose script raised (EX_SOFTWARE, sysexits.h).
SCRIPT_FAILED_EXIT = 70
#: The first words of the line a failed script's worker writes before the traceback.
MARKER = "herald-script-failed"
#: Lines of a failed script's traceback its job's error quotes.
TRACEBACK_LINES = 12


def script_env(
    dispatcher: str,
    *,
    rank: int,
    world_size: int,
    device: str = "auto",
    cache_device: str = "auto",
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    keys_dir: str | None = None,
) -> dict[str, str]:
    """The environment of one script worker (NOTE [own script]): ``RANK`` / ``WORLD_SIZE``
    (its rank among the ranks its dispatcher serves, as ``herald serve worker --rank`` /
    ``--world-size``) and the job's settings :meth:`ScheduledLoader.connect` reads.
    ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` are the launcher's, as for every worker."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        DISPATCHER_ENV: dispatcher,
        DEVICE_ENV: device,
        CACHE_DEVICE_ENV: cache_device,
        TIMEOUT_ENV: str(timeout_ms),
    }
    if keys_dir:
        env[KEYS_ENV] = str(keys_dir)
    return env


def _env_int(name: str, low: int, high: int, hint: str) -> int:
    text = os.environ.get(name)
    if text is None or not text.strip().isdigit() or not low <= int(text) <= high:
        raise UsageError(f"ScheduledLoader.connect() needs {hint} (or ${name}, set by herald train --script "
                         f"and torchrun: {low}..{high}); got {name}={text!r:.40}")  # fmt: skip
    return int(text)


def job_environment(
    dispatcher: str | None,
    rank: int | None,
    world_size: int | None,
    device: str | None,
    cache_device: str | None,
    timeout_ms: int | None,
    keys_dir: str | None,
) -> tuple[str, int, int, str | None, str, int, str | None]:
    """:meth:`~herald.worker.api.ScheduledLoader.connect`'s arguments, each one None read from
    the environment :func:`script_env` gives (NOTE [own script]); returned in the same order.

    Raises:
        UsageError: ``dispatcher``, ``rank`` or ``world_size`` neither given nor in the
            environment, or malformed there (named, with the fix).
    """
    env = os.environ
    if dispatcher is None:
        dispatcher = env.get(DISPATCHER_ENV) or None
        if dispatcher is None:
            raise UsageError(
                f"ScheduledLoader.connect() needs the dispatcher's address: pass it, or set ${DISPATCHER_ENV} "
                "(herald train --script sets it for every worker)"
            )
    if rank is None:
        rank = _env_int("RANK", 0, MAX_WORKERS - 1, "rank=")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", 1, MAX_WORKERS, "world_size=")
    if timeout_ms is None:
        timeout_ms = (
            _env_int(TIMEOUT_ENV, 1, MAX_TIMEOUT_MS, "timeout_ms=") if TIMEOUT_ENV in env else DEFAULT_TIMEOUT_MS
        )
    device = device if device is not None else env.get(DEVICE_ENV) or None
    cache_device = cache_device if cache_device is not None else env.get(CACHE_DEVICE_ENV) or "auto"
    keys_dir = keys_dir if keys_dir is not None else env.get(KEYS_ENV) or None
    return dispatcher, rank, world_size, device, cache_device, timeout_ms, keys_dir


def script_launch(path: str, args: tuple[str, ...], dispatcher: str, **settings) -> tuple[list[str], dict[str, str]]:
    """``(arguments after the interpreter, environment)`` of one worker running the script
    ``path`` (absolute) with ``args``; ``settings``: :func:`script_env`'s (rank, world_size, ...)."""
    return ["-m", "herald.worker.script", str(path), *args], script_env(dispatcher, **settings)


def script_failure(logs: dict[int, pathlib.Path], script: str) -> str | None:
    """The job's error for a failed script: the rank whose script failed first (the earliest
    :data:`MARKER` line of the ``logs``, worker rank -> log file), the script, and the last
    lines of its traceback; None when no log holds a marker (the worker failed otherwise)."""
    found = []
    for rank, log in logs.items():
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        marks = [i for i, line in enumerate(lines) if line.startswith(MARKER + " ")]
        if marks:
            words = lines[marks[-1]].split(" ", 3)
            try:  # the script may print a line that starts like a marker
                at = float(words[1])
            except (IndexError, ValueError):
                continue
            found.append((at, rank, log, words[3] if len(words) > 3 else "", lines[marks[-1] + 1 :]))
    if not found:
        return None
    _, rank, log, how, tail = min(found)
    last = "\n".join(tail[-TRACEBACK_LINES:])
    return f"worker rank {rank}: script {script} {how}; last lines of its traceback (log {log}):\n{last}"


def _failed(path: str, how: str) -> int:
    """Write the :data:`MARKER` line (then the caller's traceback, if any): the launcher reads it."""
    print(f"{MARKER} {time.time():.6f} rank={os.environ.get('RANK', '?')} {how}", file=sys.stderr, flush=True)
    return SCRIPT_FAILED_EXIT


def run_script(path: str, args: list[str]) -> int:
    """Run the script ``path`` with ``args`` as NOTE [own script] says; returns the exit status
    (0, :data:`SCRIPT_FAILED_EXIT`, or 2 for a path that is no readable file)."""
    from herald.errors import ConfigError
    from herald.inputs import check_input_path

    path = os.path.abspath(path)
    try:
        check_input_path(path, "--script", folder_ok=False)
    except ConfigError as exc:
        print(f"herald: error: {exc}", file=sys.stderr)
        return 2
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return 0
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        _failed(path, f"exited with code {code} (sys.exit)")
        return code
    except BaseException as exc:  # a KeyboardInterrupt too: the job names it
        _failed(path, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))
        traceback.print_exc()
        sys.stderr.flush()
        return SCRIPT_FAILED_EXIT
    finally:
        _close_loaders()
    return 0


def _close_loaders() -> None:
    """Close the loaders the script left open (NOTE [own script]), each within 5 s."""
    api = sys.modules.get("herald.worker.api")
    for loader in list(getattr(api, "OPEN_LOADERS", ())):
        try:
            loader.close(timeout_s=5.0)
        except Exception as exc:  # the script's own error is the one to report
            print(f"herald: closing the loader after the script: {type(exc).__name__}: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m herald.worker.script FILE [ARGS]", file=sys.stderr)
        return 2
    return run_script(argv[0], argv[1:])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
