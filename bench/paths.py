"""Paths as benchmarks record them: relative to the repository root, so results.json and
REPORT.md say the same on every machine that runs ``make bench``."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def recorded(path: str | Path) -> str:
    """``path`` as seen from the repository root (where ``make bench`` runs)."""
    return os.path.relpath(Path(path).resolve(), ROOT)


def resolved(recorded_path: str) -> Path:
    """The file a recorded path names, wherever the command runs from."""
    return ROOT / recorded_path
