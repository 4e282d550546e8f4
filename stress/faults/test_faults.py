"""stress.faults at the small size: no durable ack lost at any crash point, every ENOSPC
and EIO case at each call site recovers (clear error, nothing acked lost, serving again
once healed without a reopen), and repair brings every session back bit-exact."""

from __future__ import annotations

import json

from stress.faults.campaign import main
from stress.faults.cases import EIO_KINDS, ENOSPC_KINDS
from stress.faults.report import section


def test_the_fault_benchmark_finds_nothing_wrong(capsys):
    # two cases per kind, a compaction's read and unlink among them
    assert main(["--json", "--workload", "small", "--per-kind", "2"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["crash_points"] == results["events"] + 1
    assert results["acked_durable"] > 0
    assert results["acked_lost"] == 0
    assert results["wrong"] == 0
    assert results["recovery_failures"] == 0
    for name, kinds in (("enospc", ENOSPC_KINDS), ("eio", EIO_KINDS)):
        cases = results[name]
        assert {case["kind"] for case in cases} == set(kinds)
        for case in cases:
            assert case["fired"] > 0, case  # the fault really hit that call
            assert case["recovered"], case
    for variant in ("deleted_index", "flipped_bytes"):
        repaired = results["repair"][variant]
        assert repaired["sessions_after"] == repaired["sessions_before"] > 0, repaired
        assert repaired["bit_exact"], repaired
    assert results["repair"]["deleted_index"]["open_before_repair"] == "corrupt"
    assert results["repair"]["flipped_bytes"]["crashed"] == 0
    assert results["summary"]["clean"]
    text = "\n".join(section(results))  # the REPORT.md section renders it
    assert "**0 lost**" in text and "| EIO | unlink |" in text and "| deleted index |" in text
