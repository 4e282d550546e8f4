"""Eviction policies driven with block ids and a virtual clock, as a trace simulator would."""

from __future__ import annotations

import random

import pytest

from kvstore.errors import InvalidRequest
from kvstore.policy import HintPolicy, LRUPolicy, ResumeHint


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("cls", [LRUPolicy, HintPolicy])
def test_unhinted_policies_evict_least_recently_used(cls):
    clock = VirtualClock()
    policy = cls(clock)
    for block in range(5):
        clock.now += 1
        policy.on_insert(block)
    clock.now += 1
    policy.on_access(0)
    assert policy.victim() == 1
    assert policy.victim(exclude={1, 2}) == 3
    policy.on_remove(1)
    assert policy.victim() == 2
    assert len(policy) == 4 and 1 not in policy and 0 in policy
    assert policy.victim(exclude={0, 2, 3, 4}) is None


def test_hint_policy_evicts_latest_return_where_lru_evicts_oldest():
    clock = VirtualClock()
    lru, hint = LRUPolicy(clock), HintPolicy(clock)
    # Session a pauses first but for an hour; b pauses later for ten seconds.
    for policy in (lru, hint):
        policy.on_insert("a", hint=ResumeHint(expected_pause_s=3600))
    clock.now = 5
    for policy in (lru, hint):
        policy.on_insert("b", hint=ResumeHint(expected_pause_s=10))
    clock.now = 6
    assert lru.victim() == "a"
    assert hint.victim() == "a"  # a is back at 3600, b at 15
    clock.now = 7
    for policy in (lru, hint):
        policy.on_insert("c", hint=ResumeHint(expected_pause_s=7200))
    assert lru.victim() == "a"
    assert hint.victim() == "c"  # needed latest, although most recent
    assert hint.predicted_return("c") == 7207
    assert hint.victim(exclude={"c"}) == "a"


def test_overdue_blocks_grow_stale_like_unused_ones_and_priority_still_rules():
    """A session that never came back must not pin the tier: once its predicted return
    has passed, its blocks age like unhinted blocks idle since that moment."""
    clock = VirtualClock()
    policy = HintPolicy(clock)
    policy.on_insert("overdue", hint=ResumeHint(expected_pause_s=10))  # due at 10, missed
    clock.now = 50
    policy.on_insert("plain")  # last used at 50
    policy.on_insert("soon", hint=ResumeHint(expected_pause_s=20))  # due at 70
    clock.now = 60
    assert policy.victim() == "overdue"  # stale since 10, where plain is idle since 50
    policy.on_insert("vip", hint=ResumeHint(expected_pause_s=10_000, priority=5))
    policy.on_remove("overdue")
    clock.now = 62
    assert policy.victim() == "plain"  # idle 12 s: predicted back at 74, soon at 70
    policy.on_remove("plain")
    assert policy.victim() == "soon"  # lower priority goes first though vip is due later
    policy.on_remove("soon")
    assert policy.victim() == "vip"
    policy.on_remove("vip")
    assert policy.victim() is None and len(policy) == 0


def test_hint_policy_keeps_pause_estimate_across_accesses_and_rehints():
    clock = VirtualClock()
    policy = HintPolicy(clock)
    policy.on_insert("x", hint=ResumeHint(expected_pause_s=50))
    clock.now = 10
    policy.on_access("x")
    assert policy.predicted_return("x") == 60
    policy.on_access("x", hint=ResumeHint(expected_pause_s=5))
    assert policy.predicted_return("x") == 15
    policy.on_access("x", hint=ResumeHint(priority=1))
    assert policy.predicted_return("x") is None
    policy.on_insert("y")
    clock.now = 20
    policy.on_access("x")  # keeps priority 1: y (priority 0) still goes first
    assert policy.victim() == "y"


def test_hint_policy_victim_skips_protected_blocks_without_losing_them():
    """A request protects its own blocks (the latest hinted ones): victim passes over them
    and over stale entries of re-hinted blocks, and keeps every one for later calls."""
    clock = VirtualClock()
    policy = HintPolicy(clock)
    for block in range(10):
        policy.on_insert(block, hint=ResumeHint(expected_pause_s=100 + block))
    for block in range(0, 10, 2):  # stale heap entries, later returns than before
        policy.on_access(block, hint=ResumeHint(expected_pause_s=200 + block))
    protected = {8, 6, 4}
    assert policy.victim(protected) == 2
    assert policy.victim(protected | {2, 0}) == 9
    ranked: list[int] = []
    while (block := policy.victim(set(ranked))) is not None:
        ranked.append(block)
    assert ranked == [8, 6, 4, 2, 0, 9, 7, 5, 3, 1]  # each still ranked by its latest hint


def test_hint_policy_matches_reference_on_random_operations():
    """Against a brute-force statement of the rule, over many inserts, hints and removals."""
    rng = random.Random(7)
    clock = VirtualClock()
    policy = HintPolicy(clock)
    model: dict[int, tuple[float, ResumeHint | None]] = {}  # block -> (last access, hint)
    for _ in range(3000):
        clock.now += rng.random()
        op = rng.random()
        block = rng.randrange(60)
        if op < 0.55:
            hint = None
            if rng.random() < 0.6:
                pause = rng.choice([None, rng.uniform(0, 50)])
                hint = ResumeHint(expected_pause_s=pause, priority=rng.randrange(3))
            keep = model[block][1] if block in model and hint is None else hint
            policy.on_access(block, hint)
            model[block] = (clock.now, keep)
        elif op < 0.8:
            policy.on_remove(block)
            model.pop(block, None)
        else:
            exclude = set(rng.sample(range(60), 5))
            expected = _reference_victim(model, clock.now, exclude)
            got = policy.victim(exclude)
            if expected is None:
                assert got is None
            else:
                assert _score(model[got], clock.now) == _score(model[expected], clock.now)
        assert len(policy) == len(model)


def _score(entry, now):
    last, hint = entry
    priority = 0 if hint is None else hint.priority
    r = last if hint is None or hint.expected_pause_s is None else last + hint.expected_pause_s
    return (-priority, now + abs(now - r))  # ahead: r; passed: as long again as stale


def _reference_victim(model, now, exclude):
    candidates = [b for b in model if b not in exclude]
    if not candidates:
        return None
    return max(candidates, key=lambda b: _score(model[b], now))


def test_resume_hint_validates():
    with pytest.raises(InvalidRequest):
        ResumeHint(expected_pause_s=-1)
    with pytest.raises(InvalidRequest):
        ResumeHint(expected_pause_s=float("nan"))
    with pytest.raises(InvalidRequest):
        ResumeHint(priority=1.5)
