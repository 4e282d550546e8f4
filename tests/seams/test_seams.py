"""The whole-service simulation (``bench.seams``) on a short seeded budget: real
``kvtier serve`` processes, redis-server and moto's S3 server, each seed a rotation of
three switch combinations; every failure key must be 0. The long run (every
combination, thousands of steps) is marked slow."""

from __future__ import annotations

import pytest

from bench.seams import engine
from bench.seams.run import simulate
from bench.seams.switches import all_combinations, parse_combinations
from bench.seams.verdict import KEYS

STEPS_PER_COMBINATION = 60
# Event-loop stalls are ticks late by a wall-clock bound, which a loaded machine crosses on
# its own: bench.seams reports them, and tests/server/test_loop_stalls.py checks the
# requests that could hold the loop. Every other key is a count of wrong behaviour.
CHECKED = tuple(key for key in KEYS if key != "stalls_over_50ms")


def rotation(seed: int, count: int = 3) -> list:
    every = all_combinations()
    return [every[(seed * 5 + i * 11) % len(every)] for i in range(count)]


def failures(result: dict) -> str:
    counts = ", ".join(f"{k} {result[k]}" for k in KEYS)
    shown = "\n".join(f"  {f['kind']} {f['combination']} seed {f['seed']} step {f['step']} "
                      f"{f['op']} {f['session']}: expected {f['expected']}, got {f['got']}"
                      for f in result["findings"][:20] if f["kind"] in CHECKED)
    return f"{counts} (step log: {result['log']})\n{shown}"


@pytest.mark.parametrize("seed", [1, 2])
def test_short_simulation_finds_nothing(seed: int, tmp_path) -> None:
    combos = rotation(seed)
    result = simulate(STEPS_PER_COMBINATION * len(combos), seed, combos, workdir=tmp_path)
    assert all(result[key] == 0 for key in CHECKED), failures(result)
    assert result["combinations_tried"] == result["switch_combinations"] == len(combos)
    assert result["steps"] >= STEPS_PER_COMBINATION * len(combos)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 6 to 10 minutes on 2 cores; the default is 300 s
def test_long_simulation_over_every_combination(tmp_path) -> None:
    result = simulate(2_000, 7, all_combinations(), workdir=tmp_path)
    assert result["combinations_tried"] == 32
    assert all(result[key] == 0 for key in CHECKED), failures(result)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("combination", ["enc+quota+ret+shared+tls", "enc+ret+tls"])
def test_every_maintenance_event_once(combination: str, tmp_path, monkeypatch) -> None:
    """Each event of engine.EVENTS (those that apply: a hung node needs shared metadata)
    once on a fleet node and once on a single node, every failure key 0."""
    monkeypatch.setattr(engine, "EVENT_EVERY", 20)
    steps = 20 * (len(engine.EVENTS) + 2)
    result = simulate(steps, 5, parse_combinations(combination), workdir=tmp_path)
    assert all(result[key] == 0 for key in CHECKED), failures(result)
    log = (tmp_path / "seams.log").read_text()
    ran = {kind for kind in engine.EVENTS if f"event={kind}" in log}
    skipped = {"hung-node"} if "shared" not in combination else set()
    assert ran == set(engine.EVENTS) - skipped
