"""kvtier as the external KV cache of a real vLLM engine (CPU build, one engine for the
module): a stored prompt is an external hit with the same greedy output as a run without
one, a prompt sharing its prefix loads that prefix, a session resumes and is spilled as its
next generation, and chunks damaged or lost behind the store's back are load errors that
vLLM recomputes, the output unchanged."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm")

from kvstore.format.keys import block_key, chunk_digest  # noqa: E402
from kvtier import Client  # noqa: E402
from testing import vllm_models  # noqa: E402

TENANT = "engine-test"
FINGERPRINT = f"{vllm_models.TINY.name}-{vllm_models.TINY.digest}"
BS = 128  # vLLM's block size on the CPU
OUT = 8  # greedy tokens per request


def prompt(length: int, seed: int) -> list[int]:
    return vllm_models.prompt(vllm_models.TINY, length, seed)


@pytest.fixture(scope="module")
def engine(kvtier_server):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    # lets a test run a function in the worker (collective_rpc) to read its cache
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    transfer = KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        # A durable save fsyncs on a CI box whose two cores the engine keeps busy: the
        # default 10 s per call can pass there, and a save that times out is not retried.
        # These tests check what is loaded, not how fast: a slow lookup waits, not a miss.
        kv_connector_extra_config={"server": kvtier_server.target, "tenant": TENANT,
                                   "model_fingerprint": FINGERPRINT, "ack": "durable",
                                   "timeout_s": 60, "lookup_timeout_ms": 10000})
    llm = LLM(model=str(vllm_models.tiny_llama()), dtype="bfloat16", max_model_len=2048,
              enforce_eager=True, skip_tokenizer_init=True, seed=0, kv_transfer_config=transfer,
              disable_log_stats=False)
    yield llm
    del llm


@pytest.fixture(scope="module")
def store(kvtier_server):
    with Client(kvtier_server.target) as client:
        yield client


@pytest.fixture(scope="module")
def layout(store):
    # value_format auto: the engine's own pages, named by CPU_ATTN's ISA path (vec or amx)
    (info,) = [i for i in store.layouts() if i.spec.name.startswith("vllm-cpu_attn.")
               and "-4x2x64-b128-bf16-v" in i.spec.name]
    return info.spec


def generate(llm, tokens, *, session: str | None = None, fresh: bool = False):
    """One greedy request: (output token ids, num_cached_tokens, kv_transfer_params);
    ``fresh``: read no cache at all (the reference a hit must reproduce)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"kvtier_session": session}} if session else None
    params = SamplingParams(max_tokens=OUT, temperature=0.0, detokenize=False,
                            extra_args=extra, skip_reading_prefix_cache=fresh or None)
    (reply,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    return list(reply.outputs[0].token_ids), reply.num_cached_tokens, reply.kv_transfer_params


def reset(llm) -> None:
    """Empty vLLM's own prefix cache (refused while a finished session request's blocks
    wait for its spill's copy: retried)."""
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "vLLM kept blocks for a minute"
        time.sleep(0.1)


def held_blocks(store, layout, tokens) -> int:
    return store.lookup(TENANT, layout, tokens, model=FINGERPRINT) // BS


def wait_held(store, layout, tokens, blocks: int) -> None:
    deadline = time.monotonic() + 60
    while held_blocks(store, layout, tokens) < blocks:
        assert time.monotonic() < deadline, "the saves did not land"
        time.sleep(0.1)


def metrics(llm) -> dict[str, float]:
    """The connector's counters, and its latency histograms' sums of seconds."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:kvtier_"):
            name = metric.name.removeprefix("vllm:kvtier_")
            value = metric.sum if hasattr(metric, "sum") else metric.value
            out[name] = out.get(name, 0.0) + float(value)
    return out


def test_a_stored_prompt_is_an_external_hit_with_the_same_output(engine, store, layout):
    p = prompt(3 * BS + 50, seed=1)
    first, cached, _ = generate(engine, p)
    assert cached == 0
    wait_held(store, layout, p, 3)
    reset(engine)
    again, cached, _ = generate(engine, p)
    assert cached == 3 * BS
    assert again == first
    # a prompt sharing its first two blocks loads those
    q = p[:2 * BS] + prompt(BS + 50, seed=2)
    reset(engine)
    shared, cached, _ = generate(engine, q)
    assert cached == 2 * BS
    assert shared == generate(engine, q, fresh=True)[0]
    counts = metrics(engine)
    assert counts["hit_tokens"] >= 5 * BS and counts["loaded_tokens"] >= 5 * BS
    assert counts["saved_tokens"] >= 4 * BS and counts.get("load_error_blocks", 0) == 0
    # seconds are fractions, never truncated to whole numbers
    assert counts["load_seconds"] > 0 and counts["load_seconds"] != int(counts["load_seconds"])


def pages_in_cache(worker, pages: list[list[bytes]]) -> list[list[bool]]:
    """Run in the engine's worker: per layer, whether each page is some block's bytes."""
    import torch

    found = []
    for layer, wanted in zip(worker.model_runner.kv_caches, pages, strict=True):
        blocks = layer.view(torch.uint8).reshape(layer.shape[0], -1)
        found.append([])
        for page in wanted:
            page = torch.frombuffer(bytearray(page), dtype=torch.uint8)
            head = (blocks[:, :64] == page[:64]).all(dim=1).nonzero().flatten()
            found[-1].append(any(torch.equal(blocks[i], page) for i in head.tolist()))
    return found


def test_engine_pages_round_trip_exactly(engine, store, layout):
    """value_format auto stores each block as the engine's own page bytes: a hit loads
    them back byte for byte, and gives the greedy output of vLLM's own prefix-cache hit
    and of the cold run."""
    from kvstore.format.chunk import decode_chunk

    (page,) = layout.streams
    assert page.format == "page" and page.tokens_per_entry == BS
    p = prompt(2 * BS + 30, seed=11)
    cold, cached, _ = generate(engine, p)
    assert cached == 0
    wait_held(store, layout, p, 2)
    own, cached, _ = generate(engine, p)  # vLLM's own prefix cache
    assert cached == 2 * BS
    reset(engine)
    loaded, cached, _ = generate(engine, p)  # kvtier's pages
    assert cached == 2 * BS
    assert loaded == own == cold
    read = store.read_chunks(TENANT, layout, p[:2 * BS], model_fingerprint=FINGERPRINT)
    codes = [decode_chunk(bytes(read.chunks[i]), layout, token_ids=p[i * BS:(i + 1) * BS])
             .streams["page"].codes for i in range(2)]  # (layers, 1, H, bytes per head)
    pages = [[c[layer].numpy().tobytes() for c in codes] for layer in range(page.layers)]
    (found,) = engine.collective_rpc(pages_in_cache, args=(pages,))
    assert found == [[True, True]] * page.layers


def test_a_session_resumes_and_is_spilled_as_its_next_generation(engine, store, layout):
    turn1 = prompt(300, seed=3)
    out1, cached, params = generate(engine, turn1, session="chat")
    assert cached == 0 and params == {"kvtier_session": "chat", "kvtier_generation": 1}
    computed = len(turn1) + OUT - 1  # the last token sampled has no KV yet
    deadline = time.monotonic() + 60
    while not store.list(TENANT) and time.monotonic() < deadline:
        time.sleep(0.1)
    stat = store.stat(TENANT, "chat").session
    assert (stat.generation, stat.num_tokens, stat.layout_id) == (1, computed, layout.layout_id)
    turn2 = turn1 + out1 + prompt(200, seed=4)
    reset(engine)
    out2, cached, params = generate(engine, turn2, session="chat")
    assert cached == computed // BS * BS
    assert params == {"kvtier_session": "chat", "kvtier_generation": 2}
    assert out2 == generate(engine, turn2, fresh=True)[0]
    deadline = time.monotonic() + 60
    while store.stat(TENANT, "chat").session.generation < 2:
        assert time.monotonic() < deadline, "generation 2 was not spilled"
        time.sleep(0.1)
    stat = store.stat(TENANT, "chat").session
    assert stat.num_tokens == len(turn2) + OUT - 1 and stat.model_fingerprint == FINGERPRINT
    # the session's chunks are the prefix chunks of its tokens: restored whole, every one
    session = store.restore(TENANT, "chat", decode=False)
    assert list(session.token_ids) == (turn2 + out2)[:stat.num_tokens]
    assert len(session.chunk_keys) == stat.num_tokens // BS
    generate(engine, prompt(10, seed=9))  # vLLM reports the engine's counters as it steps
    assert metrics(engine)["spills"] >= 2 and not metrics(engine).get("spill_errors")


def test_damaged_and_lost_chunks_are_recomputed(engine, store, layout, kvtier_server):
    corrupt, lost = prompt(3 * BS + 20, seed=5), prompt(3 * BS + 20, seed=6)
    refs = [generate(engine, p)[0] for p in (corrupt, lost)]
    for p in (corrupt, lost):
        wait_held(store, layout, p, 3)
    # chunk 1 of one prompt corrupted on disk, chunk 1 of the other deleted from the disk
    read = store.read_chunks(TENANT, layout, corrupt[:3 * BS], model_fingerprint=FINGERPRINT)
    damaged = bytes(read.chunks[1])
    hits = 0
    for segment in (kvtier_server.data_dir / "disk" / "segments").iterdir():
        raw = bytearray(segment.read_bytes())
        at = raw.find(damaged)
        if at >= 0:
            raw[at + len(damaged) - 5] ^= 0xFF
            segment.write_bytes(bytes(raw))
            hits += 1
    assert hits == 1
    read = store.read_chunks(TENANT, layout, lost[:3 * BS], model_fingerprint=FINGERPRINT)
    gone = block_key(read.keys[1], chunk_digest(read.chunks[1]))
    kvtier_server.run(kvtier_server.disk.delete(gone))
    errors = metrics(engine).get("load_error_blocks", 0)
    for p, ref in zip((corrupt, lost), refs, strict=True):
        reset(engine)
        out, cached, _ = generate(engine, p)
        assert out == ref
    # each lost its blocks 1 and 2 (the block after a gap is never used)
    assert metrics(engine)["load_error_blocks"] - errors == 4
