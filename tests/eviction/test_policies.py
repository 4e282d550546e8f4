"""Eviction policies driven with block ids and a virtual clock, as a trace simulator would;
the hint book that turns resume hints into predicted next uses, and how the tier stack
carries those along when blocks move."""

from __future__ import annotations

import random

import pytest

from kvstore.eviction.policies import HintBook, HintPolicy, LRUPolicy, NextUse
from kvstore.eviction.reuse import (
    REFRESH,
    REPLAY_COST_READS,
    ReusePolicy,
    reuse_policies,
    window_cost,
)
from kvstore.format.errors import InvalidRequest
from kvstore.format.hints import ResumeHint
from kvstore.placement.locks import KeyedLocks
from kvstore.placement.stack import TierStack
from kvstore.stats import Counters
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from tests.support.manager import encode, random_tokens


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def when(next_use: NextUse | None) -> tuple | None:
    """(at, priority) of a predicted next use: what these tests pin down."""
    return None if next_use is None else (next_use.at, next_use.priority)


def hinted(book: HintBook, block, pause: float | None, priority: int = 0) -> NextUse:
    """A session stores ``block`` now with this hint: what its tiers' policies are told."""
    book.stored(block, ResumeHint(expected_pause_s=pause, priority=priority))
    return book.get(block)


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
    book, lru, hint = HintBook(clock), LRUPolicy(clock), HintPolicy(clock)
    # Session a pauses first but for an hour; b pauses later for ten seconds.
    for policy in (lru, hint):
        policy.on_insert("a", hint=hinted(book, "a", 3600))
    clock.now = 5
    for policy in (lru, hint):
        policy.on_insert("b", hint=hinted(book, "b", 10))
    clock.now = 6
    assert lru.victim() == "a"
    assert hint.victim() == "a"  # a is back at 3600, b at 15
    clock.now = 7
    for policy in (lru, hint):
        policy.on_insert("c", hint=hinted(book, "c", 7200))
    assert lru.victim() == "a"
    assert hint.victim() == "c"  # needed latest, although most recent
    assert hint.reference_time("c") == 7207
    assert hint.victim(exclude={"c"}) == "a"


def test_overdue_blocks_grow_stale_like_unused_ones_and_priority_still_rules():
    """A session that never came back must not pin the tier: once its predicted return
    has passed, its blocks age like unhinted blocks idle since that moment."""
    clock = VirtualClock()
    book, policy = HintBook(clock), HintPolicy(clock)
    policy.on_insert("overdue", hint=hinted(book, "overdue", 10))  # due at 10, missed
    clock.now = 50
    policy.on_insert("plain")  # last used at 50
    policy.on_insert("soon", hint=hinted(book, "soon", 20))  # due at 70
    clock.now = 60
    assert policy.victim() == "overdue"  # stale since 10, where plain is idle since 50
    policy.on_insert("vip", hint=hinted(book, "vip", 10_000, priority=5))
    policy.on_remove("overdue")
    clock.now = 62
    assert policy.victim() == "plain"  # idle 12 s: predicted back at 74, soon at 70
    policy.on_remove("plain")
    assert policy.victim() == "soon"  # lower priority goes first though vip is due later
    policy.on_remove("soon")
    assert policy.victim() == "vip"
    policy.on_remove("vip")
    assert policy.victim() is None and len(policy) == 0


def test_hint_book_times_and_fulfilled_returns():
    clock = VirtualClock()
    book = HintBook(clock)
    assert when(hinted(book, "x", 50)) == (50, 0)
    clock.now = 30
    book.read("x")  # back early: its return is fulfilled, it is idle from now on
    assert when(book.get("x")) == (30, 0)
    assert when(hinted(book, "x", 5)) == (35, 0)
    clock.now = 80
    assert when(book.get("x")) == (35, 0)  # missed at 35: ages from then
    book.read("x")
    assert when(book.get("x")) == (80, 0)
    assert when(hinted(book, "x", None, priority=2)) == (80, 2)  # priority only
    assert (book.get("x").reads, book.get("x").since, book.get("x").pause) == (2, 80, 5)
    book.stored("never-hinted", None)
    clock.now = 90
    book.read("never-hinted")  # no predicted time (policies see it as used now), but its
    unhinted = book.get("never-hinted")  # reads and age are followed all the same
    assert (unhinted.at, unhinted.reads, unhinted.since, unhinted.pause) == (None, 1, 90, None)
    assert len(book) == 2
    book.forget("x")
    assert book.get("x") is None and len(book) == 1


def test_shared_block_keeps_the_earliest_return_ahead():
    """A prompt block shared by two sessions: the one finishing (never back) must not
    make it a first victim while the other still expects it."""
    clock = VirtualClock()
    book, policy = HintBook(clock), HintPolicy(clock)
    policy.on_insert("shared", hint=hinted(book, "shared", 100, priority=1))  # a: at 100
    policy.on_insert("own", hint=hinted(book, "own", 500))
    clock.now = 2
    policy.on_access("shared", hint=hinted(book, "shared", 10))  # b: at 12
    clock.now = 12
    book.read("shared")  # b is back (its return, the nearest, is fulfilled) and finishes
    policy.on_access("shared", hint=hinted(book, "shared", 1e9))
    assert when(book.get("shared")) == (100, 1)  # a's return and priority hold it
    assert policy.victim() == "own"
    clock.now = 120  # a is 20 s late: back by 140 as the estimate goes, not at 1e9
    assert when(book.get("shared")) == (100, 1)
    clock.now = 6e8  # so late it is not expected any more: b's far return is sooner
    assert when(book.get("shared")) == (12 + 1e9, 1)


def test_blocks_whose_hints_proved_wrong_fall_back_to_lru_order():
    clock = VirtualClock()
    book = HintBook(clock)
    hinted(book, "liar", 10)
    hinted(book, "honest", 100)
    clock.now = 100
    book.read("liar")  # predicted back after 10 s, came after 100: wrong
    book.read("honest")  # right
    assert when(hinted(book, "honest", 50)) == (150, 0)
    assert when(hinted(book, "liar", 5000)) == (100, 0)  # ordered by its last use
    clock.now = 200
    book.read("liar")  # the 5000 s pause was wrong again; ignored, it is idle from 200
    assert when(book.get("liar")) == (200, 0)
    hinted(book, "liar", 30)
    for now in (230, 260):  # right twice: its hints count again
        clock.now = now
        book.read("liar")
        assert when(hinted(book, "liar", 30)) == (now if now == 230 else now + 30, 0)


def test_hint_policy_victim_skips_protected_blocks_without_losing_them():
    """A request protects its own blocks (the latest hinted ones): victim passes over them
    and over stale entries of re-hinted blocks, and keeps every one for later calls."""
    clock = VirtualClock()
    policy = HintPolicy(clock)
    for block in range(10):
        policy.on_insert(block, hint=NextUse(100 + block))
    for block in range(0, 10, 2):  # stale heap entries, later returns than before
        policy.on_access(block, hint=NextUse(200 + block))
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
    model: dict[int, tuple[int, float]] = {}  # block -> (priority, r)
    for _ in range(3000):
        clock.now += rng.random()
        op = rng.random()
        block = rng.randrange(60)
        if op < 0.55:
            hint = None
            if rng.random() < 0.6:
                at = rng.choice([None, clock.now + rng.uniform(-30, 50)])
                hint = NextUse(at, priority=rng.randrange(3))
            policy.on_access(block, hint)
            model[block] = (0 if hint is None else hint.priority,
                            clock.now if hint is None or hint.at is None else hint.at)
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
    priority, r = entry
    return (-priority, now + abs(now - r))  # ahead: r; passed: as long again as stale


def _reference_victim(model, now, exclude):
    candidates = [b for b in model if b not in exclude]
    if not candidates:
        return None
    return max(candidates, key=lambda b: _score(model[b], now))


async def test_tier_stack_moves_keep_the_predicted_return(opened):
    """Demotion and promotion are not accesses by the session: a block keeps the return
    its hint predicted, in whichever tier it lands."""
    clock = VirtualClock()
    tokens = random_tokens(16, seed=1)
    data = {key: encode(0, tokens, seed=i) for i, key in enumerate("abc")}
    size = len(data["a"])
    tiers = [opened.adopt(HBMTier(2 * size, device="cpu")),
             opened.adopt(HostTier(8 * size, pin_memory=False))]
    stack = TierStack(tiers, lambda: HintPolicy(clock), KeyedLocks(), Counters(),
                      is_referenced=lambda key: True)
    for key, pause in (("a", 100), ("b", 1000), ("c", 10)):
        stack.touch(key, ResumeHint(expected_pause_s=pause))
        assert await stack.place(key, data[key]) == 0
        clock.now += 20  # a due at 100, b at 1020, c at 50
    assert stack.holders("b") == [1]  # c's spill demoted the one due latest
    assert stack.policies[1].reference_time("b") == 1020
    clock.now = 200  # b is restored early (its return fulfilled: idle from 200), promoted
    found, source, bad = await stack.read("b")
    assert source == 1 and stack.policies[1].reference_time("b") == 200
    assert await stack.promote("b", found, source, bad) == 0
    assert stack.policies[0].reference_time("b") == 200
    # promoting b demoted c: overdue since 50, staler than a (since 100)
    assert stack.holders("c") == [1] and stack.policies[1].reference_time("c") == 50
    assert await stack.delete(1, "c") and stack.hints.get("c") is None  # its last copy
    for tier in tiers:
        await opened.close(tier)


def test_resume_hint_validates():
    with pytest.raises(InvalidRequest):
        ResumeHint(expected_pause_s=-1)
    with pytest.raises(InvalidRequest):
        ResumeHint(expected_pause_s=float("nan"))
    with pytest.raises(InvalidRequest):
        ResumeHint(priority=1.5)


# -- ReusePolicy: hit density per reuse class, learned from the stack's reads --

@pytest.mark.parametrize("read_pause", [0.5, 1e4])
def test_reuse_policy_learns_which_hints_come_true(read_pause):
    """Blocks stored with one predicted pause are read 3 s later, those with the other
    never. Whichever it is, the policy learns it: it then evicts a fresh block of the
    never-read kind before an older one of the read kind, where LRU takes the older."""
    other_pause = 1e4 if read_pause == 0.5 else 0.5
    clock = VirtualClock()
    book = HintBook(clock)
    policy = reuse_policies(clock)()

    def store(block, pause):
        book.stored(block, ResumeHint(expected_pause_s=pause))
        policy.on_insert(block, 100, book.get(block))

    for i in range(2 * REFRESH):  # the model folds its counts in every REFRESH reads
        clock.now += 1
        store(f"read{i}", read_pause)
        store(f"unread{i}", other_pause)
        if i >= 3:
            book.read(f"read{i - 3}")
            policy.on_access(f"read{i - 3}", book.get(f"read{i - 3}"))
        if i >= 30:  # what eviction would have taken anyway
            for block in (f"read{i - 30}", f"unread{i - 30}"):
                policy.on_remove(block)
                book.forget(block)
    store("older", read_pause)
    clock.now += 2
    store("fresh", other_pause)
    exclude = {b for b in policy._index if b not in ("older", "fresh")}
    assert policy.victim(exclude) == "fresh"
    lru = LRUPolicy(clock)
    lru.on_insert("older")
    lru.on_insert("fresh")
    assert lru.victim() == "older"


def test_reuse_policy_ranks_per_byte_by_priority_and_skips_excluded():
    clock = VirtualClock()
    policy = ReusePolicy(clock)
    policy.on_insert("small", 10)
    policy.on_insert("large", 1000)  # as dense as "small" (no data yet), 100x the bytes
    assert policy.victim() == "large"
    policy.on_insert("vip", 5000, NextUse(priority=3))
    assert policy.victim() == "large"  # the higher priority stays, whatever its size
    assert policy.victim({"large", "small"}) == "vip"
    assert policy.victim({"large", "small", "vip"}) is None
    policy.on_remove("large")
    assert policy.victim() == "small" and len(policy) == 2 and "large" not in policy


def test_reuse_policy_gives_up_a_copy_a_higher_tier_holds_first():
    """Shared by one stack's policies: the host's copy of a block hbm also holds serves
    no read, so the host evicts it before a block only it holds, even a staler one."""
    clock = VirtualClock()
    book = HintBook(clock)
    make = reuse_policies(clock)
    hbm, host = make(), make()
    book.stored("only-in-host", None)
    host.on_insert("only-in-host", 100, book.get("only-in-host"))
    clock.now = 10
    book.stored("in-both", None)
    host.on_insert("in-both", 100, book.get("in-both"))
    hbm.on_insert("in-both", 100, book.get("in-both"))
    assert host.victim() == "in-both"
    hbm.on_remove("in-both")
    assert host.victim() == "only-in-host"  # now the older one, as LRU


async def test_tier_stack_runs_the_reuse_policies(opened):
    clock = VirtualClock()
    tokens = random_tokens(16, seed=1)
    data = {key: encode(0, tokens, seed=i) for i, key in enumerate("abcd")}
    size = len(data["a"])
    tiers = [opened.adopt(HBMTier(2 * size, device="cpu")),
             opened.adopt(HostTier(8 * size, pin_memory=False))]
    stack = TierStack(tiers, reuse_policies(clock), KeyedLocks(), Counters(),
                      is_referenced=lambda key: True)
    for key in "abcd":
        clock.now += 1
        stack.touch(key, ResumeHint(expected_pause_s=5))
        assert await stack.place(key, data[key]) is not None
    assert "c" in stack.policies[0] and "d" in stack.policies[0]  # a, b moved down, kept
    assert stack.holders("a") == [1] and stack.holders("b") == [1]
    found, source, bad = await stack.read("a")
    assert source == 1 and bytes(found) == bytes(data["a"])
    for tier in tiers:
        await opened.close(tier)


def test_reuse_policy_weighs_a_window_by_the_replay_losing_it_costs():
    """A window blob is 15 chunks' bytes: per byte it loses to a chunk unless its loss is
    weighed as a replay; with the cost it stays and the chunk goes."""
    clock = VirtualClock()
    plain = ReusePolicy(clock)
    costed = reuse_policies(clock, cost=window_cost(lambda key: key.startswith("win/")))()
    for policy in (plain, costed):
        policy.on_insert("win/s1", 15 * 100)
        policy.on_insert("chunk", 100)
    assert plain.victim() == "win/s1"
    assert costed.victim() == "chunk"
    assert costed.cost("win/s1") == REPLAY_COST_READS and costed.cost("chunk") == 1.0


def test_admission_compares_with_the_tiers_lowest_block():
    clock = VirtualClock()
    policy = ReusePolicy(clock)
    assert policy.admits("anything", 100)  # an empty tier takes anything
    policy.on_insert("held", 100)
    assert policy.admits("small", 10)  # as dense, a tenth of the bytes: worth more
    assert not policy.admits("big", 10_000)
    assert policy.admits("big", 10_000, NextUse(priority=1))  # priority first
    assert LRUPolicy(clock).admits("big", 10_000)  # LRU ranks a placed block first


async def test_a_retained_chunk_leaving_hbm_moves_down_unless_ranked_lowest(opened):
    """Unreferenced chunks ("a" and "b") evicted from a full hbm go to the host tier like
    any other block while it has room; once it is full, a chunk its policy would not
    admit is dropped instead, and one it admits still moves down."""
    tokens = random_tokens(16, seed=2)
    data = {key: encode(0, tokens, seed=i) for i, key in enumerate("abcdef")}
    size = len(data["a"])
    tiers = [opened.adopt(HBMTier(2 * size, device="cpu")),
             opened.adopt(HostTier(2 * size, pin_memory=False))]
    admitted: set[str] = set()

    class Admitting(LRUPolicy):
        def admits(self, block, size, hint=None):
            return block in admitted

    stack = TierStack(tiers, Admitting, KeyedLocks(), Counters(),
                      is_referenced=lambda key: False)
    for key in "abcd":
        assert await stack.place(key, data[key]) == 0
    assert stack.holders("a") == [1] and stack.holders("b") == [1]  # moved down
    assert stack.counters.demotions["host"] == 2
    assert await stack.place("e", data["e"]) == 0  # evicts "c": host full, not admitted
    assert stack.holders("c") == [] and stack.holders("a") == [1]
    admitted.add("d")
    assert await stack.place("f", data["f"]) == 0  # evicts "d": admitted, "a" makes room
    assert stack.holders("d") == [1] and stack.holders("a") == []
    for tier in tiers:
        await opened.close(tier)


def test_reuse_policy_learns_window_reuse_apart_from_chunks():
    """Chunks of both hints are read 3 s after their store; windows stored with one hint
    are read then too, those with the other are evicted unread at 30 s. The windows'
    own counts (the unread kind ageing unread while held) tell the two apart, where the
    chunks' cannot: of two windows at the age the read kind is read at, the
    one of the unread kind goes first, though it is the younger."""
    clock = VirtualClock()
    book = HintBook(clock)
    policy = reuse_policies(clock, cost=window_cost(lambda key: key.startswith("win/")))()

    def store(block, pause, size):
        book.stored(block, ResumeHint(expected_pause_s=pause))
        policy.on_insert(block, size, book.get(block))

    def read(block):
        book.read(block)
        policy.on_access(block, book.get(block))

    for i in range(2 * REFRESH):
        clock.now += 1
        for pause in (0.5, 1e4):
            store(f"chunk{pause}/{i}", pause, 100)
        store(f"win/read{i}", 0.5, 1500)
        store(f"win/unread{i}", 1e4, 1500)
        if i >= 3:
            for pause in (0.5, 1e4):
                read(f"chunk{pause}/{i - 3}")
                policy.on_remove(f"chunk{pause}/{i - 3}")
            read(f"win/read{i - 3}")
            policy.on_remove(f"win/read{i - 3}")  # a resume deletes the window it read
        if i >= 30:
            policy.on_remove(f"win/unread{i - 30}")  # evicted, never read
    store("win/older", 0.5, 1500)
    clock.now += 0.1
    store("win/fresh", 1e4, 1500)
    clock.now += 2  # both now at the age the read kind is read at
    exclude = {b for b in policy._index if b not in ("win/older", "win/fresh")}
    assert policy.victim(exclude) == "win/fresh"
    # chunks of that hint are read all the same: its window goes first, replay cost or not
    store("chunk/fresh", 1e4, 100)
    clock.now += 0.1
    exclude = {b for b in policy._index if b not in ("chunk/fresh", "win/fresh")}
    assert policy.victim(exclude) == "win/fresh"


@pytest.mark.parametrize("make", [LRUPolicy, HintPolicy, lambda clock: ReusePolicy(clock)])
def test_a_batch_of_accesses_is_the_same_as_accessing_each_in_turn(make):
    """on_access_many (one update for a batch of reads) leaves a policy as on_access of
    each block in order does: the same victims, one after another, duplicates included."""
    rng = random.Random(7)
    clocks, policies = [VirtualClock(), VirtualClock()], []
    book = HintBook(clocks[0])
    blocks = [f"b{i}" for i in range(40)]
    for clock in clocks:
        policy = make(clock)
        for i, block in enumerate(blocks):
            clock.now = float(i)
            policy.on_insert(block, 100 + i, None)
        policies.append(policy)
    for round_ in range(5):
        batch = rng.sample(blocks, 12) + [blocks[round_]]  # a duplicate in some rounds
        hints = [None if rng.random() < 0.5 else
                 NextUse(at=rng.uniform(0, 200), priority=rng.choice([0, 0, 1]),
                         reads=rng.randrange(3), since=rng.uniform(0, 50), pause=5.0)
                 for _ in batch]
        for clock in clocks:
            clock.now = 50.0 + round_
        for block, hint in zip(batch, hints, strict=True):
            policies[0].on_access(block, hint)
        policies[1].on_access_many(batch, hints)
    assert book.get_many(blocks) == [None] * len(blocks)
    order = [[], []]
    for policy, out in zip(policies, order, strict=True):
        while (victim := policy.victim()) is not None:
            out.append(victim)
            policy.on_remove(victim)
    assert order[0] == order[1] and len(order[0]) == len(blocks)


async def test_a_batched_read_updates_each_tiers_policy_once(opened):
    """TierStack.read_many of many blocks: one on_access_many per tier that answered,
    with every block it served, and the hit counters count each block."""
    calls = []

    class Counting(LRUPolicy):
        def on_access_many(self, blocks, hints):
            calls.append(list(blocks))
            super().on_access_many(blocks, hints)

    tokens = random_tokens(16, seed=3)
    data = {f"k{i}": encode(0, tokens, seed=i) for i in range(6)}
    tier = opened.adopt(HostTier(1 << 20, pin_memory=False))
    stack = TierStack([tier], Counting, KeyedLocks(), Counters(),
                      is_referenced=lambda key: True)
    for key, value in data.items():
        assert await stack.place(key, value) is not None
    got = await stack.read_many(list(data), [lambda _: None] * len(data))
    assert [bytes(copy.data) for copy in got] == [bytes(v) for v in data.values()]
    assert calls == [list(data)]
    assert stack.counters.hits["host"] == len(data)
    await opened.close(tier)
