"""The shared-memory naming contract that server and client agree on: where segments
live, the prefix every segment the server creates carries, and what a client accepts as
a segment name (no path, no dot)."""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "kvtier-"  # every segment the server creates; its random part follows
NAME = re.compile(r"^kvtier-[A-Za-z0-9_-]{1,120}$")


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)
