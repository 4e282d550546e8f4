"""The events a store's parts tell each other: one protocol, one implementation.

A part that learns something another part must hear of (a tier dropped a block, a chunk
is referenced again, a free made room) tells its ``StoreEvents``; the implementation
(``kvstore.session.context.Wiring``) is the one place that says who hears of what. So no
part holds another part's callbacks, and the parts can be built in any order.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Protocol


class Residency(Protocol):
    """Told when a tier starts or stops being believed to hold a block."""

    def held(self, j: int, key: str, size: int) -> None: ...

    def dropped(self, j: int, key: str) -> None: ...


class StoreEvents(Protocol):
    def is_referenced(self, key: str) -> bool:
        """Whether a manifest (or a spill in flight) references chunk ``key``."""

    def is_held(self, key: str) -> bool:
        """Whether some tier is believed to hold ``key``."""

    def window_tier(self, key: str) -> str | None:
        """The highest tier holding window blob ``key``, None when none does."""

    def evict_first(self, j: int, skip: Collection[str]) -> str | None:
        """A retained chunk of tier ``j`` (not in ``skip``) to evict before the tier's
        policy is asked, or None."""

    def first_size(self, key: str) -> int:
        """The bytes of a chunk ``evict_first`` named (0: unknown)."""

    def gone(self, key: str) -> None:
        """Block ``key`` left its last tier."""

    def unmarked(self, key: str) -> None:
        """``key`` is no longer retained: its retention mark may be deleted."""

    def revived(self, keys: Iterable[str]) -> None:
        """``keys`` are referenced again by a committed manifest."""

    def freed(self) -> None:
        """A free deleted chunks: room came back."""

    async def make_room(self, size: int) -> None:
        """A metadata commit met a full medium: give back about ``size`` bytes."""

    def retained_bytes(self) -> Mapping[str, int]:
        """Bytes of retained chunks per dedupe domain."""


class Keeper(Protocol):
    """What decides, as a chunk's last reference goes, whether it stays as cache
    (``kvstore.prefix.chains.Retention``)."""

    def keep(self, keys: Iterable[str], scope: str = "",
             sizes: Mapping[str, int] | None = None) -> list[str]:
        """Keep the held ones of ``keys``; returns the ones to free now."""

    def retained(self, key: str) -> bool:
        """Whether ``key`` is kept as cache now (held, unreferenced)."""
