"""Markdown tables of the bench reports."""

from __future__ import annotations


def print_head(columns: str, *, lead: str = "\n") -> None:
    """Print a markdown table's head: ``lead`` (default a blank line before the table), the
    row ``| a | b |`` of ``columns`` (``"a | b"``) and its rule ``|---|---|``, one rule cell per column."""
    print(f"{lead}| {columns} |")
    print("|---" * (columns.count(" | ") + 1) + "|")
