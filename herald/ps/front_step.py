"""The client side of the step message: one request per worker per shard per step (NOTE
[step messages] in herald/ps/stepped.py, whose shard side is
:class:`~herald.ps.stepped.StepOps`)."""

from __future__ import annotations

import numpy as np

from herald.errors import ProtocolError
from herald.ps import compress, wire
from herald.ps.front_rows import RowFront
from herald.ps.link import ShardLink
from herald.ps.router import KeyRouter
from herald.ps.stepped import dense_slices


class StepFront:
    """The step message of :class:`~herald.ps.client.PSClient` (NOTE [step messages]) over
    ``link``, keys routed by ``router``, its sections' frames made by the row ops ``rows``
    (:class:`~herald.ps.front_rows.RowFront`, which also sends what exceeds a request)."""

    def __init__(self, link: ShardLink, router: KeyRouter, rows: RowFront):
        self.link, self.router, self.rows = link, router, rows

    def step_async(self, step: int, rank: int, workers: int, *, rows=None, grads=None, pull=None, dense=None):
        """Send worker ``rank``'s (of ``workers``) step message for ``step`` to every shard.

        Args:
            rows: ``(tables, keys, rows)`` or None: rows to store (float32 [n, row_width]:
                plan pushes of ``step``, write-backs of the evictions of ``step + 1``); keys unique.
            grads: ``(tables, keys, grads, contributors)`` or None: the gradients of ``step``
                (float32 [n, dim], uint16 [n]; NOTE [ps aggregation]); keys unique.
            pull: ``(tables, keys)`` or None: the pulls of ``step + 1``.
            dense: float32 [P] contiguous and writable, or None: this rank's dense gradient of
                ``step``, summed over the ranks by the shards (NOTE [dense gradients on the
                shards]); every rank of the step must send one of the same P, or none.

        Returns:
            A handle; ``wait()`` gives the pulled rows, float32 [len(pull keys), row_width] in
            key order (read-only when one shard held them all), once every shard has the step
            messages of all ``workers`` ranks (NOTE [step messages]); by then ``dense`` holds the
            sum over the ranks. Do not change the arrays before it returns.

        Raises:
            ConfigError: bad arrays (as the ops' own forms).
        """
        sections = self._sections(rows, grads, pull)
        pre, per_shard, late = self._split(sections, step, rank)
        slices = [] if dense is None else dense_slices(dense.shape[0], self.link.num_shards)
        for sh, part in enumerate(slices):
            if part.stop > part.start:
                per_shard[sh].append(("dense", [dense[part]], None))
        rids = []
        for sh in range(self.link.num_shards):
            header = {
                "step": int(step),
                "rank": int(rank),
                "workers": int(workers),
                "sections": [{"op": op, "frames": len(fr)} for op, fr, _ in per_shard[sh]],
            }
            header = compress.tagged(header, self.rows.wire_dtype)
            rids.append(self.link.send(sh, "step", header, [f for _, fr, _ in per_shard[sh] for f in fr]))
        pulled = next((s for s in sections if s[0] == "pull"), None)

        def finish(replies):
            replies = replies[len(pre) :]
            for part, (head, arrays) in zip(slices, replies):  # the sum over the ranks: last frame
                if part.stop > part.start:
                    dense[part] = self._dense_of(head, arrays, part.stop - part.start)
            return None if pulled is None else self._pulled(pulled, replies, per_shard, late)

        return self.link.handle(pre + rids, finish)

    def _sections(self, rows, grads, pull) -> list[tuple]:
        """The sections of a step message with keys: ``[(op, tables, keys, frames_of(positions))]``.

        Raises:
            ConfigError: bad arrays.
        """
        sections = []
        if rows is not None and len(rows[1]):
            tables, keys = self.router.flat_keys(rows[0], rows[1])
            sections.append(("push_rows", tables, keys, self.rows.rows_frames(tables, keys, rows[2])))
        if grads is not None and len(grads[1]):
            tables, keys = self.router.flat_keys(grads[0], grads[1])
            sections.append(("push_grad", tables, keys, self.rows.grad_frames(tables, keys, grads[2], grads[3])))
        if pull is not None and len(pull[1]):
            tables, keys = self.router.flat_keys(pull[0], pull[1])
            sections.append(("pull", tables, keys, lambda pos: []))
        return sections

    def _split(self, sections: list[tuple], step: int, rank: int) -> tuple[list[int], list[list], list[tuple]]:
        """Each section's first request per shard goes in the shard's step message
        (``per_shard[shard]``: ``[(op, frames, positions)]``); a write's further requests
        (over ``max_keys_per_request``) are sent now, ahead of it on the same connection
        (their ids: ``pre``), and a pull's further ones after the reply (``late``:
        ``[(tables, keys, positions)]``)."""
        pre: list[int] = []
        per_shard: list[list] = [[] for _ in range(self.link.num_shards)]
        late: list[tuple] = []
        for op, tables, keys, frames_of in sections:
            seen = set()
            for sh, pos in self.router.route(tables, keys):
                if sh not in seen:
                    seen.add(sh)
                    per_shard[sh].append((op, [*self.router.take((tables, keys), pos), *frames_of(pos)], pos))
                elif op == "pull":
                    late.append((tables, keys, pos))
                else:  # over max_keys_per_request: ahead of the step message, on the same connection
                    header = {"step": int(step), "rank": int(rank)}
                    pre.append(self.rows.send_flat(op, header, [(sh, pos)], tables, keys, frames_of)[0])
        return pre, per_shard, late

    def _pulled(self, pulled: tuple, replies: list, per_shard: list[list], late: list[tuple]) -> np.ndarray:
        """The rows of the pull section ``pulled`` in key order: from the step replies, then
        its ``late`` pulls, sent now (after the reply: ordered after the step, NOTE [step
        messages])."""
        _, tables, keys, _ = pulled
        _, width = self.router.shape(tables) or (0, 0)  # None: no keys, of tables of several shapes
        parts = [
            (
                pos,
                compress.decode_rows(arrays[:-1] if "dense" in head else arrays, compress.wire_of(head))[0],
                "step reply",
            )
            for (head, arrays), sh_sections in zip(replies, per_shard)
            for op, _, pos in sh_sections
            if op == "pull"
        ]
        out = self.router.in_key_order(keys.shape[0], width, parts)  # one part of every key: zero copy (none late)
        for t, k, pos in late:
            wire.put_rows(out, pos, self.link.handle(*self.rows.pull_op(t[pos], k[pos])).wait(), "pull reply")
        return out

    @staticmethod
    def _dense_of(head: dict, arrays: list, size: int) -> np.ndarray:
        """The dense sum a step reply ends with (NOTE [dense gradients on the shards]).

        Raises:
            ProtocolError: the reply has none, or one of another length.
        """
        if head.get("dense") != size or not arrays or arrays[-1].shape != (size,):
            raise ProtocolError(
                f"step: the reply should end with the dense sum of {size} values; it says {head.get('dense')!r}"
            )
        return arrays[-1]
