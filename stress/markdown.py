"""Markdown for the REPORT.md sections (the campaigns' and ``bench.report``'s)."""

from __future__ import annotations


def table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table, one line per row; cells as ``str`` writes them."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
