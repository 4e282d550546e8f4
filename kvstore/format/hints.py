"""What a client may tell the store about a paused session: its resume hint."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.format.errors import InvalidRequest


@dataclass(frozen=True)
class ResumeHint:
    """What an agent framework knows about a paused session.

    ``expected_pause_s``: seconds from the last access until the session is expected
    back (None: unknown). ``priority``: higher is more valuable; a lower-priority block
    is always evicted before a higher-priority one.
    """

    expected_pause_s: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        pause = self.expected_pause_s
        if pause is not None and (not math.isfinite(pause) or pause < 0):
            raise InvalidRequest(f"expected_pause_s must be finite and >= 0, got {pause}")
        if not isinstance(self.priority, int):
            raise InvalidRequest(f"priority must be an int, got {self.priority!r}")
