"""Options, progress hooks and the final report of the compaction job (``compaction.job``)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstore.format.errors import InvalidRequest

log = logging.getLogger("kvstore.compaction.job")

MiB = 1 << 20
DEMOTED_PREFIX = "demoted/"  # MetaStore: where a compaction moved an idle session
QUARANTINE_PREFIX = "quarantine/"  # MetaStore: sessions that referenced a corrupt chunk


def demoted_key(tenant: str, session_id: str) -> str:
    return f"{DEMOTED_PREFIX}{tenant}/{session_id}"


def quarantine_key(tenant: str, session_id: str) -> str:
    return f"{QUARANTINE_PREFIX}{tenant}/{session_id}"


@dataclass(frozen=True)
class CompactOptions:
    dry_run: bool = False
    ttl_s: float | None = None  # idle longer than this: expired (besides a session's own TTL)
    demote_after_s: float | None = None  # idle longer than this: demoted to the object tier
    zstd_level: int = 3  # object tier compression of demoted chunks (offline runs)
    dead_fraction: float = 0.25  # a sealed segment at or above this is rewritten
    group_bytes: int = 64 * MiB  # live bytes rewritten per switch transaction
    scrub: bool = True
    # Wall-clock time idleness and TTLs are judged at (None: when the run starts); a later
    # one previews, with dry_run, what a run then would expire and demote.
    as_of: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttl_s", "demote_after_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidRequest(f"{name} must be >= 0, got {value}")
        if not 0.0 <= self.dead_fraction <= 1.0:
            raise InvalidRequest(f"dead_fraction must be in [0, 1], got {self.dead_fraction}")
        if not -7 <= self.zstd_level <= 22:
            raise InvalidRequest(f"zstd_level must be in [-7, 22], got {self.zstd_level}")
        if self.group_bytes <= 0:
            raise InvalidRequest(f"group_bytes must be > 0, got {self.group_bytes}")


COMPACT_PRESETS = {
    "default": CompactOptions(),
    # Every segment with any dead byte; for a final pass before archiving a directory.
    "thorough": CompactOptions(dead_fraction=0.0),
}


@dataclass
class CompactionReport:
    mode: str = ""  # "offline", "live" or "dry-run"
    live_bytes: int = 0  # record bytes the index names after the run
    dead_bytes_before: int = 0
    reclaimed_bytes: int = 0
    sessions_expired: int = 0
    chunks_collected: int = 0
    sessions_demoted: int = 0
    corrupt_chunks: int = 0
    seconds: float = 0.0
    raw_write_gbps: float | None = None  # a plain sequential write + fsync, same volume
    rewrite_gbps: float | None = None
    segments_rewritten: int = 0
    rewritten_bytes: int = 0
    expired: list[str] = field(default_factory=list)  # tenant/session
    demoted: list[str] = field(default_factory=list)
    corrupt_keys: list[str] = field(default_factory=list)
    marked_sessions: list[str] = field(default_factory=list)  # referenced a corrupt chunk
    skipped: list[str] = field(default_factory=list)  # steps not done, and why

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        """The human-readable summary."""
        verb = "would reclaim" if self.mode == "dry-run" else "reclaimed"
        out = [
            f"compaction ({self.mode}) in {self.seconds:.2f} s",
            f"  segments: {self.segments_rewritten} rewritten, {verb} "
            f"{self.reclaimed_bytes} B of {self.dead_bytes_before} B dead; "
            f"{self.live_bytes} B live",
            f"  sessions: {self.sessions_expired} expired, {self.sessions_demoted} demoted; "
            f"{self.chunks_collected} chunks collected",
            f"  scrub: {self.corrupt_chunks} corrupt chunks, "
            f"{len(self.marked_sessions)} sessions marked",
        ]
        if self.rewrite_gbps is not None and self.raw_write_gbps:
            out.append(f"  rewrite {self.rewrite_gbps:.3f} GB/s vs raw sequential write "
                       f"{self.raw_write_gbps:.3f} GB/s "
                       f"({self.rewrite_gbps / self.raw_write_gbps:.2f}x)")
        out += [f"  marked: {name}" for name in self.marked_sessions]
        out += [f"  skipped: {why}" for why in self.skipped]
        return out


class Step(Protocol):
    def advance(self, count: int = 1) -> None: ...

    def close(self) -> None: ...


class Progress(Protocol):
    """What the job tells its caller as it goes (a tqdm bar, log lines, nothing)."""

    def step(self, name: str, total: int) -> Step: ...


class LogProgress:
    """One log line when a step starts and one when it ends."""

    def step(self, name: str, total: int) -> Step:
        return _LogStep(name, total)


class _LogStep:
    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done = name, total, 0
        log.info("%s: %d to do", name, total)

    def advance(self, count: int = 1) -> None:
        self.done += count

    def close(self) -> None:
        log.info("%s: %d of %d done", self.name, self.done, self.total)
