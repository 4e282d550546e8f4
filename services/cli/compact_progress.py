"""tqdm progress bars for ``kvtier compact`` on a terminal (one bar per step)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class BarProgress:
    def step(self, name: str, total: int) -> tqdm:
        return _Bar(total=total, desc=name, file=sys.stderr, unit="item", leave=True)


class _Bar(tqdm):
    def advance(self, count: int = 1) -> None:
        self.update(count)
