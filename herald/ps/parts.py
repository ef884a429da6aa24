"""The parts of a request, checked: NOTE [ps wire protocol] (docs/ps.md).

A pull or push carries its keys in parts (``header["parts"]``): per-table parts
``{"table": t}`` and flat parts ``{"flat": true}`` (their first frame: the table of every
key), each followed by the op's frames (:data:`herald.ps.wire.PART_FRAMES`; compressed:
NOTE [wire compression]; clock frames: NOTE [clock frames]). :class:`PartParser` checks them
against the shard's tables and limits and hands each op its :class:`Part` s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from herald.errors import ProtocolError
from herald.ps import compress, wire
from herald.ps.config import ShardLimits
from herald.ps.directory import TableDirectory
from herald.ps.store import frozen

#: Parts of one request at most.
MAX_PARTS = 1024


class Part:
    """One part of a pull or push, its frames checked: ``tables`` (uint16 [n], table
    positions), ``keys`` (uint64 [n]) and the part's other arrays ``rest`` (float32
    gradients or rows, contributors, a widened clock frame), the ``dim`` and ``width`` of
    its first key's table (the kernels check every key's: NOTE [ps wire protocol]) and the
    part map it came as (``echo``)."""

    __slots__ = ("tables", "keys", "rest", "dim", "width", "echo")

    def __init__(self, tables, keys, rest, dim, width, echo):
        self.tables, self.keys, self.rest = tables, keys, rest
        self.dim, self.width, self.echo = dim, width, echo


class PartParser:
    """Checks the parts of a shard's requests.

    Args:
        tables: the shard's declared tables (a list the shard appends to; each with ``cfg``
            and ``width``). directory: their directory (a one-table part's tables frame).
        limits: NOTE [ps limits] (``max_keys_per_request``).
    """

    def __init__(self, tables: list, directory: TableDirectory, limits: ShardLimits):
        self.tables, self.directory, self.limits = tables, directory, limits

    def parse(
        self, header: dict[str, Any], arrays: list, op: str, clock: str | None = None, wire_dtype: str = "fp32"
    ) -> list[Part]:
        """Check ``parts`` against the arrays (NOTE [ps wire protocol]): per-table parts
        ``{"table": t}`` and flat parts ``{"flat": true}`` (their first frame: the table of
        every key); compressed frames (``wire_dtype``, NOTE [wire compression]) are decoded.
        ``clock``: each part ends with that clock frame (NOTE [clock frames]), given back
        widened to uint64: ``clocks`` (a conditional pull: at most n) or ``advance`` (exactly
        n). Every key's table, shape and shard are checked by the op's kernel.

        Raises:
            ProtocolError: bad parts, frame counts, dtypes or shapes, more keys than
                ``max_keys_per_request``, a table in two parts of a push.
        """
        parts = header.get("parts")
        spec = wire.PART_FRAMES[op]
        if (
            clock is None
            and (wire_dtype == "fp32" or op == "pull")
            and type(parts) is list
            and len(parts) == 1
            and type(parts[0]) is dict
            and len(parts[0]) == 1
            and parts[0].get("flat") is True
            and len(arrays) == len(spec) + 1
        ):  # what PSClient sends: one flat part
            p = self.part(op, spec, parts[0], arrays[0], arrays[1:])
            if p.keys.shape[0] > self.limits.max_keys_per_request:
                self._too_many(op, p.keys.shape[0])
            return [p]
        out = self._parts(parts, arrays, op, spec, clock, wire_dtype)
        if op != "pull" and len(out) > 1:
            seen: set[int] = set()
            for p in out:
                ts = set(np.unique(p.tables).tolist())
                if ts & seen:
                    raise ProtocolError(f"{op}: table {min(ts & seen)} appears in two parts; merge them")
                seen |= ts
        return out

    def _parts(
        self, parts: object, arrays: list, op: str, spec: tuple, clock: str | None, wire_dtype: str
    ) -> list[Part]:
        """:meth:`parse` of any parts but one flat part of plain frames."""
        if not isinstance(parts, list) or len(parts) > MAX_PARTS:
            raise ProtocolError(f"{op}: header 'parts' must be a list of at most {MAX_PARTS} maps")
        base = len(spec) if wire_dtype == "fp32" or op == "pull" else len(wire.COMPRESSED_PART_FRAMES[op])
        extra = clock is not None
        sizes = []
        for k, part in enumerate(parts):
            if type(part) is not dict or (part.get("flat") is not True) == ("table" not in part):
                raise ProtocolError(f"{op}: part {k} must be a map {{'table': index}} or {{'flat': true}}")
            sizes.append(base + extra + ("table" not in part))
        if len(arrays) != sum(sizes):
            raise ProtocolError(f"{op}: {len(parts)} parts need {sum(sizes)} frames, got {len(arrays)}")
        out, n_keys, at = [], 0, 0
        for k, part in enumerate(parts):
            frames = arrays[at : at + sizes[k]]
            at += sizes[k]
            flat = "table" not in part
            tables = frames[0] if flat else None
            ops = frames[flat : sizes[k] - extra]
            if base != len(spec):
                ops = compress.decode_part(op, ops, wire_dtype)
            p = self.part(op, spec, part, tables, ops)
            if extra:
                p.rest.append(
                    frozen(
                        wire.unpack_clocks(
                            frames[-1], f"{op} {clock} of part {k}", p.keys.shape[0], prefix=clock == "clocks"
                        )
                    )
                )
            n_keys += p.keys.shape[0]
            out.append(p)
        if n_keys > self.limits.max_keys_per_request:
            self._too_many(op, n_keys)
        return out

    def _too_many(self, op: str, n_keys: int) -> None:
        raise ProtocolError(
            f"{op}: {n_keys} keys in one request exceed this shard's max_keys_per_request="
            f"{self.limits.max_keys_per_request}; send fewer keys per request (PSClient "
            "splits by the limit the shards announce) or raise --max-keys-per-request"
        )

    def part(self, op: str, spec: tuple, part: dict, tables, frames: list) -> Part:
        """One part's frames (``tables`` uint16 [n] of a flat part, None for a per-table
        one; then the op's frames): dtypes and shapes (against its first key's table);
        arrays frozen (one kernel variant each: :func:`~herald.ps.store.frozen`).

        Raises:
            ProtocolError: a frame of another dtype or shape, an unknown table.
        """
        for (name, dt), a in zip(spec, frames):
            if a.dtype != dt:  # not a.dtype.str: that builds a string
                raise ProtocolError(f"{op}: {name} must be {dt}, got {a.dtype.str}")
        keys = frames[0]
        if keys.ndim != 1:
            raise ProtocolError(f"{op}: keys must be 1-d, got shape {keys.shape}")
        n = keys.shape[0]
        n_tables = len(self.tables)
        if tables is None:  # a per-table part
            ti = part.get("table")
            if type(ti) is not int or not 0 <= ti < n_tables:
                raise ProtocolError(
                    f"{op}: unknown table {ti!r}; this shard has {n_tables} tables (declare them first)"
                )
            tables = self.directory.positions(ti, n)
        else:
            if tables.dtype != wire.TABLES_DTYPE or tables.shape != (n,):
                raise ProtocolError(
                    f"{op}: the tables frame of a flat part must be {wire.TABLES_DTYPE} [{n}], "
                    f"got {tables.dtype.str} {tables.shape}"
                )
            ti = int(tables[0]) if n else -1
            if ti >= n_tables:
                raise ProtocolError(f"{op}: unknown table {ti}; this shard has {n_tables} tables (declare them first)")
            tables = frozen(tables)
        if ti >= 0:
            dim, width = self.tables[ti].cfg.dim, self.tables[ti].width
        else:  # no keys: nothing to check
            dim = width = next((a.shape[1] for a in frames[1:] if a.ndim == 2), 0)
        for (field, _), a in zip(spec[1:], frames[1:]):
            want = (n, dim) if field == "grads" else (n, width) if field == "rows" else (n,)
            if a.shape != want:
                name = repr(self.tables[ti].cfg.name) if ti >= 0 else "(none)"
                raise ProtocolError(f"{op}: {field} of table {name} must have shape {want}, got {a.shape}")
        return Part(tables, frozen(keys), [frozen(a) for a in frames[1:]], dim, width, part)
