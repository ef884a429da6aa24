"""GBA's gradient buffer on a PS shard and its two ops, ``gba_push`` and ``gba_pull``
(:class:`GbaOps`; the worker side: herald/worker/consistency_gba.py).

NOTE [gba tokens]
~~~~~~~~~~~~~~~~~
GBA trains asynchronously with the synchronous global batch (GBA §4.1,
Fig. 5): the dispatcher cuts every global batch ``G`` into ``M`` micro-batches of
``B_a = G / M`` samples (the *data list*); micro-batch ``i`` carries the token
``tau = i // M`` (the *token list*: each value repeats ``M`` times, in ascending order),
the global step at which its batch is handed out when nobody lags. Workers ask for the
next micro-batch when they finish one (herald/dispatch/gba.py): fast workers take more
tokens, nobody waits for a peer.

Every micro-batch pulls its rows from the PS (no worker cache, no communication plan:
GBA is PS-based) and pushes exactly one ``gba_push`` to *every* shard, possibly empty,
with its token, so that every shard counts the same contributions. Each shard holds a
:class:`GradientBuffer` of capacity ``M``; when the ``M``-th contribution arrives at
global step ``k`` the shard keeps those with ``f(tau, k) = 1`` of eq. (1),
``k - tau <= iota`` (``iota`` = ``--gba-threshold``), drops the others (counted), sums
the kept gradients per key (in (token, slot) order: the result does not depend on the
arrival order), applies the table's optimizer once and sets ``k += 1``. A contribution
is applied at the global step current when it arrives (the buffer only advances when
it is full), so its staleness ``k - tau`` is known on arrival and sent back.

Dense parameters are aggregated by the same buffer (no all-reduce among workers, which
would make the fast ones wait): shard 0's contributions carry the micro-batch's dense
gradient, float32 [P]; at each global step shard 0 logs the sum of the kept ones (or
none when all were dropped). Every worker replays that log in global-step order with
the job's own torch optimizer (herald/worker/consistency_gba.py), so its dense replica
is exactly the single replica a PS would hold after ``k`` applications, whatever the
optimizer (SGD, Adagrad, Adam with torch's own arithmetic; reimplementing them on the
PS would be a second, diverging copy). The log keeps :data:`DENSE_LOG_STEPS` steps.

Reads are gated: a ``gba_pull`` with token ``tau`` is answered once the shard's global
step ``k >= tau - iota``; before that the shard replies ``ready: false`` and the worker
asks again (bounded by the PS timeout). With ``iota = 0`` this is exactly BSP, whatever
``M`` and whoever lags (a straggler then slows everyone, as in BSP): a push of token
``tau`` arrives at a step ``>= tau`` (its pull waited for ``tau``), so by induction step
``k`` aggregates exactly the ``M`` gradients of token ``k``, and every micro-batch of
token ``k`` reads the rows and dense parameters of global step ``k`` (step ``k`` cannot
complete before its own push) (tests/integration/test_gba.py). The gate also bounds how
far a fast worker reads ahead (``iota + 1`` tokens). No deadlock: tokens are handed out
in order, so while step ``k`` waits for a contribution, a micro-batch of token ``<= k``
is held by a worker whose pull is not gated.

Gradients are divided by ``M`` on the worker (each micro-batch's loss is its mean), so
the sum of ``M`` fresh contributions is the gradient of the global batch's mean loss,
as in BSP (docs/design.md, "Loss scaling"); dropped ones are not replaced.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from herald.errors import ProtocolError
from herald.ps import wire
from herald.ps.context import ShardContext
from herald.ps.handler import Handler, Op, answering

#: Global steps of aggregated dense gradients shard 0 keeps for workers to replay.
DENSE_LOG_STEPS = 1024
#: Largest buffer capacity M (contributions per global step).
MAX_CAPACITY = 4096
#: Largest staleness threshold iota.
MAX_THRESHOLD = 1 << 20
#: Largest token (global step).
MAX_TOKEN = 1 << 62


@dataclasses.dataclass
class Contribution:
    """One micro-batch's gradients at one shard.

    Attributes:
        token: its token tau (global batch index); slot: its index in the global batch (0..M-1).
        rank: the worker that computed it.
        parts: ``[(table index, keys uint64 [n] unique, grads float32 [n, dim])]``.
        dense: float32 [P] dense gradient (shard 0), or None.
    """

    token: int
    slot: int
    rank: int
    parts: list[tuple[int, np.ndarray, np.ndarray]]
    dense: np.ndarray | None = None


class GradientBuffer:
    """GBA's gradient buffer of one shard (NOTE [gba tokens]; GBA §4.1, eq. (1)).

    Args:
        capacity: M, contributions aggregated per global step (1..:data:`MAX_CAPACITY`).
        threshold: iota: a contribution of token tau applied at global step k is kept iff
            ``k - tau <= iota`` (0..:data:`MAX_THRESHOLD`).
        apply: ``apply(table index, keys uint64 [n] unique, grads float32 [n, dim])``:
            the table's optimizer, once per key per global step.
        dense_log_steps: global steps of aggregated dense gradients kept.
        start_step: the global step the buffer starts at: the job's first global step (a
            job resumed from a checkpoint starts at the checkpoint's next step, NOTE [gba
            checkpoints]), 0..2**62.

    Attributes:
        global_step: k, the number of global steps applied.
        counters: ``contributions``, ``kept``, ``dropped``, ``staleness_sum`` and
            ``staleness_max`` (over every contribution, ``max(0, k - tau)``), ``applied_steps``.
        history: the last 256 applied steps as ``(k, contributions, dropped)``.

    Raises:
        ProtocolError: bad capacity, threshold or start step.
    """

    def __init__(
        self,
        capacity: int,
        threshold: int,
        apply: Callable[[int, np.ndarray, np.ndarray], Any],
        dense_log_steps: int = DENSE_LOG_STEPS,
        start_step: int = 0,
    ):
        if type(capacity) is not int or not 1 <= capacity <= MAX_CAPACITY:
            raise ProtocolError(f"gba: the buffer capacity M must be an int in 1..{MAX_CAPACITY}, got {capacity!r}")
        if type(threshold) is not int or not 0 <= threshold <= MAX_THRESHOLD:
            raise ProtocolError(f"gba: the threshold iota must be an int in 0..{MAX_THRESHOLD}, got {threshold!r}")
        if type(start_step) is not int or not 0 <= start_step <= MAX_TOKEN:
            raise ProtocolError(f"gba: the start step must be an int in 0..{MAX_TOKEN}, got {start_step!r}")
        self.capacity, self.threshold, self._apply = capacity, threshold, apply
        self.start_step = self.global_step = start_step
        self._entries: list[Contribution] = []
        self._received: dict[int, set[int]] = {}  # token -> slots received, for tokens >= _complete_below
        self._complete_below = start_step  # every slot of every smaller token was received
        self._dense_size: int | None = None
        self._dense_log: collections.OrderedDict[int, tuple[np.ndarray, int] | None] = collections.OrderedDict()
        self._dense_log_steps = int(dense_log_steps)
        self.counters: collections.Counter = collections.Counter()
        self.history: collections.deque = collections.deque(maxlen=256)

    # ------------------------------------------------------------ settings
    def check_settings(self, capacity: object, threshold: object, start_step: object = None) -> None:
        """Raise :class:`ProtocolError` unless a request's ``m``, ``iota`` (and ``base``, when
        given) are this buffer's."""
        if capacity != self.capacity or threshold != self.threshold:
            raise ProtocolError(
                f"gba: this shard aggregates M={self.capacity} with iota={self.threshold}; a request "
                f"with M={capacity!r}, iota={threshold!r} is rejected (one job per shard: restart "
                "the shards to change --gba-buffer or --gba-threshold)"
            )
        if start_step is not None and start_step != self.start_step:
            raise ProtocolError(
                f"gba: this shard's global steps started at {self.start_step}; a request of a job "
                f"started at {start_step!r} is rejected (one job per shard: restart the shards, "
                "NOTE [gba checkpoints])"
            )

    # --------------------------------------------------------------- reads
    def ready(self, token: int) -> bool:
        """Whether a read with ``token`` may be answered: ``global_step >= token - iota``."""
        return self.global_step >= token - self.threshold

    def dense_since(self, since: int) -> tuple[np.ndarray, np.ndarray]:
        """The aggregated dense gradients of global steps ``since .. global_step - 1``:
        float32 [n, P] and uint64 [n] (contributions kept; 0: no update that step).

        Raises:
            ProtocolError: ``since`` is beyond the global step, or older than the log.
        """
        k = self.global_step
        if not 0 <= since <= k:
            raise ProtocolError(f"gba_pull: dense steps since {since} asked, but the global step is {k}")
        oldest = next(iter(self._dense_log), k)
        if since < oldest:
            raise ProtocolError(
                f"gba_pull: dense step {since} is no longer logged (the log keeps the last "
                f"{self._dense_log_steps} global steps, from {oldest}): a worker lagged too far "
                "behind; lower --gba-threshold or remove the straggler"
            )
        size = self._dense_size or 0
        steps = range(since, k)
        grads = np.zeros((len(steps), size), np.float32)
        kept = np.zeros(len(steps), np.uint64)
        for i, s in enumerate(steps):
            g = self._dense_log[s]
            if g is not None:
                grads[i], kept[i] = g[0], g[1]
        return grads, kept

    # -------------------------------------------------------------- writes
    def add(self, c: Contribution) -> dict[str, int]:
        """Buffer one contribution; when it is the M-th, aggregate and apply (global step + 1).

        Returns:
            ``{"global_step": k it is applied at, "staleness": k - tau, "dropped": 0 or 1}``.

        Raises:
            ProtocolError: slot out of range, a (token, slot) received twice, or a dense
                gradient of another size than the earlier ones (nothing is changed then).
        """
        if type(c.slot) is not int or not 0 <= c.slot < self.capacity:
            raise ProtocolError(f"gba_push: slot {c.slot!r} is not in 0..{self.capacity - 1} (M={self.capacity})")
        if c.token < self._complete_below or c.slot in self._received.get(c.token, ()):
            raise ProtocolError(
                f"gba_push: micro-batch (token {c.token}, slot {c.slot}) was already received; "
                "a contribution counts once (NOTE [gba tokens])"
            )
        if c.dense is not None:
            if self._dense_size is not None and c.dense.shape[0] != self._dense_size:
                raise ProtocolError(
                    f"gba_push: a dense gradient of {c.dense.shape[0]} values, earlier ones had "
                    f"{self._dense_size}: every worker must train the same dense model"
                )
            self._dense_size = int(c.dense.shape[0])
        self._mark_received(c.token, c.slot)
        k = self.global_step
        staleness = k - c.token
        dropped = int(staleness > self.threshold)
        self.counters["contributions"] += 1
        self.counters["dropped"] += dropped
        self.counters["kept"] += 1 - dropped
        self.counters["staleness_sum"] += max(0, staleness)
        self.counters["staleness_max"] = max(self.counters["staleness_max"], staleness)
        self._entries.append(c)
        if len(self._entries) == self.capacity:
            self._aggregate()
        return {"global_step": k, "staleness": staleness, "dropped": dropped}

    def _mark_received(self, token: int, slot: int) -> None:
        self._received.setdefault(token, set()).add(slot)
        while len(self._received.get(self._complete_below, ())) == self.capacity:
            del self._received[self._complete_below]
            self._complete_below += 1

    def _aggregate(self) -> None:
        """Eq. (1): keep ``k - tau <= iota``, sum per key in (token, slot) order, apply once."""
        k, entries = self.global_step, self._entries
        self._entries = []
        kept = sorted((e for e in entries if k - e.token <= self.threshold), key=lambda e: (e.token, e.slot))
        self.global_step = k + 1
        self.counters["applied_steps"] += 1
        self.history.append((k, len(entries), len(entries) - len(kept)))
        dense = [e.dense for e in kept if e.dense is not None]
        if self._dense_size is not None:
            total = None
            if dense:
                total = np.zeros(self._dense_size, np.float32)
                for g in dense:
                    total += g
            self._dense_log[k] = None if total is None else (total, len(dense))
            while len(self._dense_log) > self._dense_log_steps:
                self._dense_log.popitem(last=False)
        by_table: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for e in kept:
            for t, keys, grads in e.parts:
                if keys.shape[0]:
                    by_table.setdefault(t, []).append((keys, grads))
        for t in sorted(by_table):
            keys, grads = aggregate_rows(by_table[t])
            self._apply(t, keys, grads)

    @property
    def pending(self) -> int:
        """Contributions buffered for the current global step."""
        return len(self._entries)

    def stats(self) -> dict[str, Any]:
        """Plain-typed counters (for the shard's ``stats``)."""
        return {
            "capacity": self.capacity,
            "threshold": self.threshold,
            "global_step": self.global_step,
            "pending": self.pending,
            **{k: int(v) for k, v in self.counters.items()},
            "history": [list(h) for h in list(self.history)[-16:]],
        }


def aggregate_rows(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sum gradients per key: ``pieces`` of (keys uint64 [n_i] unique, grads float32 [n_i, dim])
    -> (keys uint64 [u] sorted unique, float32 [u, dim] read-only), each key's gradients
    added in the order of ``pieces`` (starting from 0, so one piece is returned exactly)."""
    keys = np.concatenate([k for k, _ in pieces])
    grads = np.concatenate([g for _, g in pieces]).astype(np.float32, copy=False)
    uniq, inverse = np.unique(keys, return_inverse=True)
    out = np.zeros((uniq.shape[0], grads.shape[1]), np.float32)
    np.add.at(out, inverse, grads)
    out.setflags(write=False)  # the kernels' read-only variant (herald/ps/store.py, frozen)
    return uniq, out


# ------------------------------------------------------------------ shard ops
class GbaOps(Handler):
    """``gba_push`` and ``gba_pull`` on one shard (NOTE [gba tokens]).

    Args:
        ctx: the shard's :class:`~herald.ps.context.ShardContext`.

    Attributes:
        buffer: the shard's :class:`GradientBuffer`, made by the first GBA request (None before).
    """

    def __init__(self, ctx: ShardContext):
        self.ctx = ctx
        self.buffer: GradientBuffer | None = None

    def ops(self) -> dict[str, Op]:
        return {"gba_push": answering(self.push), "gba_pull": answering(self.pull)}

    def restored(self) -> None:
        """Drop the buffer (a ``restore``: its global step and buffered contributions belong
        to the rolled-back run; the resumed job's first request makes it again)."""
        self.buffer = None

    def _settings(self, header: dict[str, Any]) -> GradientBuffer:
        """The shard's buffer (made by the first GBA request, at global step ``base``: the
        job's first global step, NOTE [gba checkpoints]), checked against the request's M,
        iota and base."""
        m = wire.get_int(header, "m", 1, MAX_CAPACITY)
        iota = wire.get_int(header, "iota", 0, MAX_THRESHOLD)
        base = wire.get_int(header, "base", 0, MAX_TOKEN) if "base" in header else 0
        if self.buffer is None:
            self.buffer = GradientBuffer(m, iota, self._apply, start_step=base)
        self.buffer.check_settings(m, iota, base)
        return self.buffer

    def _apply(self, t: int, keys: np.ndarray, grads: np.ndarray) -> None:
        """The buffer's apply: the table's optimizer, once per key, at the step just completed."""
        buffer = self.buffer
        if buffer is None:
            raise ProtocolError("gba: the buffer's apply called with no buffer open (only the buffer calls it)")
        table = self.ctx.tables[t]
        ones = np.ones(keys.shape[0], np.uint16)
        self.ctx.counters["rows_updated"] += table.push_grad(keys, grads, ones, buffer.global_step - 1, 0)

    def _table_parts(self, header: dict[str, Any], arrays: list, op: str) -> list:
        """``[(table, keys, other arrays)]`` of a GBA request: per-table parts only (NOTE [ps
        wire protocol]; a flat part is refused)."""
        parts = self.ctx.parts.parse(header, arrays, op)
        if any("table" not in p.echo for p in parts):
            raise ProtocolError(f"{op}: parts must be per-table maps {{'table': index}} (no flat parts)")
        return [(self.ctx.tables[p.echo["table"]], p.keys, p.rest) for p in parts]

    def push(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``gba_push {token, slot, rank, m, iota, base, dense: bool, parts}`` [keys, grads per
        part] [dense float32 [P] if ``dense``]: one micro-batch's contribution to this shard
        (NOTE [gba tokens]). Reply ``{global_step, staleness, dropped}``.

        Raises:
            ProtocolError: malformed, a non-finite gradient, a repeated (token, slot), keys of
                another shard (nothing is changed then).
        """
        buf = self._settings(header)
        token = wire.get_int(header, "token", 0, MAX_TOKEN)
        slot = wire.get_int(header, "slot", 0, MAX_CAPACITY - 1)
        rank = wire.get_int(header, "rank", 0, 1 << 30)
        dense = None
        if header.get("dense") is True:
            if not arrays:
                raise ProtocolError("gba_push: header dense is true but no dense frame was sent")
            dense, arrays = np.array(arrays[-1], np.float32), arrays[:-1]
            if dense.ndim != 1 or not np.isfinite(dense).all():
                raise ProtocolError("gba_push: the dense gradient must be a finite float32 [P] vector")
        out = []
        for table, keys, (grads,) in self._table_parts(header, arrays, "gba_push"):
            if not np.isfinite(grads).all():
                raise ProtocolError(
                    f"gba_push: a gradient of table {table.cfg.name!r} (token {token}, rank {rank}) "
                    "holds NaN or infinity; nothing was stored"
                )
            if np.unique(keys).shape[0] != keys.shape[0]:
                raise ProtocolError(f"gba_push: duplicate keys in table {table.cfg.name!r}; send each key once")
            out.append((table.index, keys, np.array(grads, np.float32)))
            self.ctx.counters["push_grad_keys"] += keys.shape[0]
        return buf.add(Contribution(token, slot, rank, out, dense)), []

    def pull(self, header: dict[str, Any], arrays: list) -> tuple[dict, list]:
        """``gba_pull {token, m, iota, base, since, parts}`` [keys per part]: the rows (float32
        [n, row_width] per part) once ``global_step >= token - iota``, then, with ``since >=
        0``, the dense gradients of steps ``since..global_step - 1`` (float32 [n, P]) and
        their kept counts (uint64 [n]). Before that: ``{ready: false, global_step}`` and no
        frames (ask again).

        Raises:
            ProtocolError: malformed, keys of another shard, ``since`` outside the dense log.
        """
        buf = self._settings(header)
        token = wire.get_int(header, "token", 0, MAX_TOKEN)
        since = wire.get_int(header, "since", -1, MAX_TOKEN)
        parts = self._table_parts(header, arrays, "gba_pull")
        if not buf.ready(token):
            self.ctx.counters["gba_pull_early"] += 1
            return {"ready": False, "global_step": buf.global_step}, []
        out = []
        for table, keys, _ in parts:
            rows, _pending = table.pull(keys)
            self.ctx.counters["pull_keys"] += keys.shape[0]
            out.append(rows)
        if since >= 0:
            out += list(buf.dense_since(since))
        return {"ready": True, "global_step": buf.global_step, "parts": [{"table": t.index} for t, _, _ in parts]}, out
