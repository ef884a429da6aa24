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


def _section_heads(entries: list[tuple]) -> list[dict]:
    """The ``sections`` of one shard's step message: its entries ``(op, frames, ...)`` in order,
    one section per op with its parts counted (NOTE [step messages])."""
    heads: list[dict] = []
    for op, frames, _, _ in entries:
        if heads and heads[-1]["op"] == op:
            heads[-1]["frames"] += len(frames)
            heads[-1]["parts"] = heads[-1].get("parts", 1) + 1
        else:
            heads.append({"op": op, "frames": len(frames)})
    return heads


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
                per_shard[sh].append(("dense", [dense[part]], None, -1))
        rids = []
        for sh in range(self.link.num_shards):
            header = {
                "step": int(step),
                "rank": int(rank),
                "workers": int(workers),
                "sections": _section_heads(per_shard[sh]),
            }
            header = compress.tagged(header, self.rows.wire_dtype)
            rids.append(self.link.send(sh, "step", header, [f for _, fr, _, _ in per_shard[sh] for f in fr]))
        pulls = [k for k, s in enumerate(sections) if s[0] == "pull"]

        def finish(replies):
            replies = replies[len(pre) :]
            for part, (head, arrays) in zip(slices, replies):  # the sum over the ranks: last frame
                if part.stop > part.start:
                    dense[part] = self._dense_of(head, arrays, part.stop - part.start)
            return self._pulled(sections, pulls, replies, per_shard, late) if pulls else None

        return self.link.handle(pre + rids, finish)

    def _sections(self, rows, grads, pull) -> list[tuple]:
        """The sections of a step message with keys: ``[(op, tables, keys, frames_of(positions),
        (shape, positions in the op's keys or None))]``, one per op and table shape (NOTE
        [mixed widths] in herald/ps/router.py: a mixed client's ``rows`` and ``grads`` are padded).

        Raises:
            ConfigError: bad arrays.
        """
        router, front = self.router, self.rows
        sections: list[tuple] = []
        if rows is not None and len(rows[1]):
            tables, keys = router.flat_keys(rows[0], rows[1])
            if not router.mixed:
                sections.append(("push_rows", tables, keys, front.rows_frames(tables, keys, rows[2]), (None, None)))
            else:
                r = router.check_padded(rows[2], keys.shape[0], router.padded_shape[1], "rows")
                for shape, pos in router.shape_groups(tables):
                    t, k = router.take((tables, keys), pos)
                    frames_of = front.rows_frames(t, k, router.columns(r, pos, shape[1]), shape)
                    sections.append(("push_rows", t, k, frames_of, (shape, pos)))
        if grads is not None and len(grads[1]):
            tables, keys = router.flat_keys(grads[0], grads[1])
            if not router.mixed:
                frames_of = front.grad_frames(tables, keys, grads[2], grads[3])
                sections.append(("push_grad", tables, keys, frames_of, (None, None)))
            else:
                g = router.check_padded(grads[2], keys.shape[0], router.padded_shape[0], "gradients")
                c = np.ascontiguousarray(grads[3], np.uint16)
                for shape, pos in router.shape_groups(tables):
                    t, k, cc = router.take((tables, keys, c), pos)
                    frames_of = front.grad_frames(t, k, router.columns(g, pos, shape[0]), cc, shape)
                    sections.append(("push_grad", t, k, frames_of, (shape, pos)))
        if pull is not None and len(pull[1]):
            tables, keys = router.flat_keys(pull[0], pull[1])
            groups: list[tuple] = router.shape_groups(tables) if router.mixed else [(None, None)]
            for shape, pos in groups:
                t, k = router.take((tables, keys), pos)
                sections.append(("pull", t, k, lambda p: [], (shape, pos, keys.shape[0])))
        return sections

    def _split(self, sections: list[tuple], step: int, rank: int) -> tuple[list[int], list[list], list[tuple]]:
        """Each section's first request per shard goes in the shard's step message
        (``per_shard[shard]``: ``[(op, frames, positions, section index)]``); a write's further
        requests (over ``max_keys_per_request``) are sent now, ahead of it on the same
        connection (their ids: ``pre``), and a pull's further ones after the reply (``late``:
        ``[(section index, positions)]``)."""
        pre: list[int] = []
        per_shard: list[list] = [[] for _ in range(self.link.num_shards)]
        late: list[tuple] = []
        for index, (op, tables, keys, frames_of, _) in enumerate(sections):
            seen = set()
            for sh, pos in self.router.route(tables, keys):
                if sh not in seen:
                    seen.add(sh)
                    per_shard[sh].append((op, [*self.router.take((tables, keys), pos), *frames_of(pos)], pos, index))
                elif op == "pull":
                    late.append((index, pos))
                else:  # over max_keys_per_request: ahead of the step message, on the same connection
                    header = {"step": int(step), "rank": int(rank)}
                    pre.append(self.rows.send_flat(op, header, [(sh, pos)], tables, keys, frames_of)[0])
        return pre, per_shard, late

    def _pulled(
        self, sections: list[tuple], pulls: list[int], replies: list, per_shard: list[list], late: list[tuple]
    ) -> np.ndarray:
        """The rows of the pull sections ``pulls`` in key order (padded to the widest row for
        a mixed client: NOTE [mixed widths]): from the step replies, then their ``late`` pulls,
        sent now (after the reply: ordered after the step, NOTE [step messages])."""
        parts: dict[int, list] = {k: [] for k in pulls}
        for (head, arrays), sh_sections in zip(replies, per_shard):
            mine = [(pos, index) for op, _, pos, index in sh_sections if op == "pull"]
            if not mine:
                continue
            decoded = compress.decode_rows(arrays[:-1] if "dense" in head else arrays, compress.wire_of(head))
            if len(decoded) != len(mine):
                raise ProtocolError(f"step reply: {len(decoded)} pull parts for the {len(mine)} sent")
            for (pos, index), rows in zip(mine, decoded):
                parts[index].append((pos, rows, "step reply"))
        out = []
        for index in pulls:
            _, tables, keys, _, (shape, _, _) = sections[index]
            _, width = shape or self.router.shape(tables) or (0, 0)
            rows = self.router.in_key_order(keys.shape[0], width, parts[index])  # one part of every key: zero copy
            for at, pos in late:
                if at == index:
                    wire.put_rows(
                        rows,
                        pos,
                        self.link.handle(*self.rows.pull_op(tables[pos], keys[pos], shape)).wait(),
                        "pull reply",
                    )
            out.append(rows)
        if not self.router.mixed:
            return out[0]
        n = sections[pulls[0]][4][2]
        groups = [sections[k][4][:2] for k in pulls]
        return self.router.padded(n, self.router.padded_shape[1], groups, out)

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
