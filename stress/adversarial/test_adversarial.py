"""``stress.adversarial`` at tiny sizes: every attack (on spills, chunks, shared memory,
ids, streams, layouts at run time and prefix reuse) runs against a real server in a
child process and holds, and the report renders its table."""

from __future__ import annotations

from stress.adversarial.campaign import CASES, run_adversarial
from stress.adversarial.report import section


def test_every_attack_runs_and_holds():
    result = run_adversarial("tiny")
    assert set(result["cases"]) == set(CASES)
    failed = {name: case for name, case in result["cases"].items() if not case["held"]}
    assert not failed
    assert result["all_held"]
    bomb = result["cases"]["2b_zstd_bomb"]
    assert bomb["table"]["code"] == bomb["frame"]["code"] == "INVALID_ARGUMENT"
    assert result["cases"]["1a_victim_prefix"]["victim_chunks_deduped"] == 0
    assert result["cases"]["9c_lookup_foreign_prefix"]["evil_held"] == 0
    assert result["cases"]["9d_fork_foreign_session"]["codes"] == {
        "held": "PERMISSION_DENIED", "missing": "PERMISSION_DENIED"}
    assert result["cases"]["9b_register_admin_only"]["codes"]["tenant"] == "PERMISSION_DENIED"
    lines = "\n".join(section(result))
    assert "1a_victim_prefix" in lines and "all held: **yes**" in lines
