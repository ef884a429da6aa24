"""The contracts layer: what every part of a job agrees on (docs/design.md, "Layers").

It sits at the bottom of the import graph: it imports nothing of herald above it
(:mod:`herald.config` and :mod:`herald.errors` only; numpy for the plan and the
micro-batch) and no numba, torch or zmq (forbidden contracts in pyproject.toml), so
that ``herald train`` refuses a bad option before anything heavy loads.

- :mod:`herald.contracts.vocab`: every vocabulary (schedules, optimizers, consistency modes,
  wire dtypes, cache policies, devices, models) and default (timeouts, limits), once.
- :mod:`herald.contracts.tables`: :class:`TableConfig`, :class:`OptimizerConfig`.
- :mod:`herald.contracts.consistency`: what every mode's settings share (``ModeSettings``,
  ``ModeContext``) and straggler injection (``Straggler``).
- :mod:`herald.contracts.comm`, :mod:`herald.contracts.settings`: the groups of settings a job
  nests (compression, training groups; scheduling, cache, embeddings, dense, recovery,
  security, launcher), each validating itself.
- :mod:`herald.contracts.models`: what each ``--model`` needs of a job (tables, embedding dim), once.
- :mod:`herald.contracts.modes`: the registry of the consistency modes, one entry and one
  settings class each; each role above keeps its own registry of what it runs
  (docs/consistency.md, "Adding a mode").
- :mod:`herald.contracts.train`: :class:`TrainConfig`, the user's settings of a job.
- :mod:`herald.contracts.job`: :class:`JobSpec`, the versioned contract sent to every worker.
- :mod:`herald.contracts.flags`: errors worded in ``herald train``'s flags.
- :mod:`herald.contracts.plan`: the cache plan (``KeySet``, ``CachePlan``, NOTE [step
  protocol]) the scheduler writes and the worker executes.
- :mod:`herald.contracts.microbatch`: the micro-batch's layout and wire codec (``MicroBatch``,
  NOTE [micro-batch layout]) the dispatcher sends and the worker reads; the dispatcher's
  builder is :mod:`herald.dispatch.microbatch`.
"""

from herald.lazy import lazy_exports

# Names are imported on first use (PEP 562, herald/lazy.py).
_EXPORTS = {
    "JobSpec": "job",
    "TrainConfig": "train",
    "auto_model": "train",
    "TableConfig": "tables",
    "OptimizerConfig": "tables",
    "check_tables": "tables",
    "tables_from_json": "tables",
    "tables_to_json": "tables",
}
_SUBMODULES = (
    "comm",
    "consistency",
    "flags",
    "job",
    "microbatch",
    "models",
    "modes",
    "plan",
    "settings",
    "tables",
    "train",
    "vocab",
)

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), _SUBMODULES)
