"""A clock the test moves: code under test takes it where it would read the wall clock,
so TTLs run out exactly when the test says, not when a sleep happens to end."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
