"""The engine integrations' breaker: open after a run of outages, one probe after the
cool-down, closed by its success, open again by its failure; a probe that never reports
gives its place after another cool-down. A breaker that starts open (the vLLM link's)
stays open until a success."""

from __future__ import annotations

import pytest

from kvtier.integrations.breaker import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_failures_and_a_successful_probe_closes_it() -> None:
    clock = Clock()
    breaker = Breaker(threshold=2, cooldown_s=1.0, clock=clock)
    breaker.failed()
    assert breaker.allow() and not breaker.is_open
    breaker.failed()
    assert breaker.is_open and not breaker.allow() and breaker.opened == 1
    clock.now = 1.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # the others wait for it
    breaker.succeeded()
    assert not breaker.is_open and breaker.allow()


def test_a_failed_probe_opens_it_for_another_cool_down() -> None:
    clock = Clock()
    breaker = Breaker(threshold=1, cooldown_s=1.0, clock=clock)
    breaker.failed()
    clock.now = 1.0
    assert breaker.allow()
    breaker.failed()
    clock.now = 1.5
    assert not breaker.allow()
    clock.now = 2.0
    assert breaker.allow()


def test_a_probe_that_never_reports_gives_its_place_after_a_cool_down() -> None:
    clock = Clock()
    breaker = Breaker(threshold=1, cooldown_s=1.0, clock=clock)
    breaker.failed()
    clock.now = 1.0
    assert breaker.allow()
    clock.now = 2.0
    assert breaker.allow()


def test_a_success_resets_the_run_of_failures() -> None:
    breaker = Breaker(threshold=2, cooldown_s=1.0, clock=Clock())
    breaker.failed()
    breaker.succeeded()
    breaker.failed()
    assert not breaker.is_open


def test_failed_says_only_when_a_run_of_failures_opened_it() -> None:
    clock = Clock()
    breaker = Breaker(threshold=3, cooldown_s=1.0, start_open=True, clock=clock)
    assert breaker.is_open  # nothing known to work yet
    assert not breaker.failed()  # already open: not opened again
    breaker.succeeded()
    assert not breaker.is_open
    assert not breaker.failed() and not breaker.failed()
    breaker.succeeded()  # a success in between: the count starts over
    assert not breaker.failed() and not breaker.failed()
    assert breaker.failed() and breaker.is_open and breaker.opened == 1
    assert not breaker.failed()
    clock.now = 1.0
    assert breaker.allow()
    assert not breaker.failed() and breaker.is_open  # a failed probe: open, not opened


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Breaker(threshold=0)
    with pytest.raises(ValueError):
        Breaker(cooldown_s=0)
