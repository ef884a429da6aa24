"""The PS's registry of the consistency modes: each mode's op sets.

One entry per mode of :data:`herald.contracts.vocab.CONSISTENCY_MODES`, keyed by its name
(its settings class's: :mod:`herald.contracts.modes`): the :class:`OpSet` s of NOTE [ps wire
protocol] that the mode's workers and dispatcher send. An op set is the ops of one
responsibility, served by one handler (herald/ps/handler.py) of :class:`ShardOps`. A shard
serves every mode at once (a job switches between bsp and gba at a checkpoint, NOTE [gba
checkpoints] in herald/dispatch/gba.py, without new shards), so
:meth:`ShardOps.handlers` gives the handler of every op set some mode names, once each;
the admin ops every job sends (:class:`~herald.ps.ops_admin.AdminOps`) are the server's.
A new mode adds its entry here, and a new op set its handler to :class:`ShardOps`
(docs/consistency.md, "Adding a mode"); tests/contracts/test_modes.py checks that the
entries name exactly the vocabulary's modes and that the op sets and the admin ops serve
every op of :data:`herald.ps.wire.OPS` once.
"""

from __future__ import annotations

import dataclasses

from herald.contracts.modes import BoundedSettings, BspSettings, GbaSettings, HybridSettings
from herald.ps.context import ShardContext
from herald.ps.gba import GbaOps
from herald.ps.handler import Handler
from herald.ps.ops_clocked import ClockedOps
from herald.ps.ops_rows import RowOps
from herald.ps.stepped import StepOps


@dataclasses.dataclass(frozen=True)
class OpSet:
    """The ops of one responsibility of a shard.

    Attributes:
        name: the set's name: the attribute of :class:`ShardOps` holding its handler.
        ops: the ops of :data:`herald.ps.wire.OPS` its handler serves (its ``ops()``).
    """

    name: str
    ops: frozenset[str]


#: ``pull``, ``push_grad``, ``push_rows`` (herald/ps/ops_rows.py), with their clocked variants
#: (a pull with ``staleness``, a push_rows with ``advance`` frames: NOTE [clock frames]).
ROWS = OpSet("rows", frozenset({"pull", "push_grad", "push_rows"}))
#: ``step``: one message per worker per shard per step (NOTE [step messages] in herald/ps/stepped.py).
STEPS = OpSet("steps", frozenset({"step"}))
#: ``gba_push``, ``gba_pull``: the token-gated gradient buffer (NOTE [gba tokens] in herald/ps/gba.py).
GBA = OpSet("gba", frozenset({"gba_push", "gba_pull"}))

#: Each mode's op sets, by mode name.
OP_SETS: dict[str, tuple[OpSet, ...]] = {
    # the step messages, and the row ops for the writes and pulls beyond max_keys_per_request
    # and for a flush's write-backs (NOTE [step messages])
    BspSettings.name: (ROWS, STEPS),
    # as bsp at s = 0; above it the clocked pulls and write-backs of NOTE [bounded reads]
    BoundedSettings.name: (ROWS, STEPS),
    # the workers' plain pulls, the embedding worker's gradient pushes (NOTE [hybrid training])
    HybridSettings.name: (ROWS,),
    GbaSettings.name: (GBA,),  # NOTE [gba tokens]
}


class ShardOps:
    """The op handlers of one shard, one per :class:`OpSet`, over its context ``ctx``.

    Attributes:
        rows: :data:`ROWS`' (:class:`~herald.ps.ops_rows.RowOps`, its clocked variants
            :class:`~herald.ps.ops_clocked.ClockedOps`).
        steps: :data:`STEPS`' (:class:`~herald.ps.stepped.StepOps`; it applies a message's
            sections through ``rows``).
        gba: :data:`GBA`' (:class:`~herald.ps.gba.GbaOps`).
    """

    def __init__(self, ctx: ShardContext):
        self.rows = RowOps(ctx, ClockedOps(ctx))
        self.steps = StepOps(ctx, self.rows)
        self.gba = GbaOps(ctx)

    def handlers(self) -> list[Handler]:
        """The handler of every op set of :data:`OP_SETS`, once each, in the order first named."""
        names = dict.fromkeys(s.name for sets in OP_SETS.values() for s in sets)
        return [getattr(self, name) for name in names]
