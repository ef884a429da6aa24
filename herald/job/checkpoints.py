"""Training checkpoints: PS rows + dense state + dispatcher state, one folder per step.

Layout under ``<run_dir>/checkpoints``::

    step-00000123/ps/...        the PS shards' checkpoint (herald.ps, with its manifest)
    step-00000123/dense.pt      rank 0's dense model + optimizer state
    step-00000123/meta.json     {"step", "batch_index", "source_position", "skipped", "dispatcher",
                                 "config", "consistency"}
    step-00000123/scheduler-warm.npz, cache-rank<R>.npz
                                off the checkpoint grid only: the scheduler's warm state and
                                each worker's cache (NOTE [warm resume] in herald/dispatch/warm.py;
                                the PS part then holds the rows' clocks too)
    latest                      the name of the newest complete checkpoint

``dispatcher`` is :meth:`herald.dispatch.dispatcher.Dispatcher.state_dict` at the
barrier (next step, next batch, the global-batch producer's position: for a file, the
source state after the batch; for Kafka, the topic position, also in
``source_position``). ``skipped`` is the bad records skipped up to that batch
(reason -> count, NOTE [bad records]; the producer's counts, also inside ``dispatcher``
from which a resumed job restores them, so its report counts the whole job).
``herald train --resume`` (and ``herald serve dispatcher --resume``, the test bed's
dispatcher: :class:`DispatcherCheckpoints`) restores all three parts, and since a
barrier on the grid leaves empty caches and a fresh scheduler (NOTE [checkpoint barrier])
the resumed job trains exactly what the uninterrupted one would; off the grid, where
the uninterrupted run's caches stay warm, it also restores the scheduler and the caches
(NOTE [warm resume]).

``config`` (``herald train``'s checkpoints) holds the job's hyper-parameters
(:data:`HYPER_PARAMETERS`) and ``consistency`` the mode that wrote the checkpoint with
its settings. A resumed job must keep the hyper-parameters (:func:`check_resume_config`
names every one that changed); it may change the consistency mode and GBA's settings
(:data:`SWITCHABLE`): a checkpoint is mode-free (NOTE [gba checkpoints] in
herald/dispatch/gba.py), and GBA keeps BSP's global batch, so switching ``bsp`` <->
``gba`` there needs no re-tuning (GBA §4; docs/consistency.md, "Switching modes").

A checkpoint is assembled in ``.tmp-step-...``, renamed into place when complete, and
only then named in ``latest`` (written to a temporary file and renamed): a crash at
any point leaves ``latest`` naming a complete checkpoint. Every file of it is 0600 in
0700 folders, and a write that fails (disk full, permission denied, ...) raises
:class:`~herald.errors.StorageError` (the PS shards' :class:`~herald.ps.CheckpointError`)
naming the file, why and the fix: NOTE [private files] in herald/files.py. The source position is
committed (Kafka) after ``latest`` is updated: NOTE [kafka delivery] in
herald/loader/global_batches.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys
from collections.abc import Callable
from typing import Any

from herald.errors import ConfigError, DataError
from herald.files import private_dir, write_private
from herald.ps.checkpoint import fsync_dir

#: ``TrainConfig`` settings (by flag) a resumed job keeps: its hyper-parameters (the global batch is
#: ``workers x batch_size``).
HYPER_PARAMETERS = (
    "workers",
    "batch_size",
    "embedding_dim",
    "model",
    "optimizer",
    "lr",
    "dense_optimizer",
    "dense_lr",
    "seed",
)
#: ``TrainConfig`` fields a resumed job may change: the consistency mode and its settings.
SWITCHABLE = ("mode",)


def job_config(cfg: Any) -> dict[str, Any]:
    """``{"config": hyper-parameters, "consistency": {"mode", the mode's settings by flag}}``
    of a ``TrainConfig`` (JSON-able), what :class:`Checkpointer` writes to ``meta.json``."""
    flags = cfg.flags()
    return {
        "config": {k: flags[k] for k in HYPER_PARAMETERS},
        "consistency": {"mode": cfg.consistency, **cfg.mode.flags()},
    }


def check_resume_config(checkpoint: Checkpoint, cfg: Any) -> str | None:
    """Check a resumed job's ``TrainConfig`` against the checkpoint's; return the mode the
    checkpoint was written under when it differs from ``cfg.consistency`` (``switched_from``),
    else None. A checkpoint without ``config`` (written by ``herald serve dispatcher`` or an
    older herald) is not checked.

    Raises:
        ConfigError: a hyper-parameter (:data:`HYPER_PARAMETERS`) differs; the message names
            each, with the checkpoint's value and the new one.
    """
    saved = checkpoint.meta.get("config")
    if isinstance(saved, dict):
        now = job_config(cfg)["config"]
        changed = [
            f"--{k.replace('_', '-')} {saved[k]!r} -> {now[k]!r}"
            for k in HYPER_PARAMETERS
            if k in saved and saved[k] != now[k]
        ]
        if changed:
            raise ConfigError(
                f"--resume from {checkpoint.path}: the job's hyper-parameters changed "
                f"({'; '.join(changed)}); a resumed job keeps them (only --consistency, --gba-buffer "
                "and --gba-threshold may change): restore them, or start afresh in a new --run-dir"
            )
    mode = (checkpoint.meta.get("consistency") or {}).get("mode")
    return mode if isinstance(mode, str) and mode != cfg.consistency else None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint found on disk."""

    path: pathlib.Path
    step: int
    meta: dict[str, Any]

    @property
    def dispatcher_state(self) -> dict[str, Any]:
        """The dispatcher's state at the barrier (``Dispatcher.load_state_dict``).

        Raises:
            DataError: the checkpoint has none (written by an older herald).
        """
        state = self.meta.get("dispatcher")
        if not isinstance(state, dict):
            raise DataError(
                f"checkpoint {self.path} has no dispatcher state (written by an older herald); "
                f"delete {self.path.parent} to start afresh"
            )
        return state


#: Name prefix of a checkpoint being assembled (:meth:`Checkpointer.staging_path`).
STAGING_PREFIX = ".tmp-step-"


def remove_staging(root: str | os.PathLike) -> list[str]:
    """Remove every checkpoint still being assembled under ``root`` (``<run_dir>/checkpoints``):
    the ``.tmp-step-*`` folders (not symlinks) a killed job left (one killed while a shard or
    rank 0 wrote its part). Only for a run folder no live job uses (NOTE [run leftovers] in
    herald/job/recovery/leftovers.py calls it at a job's start or resume). Returns the paths removed."""
    removed = []
    for path in sorted(pathlib.Path(root).glob(STAGING_PREFIX + "*")):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(str(path))
    return removed


def latest(root: str | os.PathLike) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` (``<run_dir>/checkpoints``), or None.

    Raises:
        DataError: ``latest`` names a folder that is missing or has no readable meta.json.
    """
    root = pathlib.Path(root)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"checkpoint {path} named by {pointer} is unreadable ({exc}); "
            "delete the run folder's checkpoints to start afresh"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise DataError(
            f"checkpoint {path} has a malformed meta.json (no integer 'step'); "
            "delete the run folder's checkpoints to start afresh"
        )
    return Checkpoint(path, meta["step"], meta)


class Checkpointer:
    """Writes checkpoints at the dispatcher's barriers (``Dispatcher(on_checkpoint=...)``).

    Args:
        root: ``<run_dir>/checkpoints``.
        ps_checkpoint: ``ps_checkpoint(folder)`` checkpoints every PS shard into ``folder``
            (always under ``root``/``.tmp-step-N``: give the shards ``root`` as their
            checkpoint root, NOTE [ps admin ops], and they refuse any other folder);
            ``ps_checkpoint(folder, clocks=True)`` with the rows' clocks, for a checkpoint
            off the grid (NOTE [warm resume] in herald/dispatch/warm.py).
        position: ``position(batch_index)`` -> JSON-able source position after that batch,
            or None for sources without one.
        commit: ``commit(batch_index)`` commits the source position (Kafka), or None.
        keep: complete checkpoints to keep (older ones are deleted).
        config: :func:`job_config` of the job, written to every ``meta.json``, or None.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        ps_checkpoint: Callable[[str], Any],
        position: Callable[[int], Any] | None = None,
        commit: Callable[[int], None] | None = None,
        keep: int = 2,
        config: dict[str, Any] | None = None,
    ):
        self.root = private_dir(root)  # NOTE [private files]
        self._ps, self._position, self._commit, self.keep = ps_checkpoint, position, commit, keep
        self._config = dict(config or {})

    def staging_path(self, step: int) -> str:
        """Where the workers save the dense state of the checkpoint of ``step``."""
        path = self.root / f"{STAGING_PREFIX}{step:08d}"
        shutil.rmtree(path, ignore_errors=True)
        return str(private_dir(path))

    def save(self, step: int, batch_index: int, staging: str, state: dict | None = None) -> pathlib.Path:
        """Complete the checkpoint of ``step`` (dense state already in ``staging``);
        ``state``: the dispatcher's state at this barrier (JSON-able).

        Raises:
            StorageError: ``meta.json`` or ``latest`` could not be written (naming why and the fix);
            CheckpointError: a PS shard could not write its part (likewise).
        """
        staging_path = pathlib.Path(staging)
        if (state or {}).get("warm") is not None:  # NOTE [warm resume]: the copies' clocks need the rows'
            self._ps(str(staging_path / "ps"), clocks=True)
        else:
            self._ps(str(staging_path / "ps"))
        batches = (state or {}).get("batches") or {}
        meta = {
            "step": step,
            "batch_index": batch_index,
            "source_position": self._position(batch_index) if self._position else None,
            "skipped": dict(batches.get("skipped", {})),
            "dispatcher": state,
            **self._config,
        }
        write_private(staging_path / "meta.json", json.dumps(meta, indent=2), "checkpoint file")
        fsync_dir(staging_path)
        final = self.root / f"step-{step:08d}"
        shutil.rmtree(final, ignore_errors=True)
        staging_path.rename(final)
        tmp = self.root / "latest.tmp"
        write_private(tmp, final.name, "checkpoint file")
        os.replace(tmp, self.root / "latest")
        fsync_dir(self.root)
        if self._commit is not None:
            self._commit(batch_index)
        self._prune()
        return final

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)


class DispatcherCheckpoints:
    """The checkpoint side of one dispatcher process: resume from the latest checkpoint,
    write one at each barrier (NOTE [checkpoint barrier]). Shared by ``herald train``
    (:mod:`herald.job.launcher`), ``herald serve dispatcher`` and the test bed's dispatcher
    (:mod:`herald.testbed.dispatcher`), so that a job resumed on one path is exact on all.

    Use: construct (finds the resume point, raises early on a bad one), :meth:`attach`
    the PS client and the job's data (restores the PS rows on resume), give the workers
    :attr:`resume_dense` in their job, pass :meth:`dispatcher_kwargs` to the
    :class:`~herald.dispatch.dispatcher.Dispatcher` and call :meth:`load` on it before
    ``serve()``.

    Args:
        run_dir: the run folder; checkpoints go to ``<run_dir>/checkpoints`` (made
            absolute: the PS shards and worker rank 0 get absolute folders, so on several
            hosts they must see this folder at the same path, e.g. a shared file system).
        resume: continue from the latest checkpoint (none there: a note on stderr, step 0).
        enabled: write checkpoints at the barriers.
        who: the command, for messages (``"herald train"``).
        config: the job's ``TrainConfig`` (``herald train``): its hyper-parameters and
            consistency mode are written to every checkpoint and checked on resume
            (:func:`check_resume_config`); None: neither.

    Attributes:
        switched_from: the consistency mode of the resumed checkpoint when ``config``
            chose another (``bsp`` <-> ``gba``), else None.

    Raises:
        DataError: ``resume`` and the latest checkpoint is unreadable or has no dispatcher state.
        ConfigError: ``resume`` and ``config`` changes a hyper-parameter of the checkpoint.
    """

    def __init__(self, run_dir: str | os.PathLike, *, resume: bool, enabled: bool, who: str, config: Any = None):
        self.root = private_dir(pathlib.Path(run_dir).resolve() / "checkpoints")
        self.enabled = bool(enabled)
        self.resume = latest(self.root) if resume else None
        self.resume_state = self.resume.dispatcher_state if self.resume is not None else None
        if resume and self.resume is None:
            print(f"{who} --resume: no checkpoint in {self.root}; starting at step 0", file=sys.stderr)
        self._config = job_config(config) if config is not None else None
        self.switched_from = (
            check_resume_config(self.resume, config) if self.resume is not None and config is not None else None
        )
        self.checkpointer: Checkpointer | None = None
        self._who = who

    @property
    def resume_dense(self) -> str | None:
        """The checkpoint folder whose ``dense.pt`` the workers load (``JobSpec.resume_dense``), or None."""
        return str(self.resume.path) if self.resume is not None else None

    def attach(self, ps, data=None) -> None:
        """Restore ``ps`` (a :class:`~herald.ps.PSClient` holding the admin token) from the
        resume point, if any, and checkpoint through it from now on; ``data``: the job's
        :class:`~herald.job.data.JobData` (source position and commit), or None."""
        if self.resume is not None:
            ps.restore(str(self.resume.path / "ps"))
        self.checkpointer = Checkpointer(
            self.root,
            lambda path, clocks=False: ps.checkpoint(path, clocks=clocks),
            position=data.position if data is not None else None,
            commit=data.commit if data is not None else None,
            config=self._config,
        )

    def dispatcher_kwargs(self) -> dict[str, Any]:
        """``on_checkpoint`` and ``checkpoint_path`` for the Dispatcher (None when not enabled)."""
        on = self.enabled and self.checkpointer is not None
        return {
            "on_checkpoint": self.checkpointer.save if on else None,
            "checkpoint_path": self.checkpointer.staging_path if on else None,
        }

    def load(self, disp) -> None:
        """Give ``disp`` the resume point's dispatcher state (before ``serve()``), if resuming,
        with its folder: a checkpoint off the grid also holds the scheduler and the worker
        caches (NOTE [warm resume] in herald/dispatch/warm.py); one that cannot be used
        (other settings) is said on stderr, and the job resumes from empty caches."""
        if self.resume_state is not None:
            disp.load_state_dict(self.resume_state, folder=str(self.resume.path))
            cold = getattr(disp, "warm", None)
            if cold is not None and cold.cold is not None:
                print(
                    f"{self._who} --resume: {self.resume.path.name} holds the warm caches of a job stopped off "
                    f"the checkpoint grid, not used ({cold.cold}); resuming from empty caches: the model is "
                    "not bit for bit an uninterrupted run's",
                    file=sys.stderr,
                )
