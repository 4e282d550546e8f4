"""``bench.adversarial`` at tiny sizes: every attack of issue #11 runs against a real
server in a child process and holds, and the report renders its table."""

from __future__ import annotations

from bench.adversarial import run_adversarial
from bench.adversarial_cases import CASES
from bench.report import adversarial_section


def test_every_attack_runs_and_holds():
    result = run_adversarial("tiny")
    assert set(result["cases"]) == set(CASES)
    failed = {name: case for name, case in result["cases"].items() if not case["held"]}
    assert not failed
    assert result["all_held"]
    bomb = result["cases"]["2b_zstd_bomb"]
    assert bomb["table"]["code"] == bomb["frame"]["code"] == "INVALID_ARGUMENT"
    assert result["cases"]["1a_victim_prefix"]["victim_chunks_deduped"] == 0
    lines = "\n".join(adversarial_section(result))
    assert "1a_victim_prefix" in lines and "all held: **yes**" in lines
