"""PauseEstimator: hints inferred from past spills only, and the TierManager using them
for spills that carry none."""

from __future__ import annotations

import statistics

import pytest

from kvstore.eviction.pause_estimate import MIN_PAUSES, RETURNED, PauseEstimator
from kvstore.eviction.policies import HintPolicy, LRUPolicy
from kvstore.format.hints import ResumeHint
from kvstore.session.manager import ManagerConfig
from kvstore.tiers.base import MemoryMetaStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from tests.support.manager import make_session, random_tokens, tier_keys

MB = 1 << 20


def test_first_spills_get_a_long_pause_and_returning_sessions_none():
    est = PauseEstimator()
    assert est.on_spill(None, None, 0.0) is None  # nothing seen yet: no estimate
    pauses = [float(p) for p in range(1, MIN_PAUSES + 1)]
    for i, pause in enumerate(pauses):  # sessions s0.. spill, then come back once
        assert est.on_spill(None, None, 100.0 * i) is None or i >= MIN_PAUSES
        assert est.on_spill(100.0 * i, 100.0 * i, 100.0 * i + pause) == RETURNED
    for _ in range(30):  # sessions that spill once and are never seen again
        est.on_spill(None, None, 5000.0)
    hint = est.on_spill(None, None, 6000.0)
    rate = MIN_PAUSES / (MIN_PAUSES + 1 + 30 + 1)  # returns over first spills
    assert hint == ResumeHint(expected_pause_s=statistics.quantiles(pauses, n=10)[-1] / rate)
    # a later return of a session (not its first) counts the pause, not a first return
    est.on_spill(200.0, 100.0, 230.0)
    assert est.first_returns == MIN_PAUSES and len(est.pauses) == MIN_PAUSES + 1


def test_a_return_rate_of_zero_still_gives_a_finite_hint():
    est = PauseEstimator()
    for _ in range(MIN_PAUSES):
        est.on_spill(0.0, -1.0, 3.0)  # later returns only: no first return seen
    hint = est.on_spill(None, None, 10.0)
    assert hint is not None and hint.expected_pause_s == pytest.approx(3.0 / 0.02)


@pytest.mark.parametrize("restored", [True, False])  # False: the framework kept it itself
@pytest.mark.parametrize("policy, survivor", [(LRUPolicy, "once"), (HintPolicy, "back")])
async def test_the_manager_hints_first_spills_itself(tmp_path, policy, survivor, restored,
                                                     managers):
    host = HostTier(4200)  # room for two of these sessions, not three
    manager = await managers.open([host, DiskTier(tmp_path / "disk", 64 * MB)],
                                     MemoryMetaStore(), policy=policy)
    for _ in range(MIN_PAUSES):  # the history: every session came back after 60 s
        manager._pauses.on_spill(None, None, 0.0)
        manager._pauses.on_spill(0.0, 0.0, 60.0)
    sessions = {sid: make_session(random_tokens(16 * 4, seed=70 + i), window=False)
                for i, sid in enumerate(["back", "once", "new"])}
    keys = {sid: {k for k, _ in args["chunks"]} for sid, args in sessions.items()}
    first = await manager.spill("t", "back", generation=1, **sessions["back"])
    # p90 of 60 s over the share of first spills that came back: 10 of 11 (this one too)
    assert first.hint.expected_pause_s == pytest.approx(60.0 * 11 / 10)
    if restored:  # it resumes through kvtier, then spills again
        await manager.restore("t", "back", want_window=False)
    again = await manager.spill("t", "back", generation=2, **sessions["back"])
    assert again.hint == RETURNED  # it came back: due now, then ranked by recency
    await manager.drain()
    once = await manager.spill("t", "once", generation=1, **sessions["once"])
    assert once.hint.expected_pause_s == pytest.approx(60.0 * 12 / 11)  # 11 of 12 back
    await manager.drain()
    given = ResumeHint(expected_pause_s=1.0)
    assert (await manager.spill("t", "new", generation=1, hint=given,
                                **sessions["new"])).hint == given  # a framework's wins
    await manager.drain()
    held = await tier_keys(host)
    assert keys["new"] <= held
    assert {sid for sid in ("back", "once") if keys[sid] <= held} == {survivor}
    await managers.close(manager)


async def test_inference_can_be_turned_off(tmp_path, managers):
    manager = await managers.open([HostTier(1 << 20)], MemoryMetaStore(),
                                     config=ManagerConfig(infer_hints=False))
    for _ in range(MIN_PAUSES + 1):
        args = make_session(random_tokens(16, seed=1), window=False)
        assert (await manager.spill("t", "s", generation=_ + 1, **args)).hint is None
    await managers.close(manager)
