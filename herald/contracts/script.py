"""``herald train --script FILE [-- ARGS]``: the user's own training script run as every
worker of a job (:class:`ScriptSettings`; docs/job.md, "Your own script").

Imports no numba/torch/zmq package (see herald/contracts/train.py).
"""

from __future__ import annotations

import dataclasses

from herald.config import require, setting


@dataclasses.dataclass(frozen=True)
class ScriptSettings:
    """The training script every worker of a ``herald train`` job runs instead of herald's
    own loop (herald/worker/script.py runs it; the path's kind is checked on the host
    before anything starts: :func:`herald.job.cli.check_job_inputs`).

    Attributes:
        path: the script's file (``--script``), or None: herald's own training loop.
        args: its command-line arguments, ``sys.argv[1:]`` of the script (what follows
            ``--`` on ``herald train``'s command line, and each ``--script-arg``).

    Raises:
        ConfigError: an empty path, arguments that are not strings, or arguments without a script.
    """

    path: str | None = setting(
        None,
        "run this Python file as every worker (the job's PS shards and dispatcher as usual); it "
        "trains with ScheduledLoader.connect(), which reads the job from the environment; "
        "what follows -- on the command line is its arguments (docs/job.md, Your own script)",
        metavar="FILE",
        dest="script",
    )
    args: tuple[str, ...] = setting(
        (),
        "an argument of --script's file, after those that follow --; repeatable",
        action="append",
        type=str,
        metavar="ARG",
        dest="script_args",
        flag="--script-arg",
    )

    def __post_init__(self) -> None:
        if isinstance(self.args, list):  # a saved config's JSON (lists for tuples)
            object.__setattr__(self, "args", tuple(self.args))
        require(
            self.path is None or (isinstance(self.path, str) and self.path.strip() != ""),
            f"--script must be a path to a Python file, got {self.path!r}",
        )
        require(
            isinstance(self.args, tuple) and all(isinstance(a, str) for a in self.args),
            f"--script's arguments must be strings, got {self.args!r}",
        )
        require(
            self.path is not None or not self.args,
            f"arguments {list(self.args)[:3]!r} given for no script: pass --script FILE before -- ARGS",
        )
