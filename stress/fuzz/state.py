"""What the fuzz campaign's cases are and refer to (``stress.fuzz.cases`` draws them,
``stress.fuzz`` sends them): a ``Case`` is one request as raw bytes, ``State`` what the
run did so far that later cases name."""

from __future__ import annotations

from dataclasses import dataclass, field

from stress.fuzz.pool import Encoded

TENANTS = ("acme", "victim", "evil", "beta")
SESSIONS = tuple(f"f{i}" for i in range(12))


@dataclass
class Case:
    method: str
    family: str
    messages: list[bytes]
    connection: int = 0
    abandon: bool = False  # stream: cancelled after what it sends (or the first reply)
    silent: bool = False  # client stream: sends, then neither sends nor closes
    check: str = ""  # "no_prefix": an OK Lookup reply must hold nothing


@dataclass
class Spilled:
    tenant: str
    session_id: str
    generation: int
    enc: Encoded
    window: bool


@dataclass
class State:
    """What cases refer to: protected sessions, leases the runner saw per connection,
    the honest spills sent so far (their later restores and retries), layout names sent
    to RegisterLayout, and a session whose tokens only its tenant ever spills (``secret``:
    tenant, token bytes; another tenant's Lookup of them must find nothing)."""

    protected: dict[tuple[str, str], Spilled] = field(default_factory=dict)
    seen_leases: dict[int, list[str]] = field(default_factory=dict)
    spilled: list[Spilled] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    secret: tuple[str, bytes] | None = None


def ser(messages) -> list[bytes]:
    return [m.SerializeToString() for m in messages]
