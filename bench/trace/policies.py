"""The eviction policies a trace replay compares, each with its hints and virtual clock.

Every replay (the simulation and the real ``TierStack`` check) gets the same setup for
a policy name: a factory for one policy per tier, the hint each request spills with,
the clock the policies read, and for Belady the cursor of its next-use table.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from bench.trace.belady import BeladyPolicy, NextUseTable
from bench.trace.workload import FINISHED_PAUSE_S, Workload, causal_hints, oracle_hints
from kvstore.eviction.policies import EvictionPolicy, HintPolicy, LRUPolicy
from kvstore.eviction.reuse import REPLAY_COST_READS, reuse_policies, window_cost
from kvstore.format.errors import InvalidRequest
from kvstore.format.hints import ResumeHint
from kvstore.placement.stack import is_window_key

POLICIES = ("kvtier", "kvtier-hint", "kvtier-returns", "lru", "hint", "hint-perfect",
            "hint-causal", "belady", "belady-blocks")
RETURNS_PAUSE_S = 60.0  # kvtier-returns: "back soon", the same for every returning session


class VirtualClock:
    """Seconds of trace time; the replay sets it to each request's timestamp."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def set(self, now: float) -> None:
        self.now = now


@dataclass(frozen=True)
class PolicySetup:
    factory: Callable[[], EvictionPolicy]
    hints: list[ResumeHint | None]  # one per request, given with its spill
    clock: VirtualClock
    advance: Callable[[int], None] | None  # told every read position (Belady only)


def setup_policy(workload: Workload, policy: str, *, hint_sigma: float = 0.5, seed: int = 0,
                 name: Callable[[int], Hashable] | None = None,
                 replay_cost: float = REPLAY_COST_READS) -> PolicySetup:
    """``kvtier``: ReusePolicy (the project's own), hints inferred from the past only, as
    the TierManager infers them; ``kvtier-hint``: the same with ``hint``'s hints;
    ``kvtier-returns``: the same told only whether each session comes back (an oracle
    bit, no timing: what knowing the future's "who" alone is worth).
    ``lru``: LRUPolicy. ``hint``: HintPolicy, oracle hints with lognormal noise
    ``hint_sigma``; ``hint-perfect``: the same with no noise; ``hint-causal``: HintPolicy,
    hints from past gaps only. ``belady``: farthest next read first, weighted by size over
    cost (offline table; ``name`` maps trace keys to the keys its policies will see).
    kvtier's policies and Belady weigh a window blob's loss as ``replay_cost`` chunk reads,
    as the server configures kvtier's; ``belady-blocks``: Belady weighing every block alike."""
    clock = VirtualClock()
    # trace keys are ints (windows < 0); the real stacks' are strings
    cost = window_cost(lambda key: key < 0 if isinstance(key, int) else is_window_key(key),
                       replay_cost)

    def reuse() -> Callable[[], EvictionPolicy]:
        return reuse_policies(clock, cost=cost)

    no_hints: list[ResumeHint | None] = [None] * len(workload.steps)
    if policy == "lru":
        return PolicySetup(lambda: LRUPolicy(clock), no_hints, clock, None)
    if policy in ("belady", "belady-blocks"):
        table = NextUseTable(workload.reads, workload.next_read, workload.first_positions(),
                             name)
        weigh = cost if policy == "belady" else None
        return PolicySetup(lambda: BeladyPolicy(table, weigh), no_hints, clock, table.advance)
    if policy == "kvtier":
        return PolicySetup(reuse(), causal_hints(workload), clock, None)
    if policy == "kvtier-returns":  # a probe of what limits kvtier: told only who returns
        hints = [ResumeHint(expected_pause_s=FINISHED_PAUSE_S if step.next_gap_s is None
                            else RETURNS_PAUSE_S) for step in workload.steps]
        return PolicySetup(reuse(), hints, clock, None)
    if policy == "hint-causal":
        return PolicySetup(lambda: HintPolicy(clock), causal_hints(workload), clock, None)
    if policy in ("hint", "hint-perfect", "kvtier-hint"):
        sigma = 0.0 if policy == "hint-perfect" else hint_sigma
        if sigma < 0:
            raise InvalidRequest(f"hint_sigma must be >= 0, got {sigma}")
        hints: list[ResumeHint | None] = list(oracle_hints(workload, sigma, seed))
        factory = reuse() if policy == "kvtier-hint" else lambda: HintPolicy(clock)
        return PolicySetup(factory, hints, clock, None)
    raise InvalidRequest(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
