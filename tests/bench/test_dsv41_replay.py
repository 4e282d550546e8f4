"""bench.vllm.dsv41_replay's CPU side (the GPU script's DeepSeek-V4.1 section): its arguments,
the report it writes where it cannot run (no CUDA here), and how it judges the hits an
engine reports (made here: no vLLM needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.vllm import dsv41_replay

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 128


def hit(*, cached=768, agree=True, diff=0.0, hit_tokens=768, window_loaded=False,
        replay_tokens=WINDOW) -> dict:
    return {"num_cached_tokens": cached, "tokens_agree": agree, "max_logprob_diff": diff,
            "replay": {"request": "r", "hit_tokens": hit_tokens,
                       "window_loaded": window_loaded, "replay_tokens": replay_tokens}}


def report(*hits) -> dict:
    return {"prefix_replay_tokens": WINDOW, "hits": list(hits)}


def test_arguments_and_their_checks():
    args = dsv41_replay.parse_args(["--out", "r.json"])
    assert (args.prompt_tokens, args.prompts, args.max_tokens, args.logprobs) == (1024, 2, 8, 5)
    with pytest.raises(SystemExit):
        dsv41_replay.parse_args([])  # --out is required
    with pytest.raises(SystemExit):
        dsv41_replay.parse_args(["--out", "r.json", "--prompt-tokens", "1"])


def test_without_cuda_it_writes_a_skipped_report_and_exits_zero(tmp_path):
    out = tmp_path / "sub" / "dsv41.json"
    run = subprocess.run([sys.executable, "-m", "bench.vllm.dsv41_replay", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    written = json.loads(out.read_text())
    assert written["check"] == "dsv41_bounded_replay"
    assert written["status"] == "skipped"
    assert written["reason"] == "no CUDA device"
    assert "skipped: no CUDA device" in run.stdout


def test_with_cuda_but_without_the_servers_packages_it_says_which(monkeypatch):
    import importlib.util

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lmdb" else real(name, *a))
    assert dsv41_replay.missing_requirement() == (
        "lmdb not importable; carry cp312 wheels (../shared/GPU.md)")


def test_a_hit_replays_min_of_window_and_hit_unless_the_load_carried_the_window():
    assert dsv41_replay.judge(report(hit()), 0.05) == "ok"
    # a hit no longer than the window replays all of it
    assert dsv41_replay.judge(report(hit(hit_tokens=64, replay_tokens=64)), 0.05) == "ok"
    # the window came from host RAM: nothing replayed
    assert dsv41_replay.judge(report(hit(window_loaded=True, replay_tokens=0)), 0.05) == "ok"
    assert dsv41_replay.judge(report(hit(window_loaded=True)), 0.05) == "failed"
    assert dsv41_replay.judge(report(hit(replay_tokens=0)), 0.05) == "failed"


def test_a_miss_a_disagreement_or_an_unwatched_hit_fails():
    assert dsv41_replay.judge(report(hit(), hit(cached=0)), 0.05) == "failed"
    assert dsv41_replay.judge(report(hit(agree=False)), 0.05) == "failed"
    assert dsv41_replay.judge(report(hit(diff=0.2)), 0.05) == "failed"
    unwatched = hit()
    unwatched["replay"] = None
    assert dsv41_replay.judge(report(unwatched), 0.05) == "failed"


def test_logprob_difference_over_the_tokens_both_list():
    got = [{1: -0.5, 2: -1.0}, {3: -0.2}]
    assert dsv41_replay.max_logprob_diff(got, [{1: -0.5, 2: -1.25}, {3: -0.3, 4: -2.0}]) \
        == pytest.approx(0.25)
    assert dsv41_replay.max_logprob_diff(got, [{1: -0.5}, {4: -0.2}]) == float("inf")
