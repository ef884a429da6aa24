"""``herald`` subcommands of :mod:`herald.ps`; see :mod:`herald.cli`."""

from __future__ import annotations


def register(commands, bench, serve) -> None:
    """Add this subpackage's parsers to the herald command groups."""
