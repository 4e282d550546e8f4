"""What a restore of a backup verified, and the error that carries it when it lost data."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.format.errors import DataLoss


@dataclass
class Verified:
    sessions: int = 0
    chunks_verified: int = 0
    corrupt: list[str] = field(default_factory=list)  # "key (tier): reason"
    missing: list[str] = field(default_factory=list)  # "tenant/session: key"


class Lost(DataLoss):
    """A restore found corrupt or missing chunks: nothing was restored."""

    def __init__(self, result: Verified) -> None:
        super().__init__(f"{len(result.corrupt)} corrupt, {len(result.missing)} missing")
        self.result = result
