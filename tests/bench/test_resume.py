"""Smoke tests of bench.resume and bench.bytes on the tiny model (W 8, m 4, 16-token
chunks): every path runs through real tiers in a temp dir and is checked by decoding;
no timing is asserted."""

from __future__ import annotations

import pytest
import torch

from bench import bytes as bytes_bench
from bench.resume import (
    PATHS,
    compare_logits,
    drop_page_cache,
    goal,
    held_out_ids,
    measure_context,
    replay_costs,
    run,
    spec_for,
)
from kvstore.format.registry import get_layout
from model import checkpoint
from model.config import BUNDLED, TINY, layout_spec
from replay.worker import ReplayWorker
from tests.support.replay import tiny_model

INFO = {"weights": None, "trained": False, "note": "tiny test model"}


def test_spec_for_uses_the_preset_or_registers_the_config():
    assert spec_for(BUNDLED).layout_id == get_layout("kvtier-bundled").layout_id
    tiny = spec_for(TINY)
    assert get_layout(tiny.layout_id) is tiny
    assert tiny.streams == layout_spec(TINY).streams


def test_compare_logits():
    ref = torch.randn(5, 256)
    same = compare_logits(ref, ref.clone())
    assert same["kl_nats"] == 0 and same["top1_agreement"] == 1 and same["max_abs_logit_diff"] == 0
    flipped = compare_logits(ref, -ref)
    assert flipped["kl_nats"] > 1 and flipped["top1_agreement"] < 1


def test_held_out_ids_are_bytes_of_the_requested_length():
    ids = held_out_ids(100, offset=0.3)
    assert ids.shape == (100,) and ids.dtype == torch.int64 and int(ids.min()) >= 0
    assert int(ids.max()) < 256
    assert torch.equal(ids, held_out_ids(100, offset=0.3))


async def test_every_path_resumes_and_is_checked(tmp_path):
    model = tiny_model()
    worker = ReplayWorker(model, default_tokens=8)
    try:
        row = await measure_context(model, worker, 42, tmp_path / "n42", repeats=2,
                                    replay_tokens=8, kl_tol=1.0)
    finally:
        await worker.close()
    paths = row["paths"]
    assert sorted(paths) == sorted(PATHS)
    assert "skipped" in paths.pop("disk-grpc")  # no weights file for the server to load
    assert paths["host"]["check"]["kl_nats"] == 0  # window kept: bit-exact
    assert paths["host"]["verified"] and paths["host"]["replayed"] is False
    for tier in ("disk", "object"):
        assert paths[tier]["replayed"] and paths[tier]["tiers_read"] == [tier]
        assert paths[tier]["replay_s"] > 0
    # the window lives only on host; the plain bf16 cache is the spec's baseline
    assert paths["host"]["stored_bytes"] > paths["disk"]["stored_bytes"]
    baseline = spec_for(TINY).bf16_baseline_bytes_per_token
    assert paths["naive"]["stored_bytes_per_token"] >= baseline
    for p in paths.values():
        assert p["speedup_vs_prefill"] == paths["prefill"]["seconds"] / p["seconds"]


async def test_run_reports_contexts_and_goal():
    result = await run(tiny_model(), INFO, [24, 40], repeats=1, replay_tokens=40, kl_tol=1e-9)
    assert [r["context"] for r in result["contexts"]] == [24, 40]
    # replaying every token rebuilds the never-evicted state: all paths verify tightly
    assert result["goal"]["all_verified"] is True
    assert result["model"] == INFO


def test_goal_flags():
    def rows(speedups):
        return [{"context": n, "grpc_vs_inprocess": 1.1,
                 "paths": {"disk": {"seconds": 1.0, "speedup_vs_prefill": s, "verified": True,
                                    "restore_s": 0.3, "decode_s": 0.1, "medium_read_s": 0.25}}}
                for n, s in speedups]

    assert goal(rows([(4096, 10), (16384, 25), (65536, 90)])) == {
        "disk_speedup_at_16384": 25, "met_20x_at_16384": True, "widening_with_context": True,
        "grpc_vs_inprocess": {4096: 1.1, 16384: 1.1, 65536: 1.1}, "grpc_within_1_15x": True,
        "disk_restore_decode_vs_medium": {4096: 1.6, 16384: 1.6, 65536: 1.6},
        "disk_within_2x_of_medium": True, "all_verified": True, "paths_not_measured": []}
    bad = goal(rows([(4096, 30), (16384, 12)]))
    assert bad["met_20x_at_16384"] is False and bad["widening_with_context"] is False
    assert goal(rows([(1024, 5)]))["met_20x_at_16384"] is None


def test_drop_page_cache_accepts_files_and_directories(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    files = [tmp_path / "a" / "f", tmp_path / "a" / "b" / "g", tmp_path / "top"]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 10)
    # every file under a directory, at any depth, and no directory itself
    assert drop_page_cache(tmp_path) == sorted(files)
    assert drop_page_cache(tmp_path / "a" / "f") == [tmp_path / "a" / "f"]
    assert drop_page_cache(tmp_path / "a" / "b") == [tmp_path / "a" / "b" / "g"]
    for i, f in enumerate(files):  # advice only: the contents are untouched
        assert f.read_bytes() == bytes([i]) * 10


def test_drop_page_cache_refuses_a_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        drop_page_cache(tmp_path / "absent")


async def test_bytes_counts_what_the_disk_tier_holds(tmp_path):
    lengths = [40, 23]  # 2 + 1 full chunks of 16 tokens, partial tails of 8 and 7
    result = await bytes_bench.measure(tiny_model(), INFO, lengths, tmp_path)
    spec = spec_for(TINY)
    per, raw = result["bytes_per_token"], result["bytes"]
    assert result["tokens"] == 63
    assert per["spec"] == spec.persistent_bytes_per_token
    assert per["bf16_baseline"] == spec.bf16_baseline_bytes_per_token
    # 3 full chunks: the codec adds headers and checksums to the spec's payload
    assert raw["encoded_chunks"] > 3 * 16 * spec.persistent_bytes_per_token
    assert raw["disk_live_values"] == raw["encoded_chunks"]
    assert raw["segment_files"] >= raw["disk_live_values"]
    assert raw["manifests"] > 63  # token ids at 1 B/token (vocab 256), plus the tails
    # each manifest once, in its segment record: the live records hold chunks and manifests
    assert raw["live_records"] > raw["encoded_chunks"] + raw["manifests"]
    assert per["disk_total"] == (raw["live_records"] + raw["index_meta_values"]) / 63
    assert raw["segment_files"] - raw["live_records"] == pytest.approx(per["disk_dead"] * 63)
    assert result["bf16_vs_disk"] == per["bf16_baseline"] / per["disk_total"]


async def test_the_grpc_path_resumes_through_a_real_server(tmp_path):
    weights = tmp_path / "tiny.safetensors"
    checkpoint.save(tiny_model(), weights)  # the server's in-process replay loads this file
    model = checkpoint.load(weights)  # the same (fp16-stored) weights on both sides
    worker = ReplayWorker(model, default_tokens=8)
    try:
        row = await measure_context(model, worker, 42, tmp_path / "n42", repeats=1,
                                    replay_tokens=8, kl_tol=1.0, weights=weights)
    finally:
        await worker.close()
    grpc, disk = row["paths"]["disk-grpc"], row["paths"]["disk"]
    assert "error" not in grpc and grpc["verified"]
    assert grpc["replay_s"] > 0
    assert row["grpc_vs_inprocess"] == grpc["seconds"] / disk["seconds"]
    assert row["grpc_vs_inprocess_median"] == grpc["repeat_seconds"][0] / disk["repeat_seconds"][0]
    assert disk["medium_read_s"] > 0
    # the same chunks; the manifests differ only in a few fields' encoding
    assert abs(grpc["stored_bytes"] - disk["stored_bytes"]) < 64
    # the same replay over the same bytes: the same next-byte distribution
    assert grpc["check"]["kl_nats"] == disk["check"]["kl_nats"]


async def test_replay_costs_times_each_r_of_a_real_disk_resume():
    result = await replay_costs(tiny_model(), INFO, [40], [4, 40], repeats=2)
    (row,) = result["contexts"]
    short, whole = row["by_replay_tokens"]["4"], row["by_replay_tokens"]["40"]
    assert short["cost_vs"] == 1 and len(short["repeat_seconds"]) == 2
    assert whole["cost_vs"] == whole["seconds"] / short["seconds"]
    assert whole["replay_s"] > 0 and whole["restore_s"] > 0  # read from disk, replayed
    # replaying every token rebuilds the never-evicted state: its next byte exactly
    assert whole["kl_nats"] < 1e-9 < short["kl_nats"]
