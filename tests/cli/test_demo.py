"""``kvtier demo`` at a small size, with a tiny model: sessions are pushed to disk,
resumes come back through replay, and since R = 128 exceeds the tiny model's window
horizon (5 encoder layers x W = 8), replay is exact: agreement with the never-evicted
run must be perfect."""

from __future__ import annotations

import json

import pytest

from model.checkpoint import save
from services import cli
from tests.support.replay import tiny_model


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save(tiny_model(seed=5), path)
    return path


def test_demo_json_reports_every_resume(weights, capsys):
    code = cli.main(["demo", "--json", "--weights", str(weights), "--sessions", "3",
                     "--context-tokens", "300", "--next-tokens", "8", "--rounds", "1",
                     "--host-bytes", "8KiB", "--pause-s", "0.05"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    assert report["resumes"] == 3 == len(report["rows"])
    assert report["replayed"] >= 1  # an 8 KiB host tier cannot keep every window
    for row in report["rows"]:
        assert row["tier"] in ("host", "disk")
        assert row["tokens"] == 300
        assert row["replay_tokens"] == (128 if row["replayed"] else 0)
        assert row["ready_s"] > 0 and row["prefill_s"] > 0
        assert row["top1"] == 1.0 and row["greedy"] == 1.0
    assert report["top1_agreement"] == 1.0
    assert report["median_speedup_vs_prefill"] > 0
    assert {r["session"] for r in report["rows"]} == {"agent-0", "agent-1", "agent-2"}


def test_demo_refuses_bad_counts(weights, capsys):
    assert cli.main(["demo", "--weights", str(weights), "--sessions", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
