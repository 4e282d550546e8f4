"""Hybrid and sliding-window models through kvtier in a real vLLM engine (CPU build, one
engine per model): a Gemma3-like model (5 sliding layers, window 128, and a full one),
a Mistral whose every layer slides and a gpt-oss-like model (sliding and full layers
alternating, attention sinks, a small MoE). A hit loaded from kvtier gives the top-k
logprobs of vLLM's own prefix-cache hit, and each group stores what its layout says: a
full group every block, a sliding group only the trailing window's block at the
prompt's end, where a longer prompt sharing it hits too."""

from __future__ import annotations

import os
import random
import time

import pytest

pytest.importorskip("vllm")

from kvstore.format.chunk import decode_chunk  # noqa: E402
from kvtier import Client  # noqa: E402
from testing import vllm_hybrid  # noqa: E402

TENANT = "groups-test"
BS = 128  # vLLM's block size on the CPU
OUT = 6
TOP = 5


def prompt(spec, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, spec.vocab) for _ in range(length)]


@pytest.fixture(scope="module", params=[vllm_hybrid.GEMMA3, vllm_hybrid.MISTRAL,
                                               vllm_hybrid.GPT_OSS],
                ids=lambda s: s.family)
def engine(request, kvtier_server):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    spec = request.param
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    transfer = KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"server": kvtier_server.target, "tenant": TENANT,
                                   "model_fingerprint": f"{spec.name}-{spec.digest}",
                                   "ack": "durable", "timeout_s": 60,
                                   "lookup_timeout_ms": 10000})
    llm = LLM(model=str(vllm_hybrid.build(spec)), dtype="bfloat16", max_model_len=2048,
              enforce_eager=True, skip_tokenizer_init=True, seed=0,
              kv_transfer_config=transfer)
    yield spec, llm
    del llm


def generate(llm, tokens):
    """One greedy request: (token ids, top-k logprobs per token, num_cached_tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=OUT, temperature=0.0, detokenize=False, logprobs=TOP)
    (reply,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    out = reply.outputs[0]
    top = [{t: round(lp.logprob, 6) for t, lp in step.items()} for step in out.logprobs]
    return list(out.token_ids), top, reply.num_cached_tokens


def reset(llm) -> None:
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "vLLM kept blocks for a minute"
        time.sleep(0.1)


def held(client, layout, tokens, fingerprint) -> set[int]:
    with client.read_chunks(TENANT, layout, tokens, model_fingerprint=fingerprint) as read:
        return set(read.chunks)


def test_a_hit_from_kvtier_is_vllms_own_and_groups_store_their_windows(engine,
                                                                      kvtier_server):
    spec, llm = engine
    fingerprint = f"{spec.name}-{spec.digest}"
    p = prompt(spec, 5 * BS + 50, seed=len(spec.name))
    cold = generate(llm, p)
    assert cold[2] == 0
    own = generate(llm, p)  # vLLM's own prefix cache
    assert own[2] == 5 * BS
    with Client(kvtier_server.target) as client:
        # vLLM splits the Gemma3-like model into 6 groups of one layer, the Mistral's
        # layers are one sliding group, the gpt-oss-like model's a sliding and a full
        # group; each group has its own layout. The prompt's window end is 640: a sliding
        # group keeps block 4 alone (its window of 127 tokens back), a full group 0-4.
        counts = {"gemma3": (5, 1), "mistral": (1, 0), "gpt_oss": (1, 1)}[spec.family]
        # this engine's layouts (the session's server also holds other tests' ones)
        names = [i.spec for i in client.layouts()
                 if i.spec.name.startswith("vllm-") and i.spec.vocab_size == spec.vocab]
        deadline = time.monotonic() + 60
        while True:
            got = {s.name: held(client, s, p[:5 * BS], fingerprint) for s in names}
            sliding = {n: h for n, h in got.items() if h and "-swa128-" in n}
            full = {n: h for n, h in got.items() if h and "-swa" not in n}
            if (len(sliding), len(full)) == counts and all(
                    h == {4} for h in sliding.values()) and all(
                    h == set(range(5)) for h in full.values()):
                break
            assert time.monotonic() < deadline, f"stored {got}"
            time.sleep(0.2)
        layouts = [s for s in names if s.name in sliding or s.name in full]
        # a chunk holds each layer's block as the engine's page, nothing more
        for layout in layouts:
            read = client.read_chunks(TENANT, layout, p[:5 * BS], model_fingerprint=fingerprint)
            chunk = decode_chunk(bytes(read.chunks[4]), layout, token_ids=p[4 * BS:5 * BS])
            (page,) = layout.streams
            codes = chunk.streams["page"].codes
            assert codes.numel() == page.layers * BS * 2 * spec.kv_heads * spec.head_dim * 2
    reset(llm)
    loaded = generate(llm, p)  # from kvtier
    assert loaded[2] == 5 * BS
    assert loaded == own
    assert cold[0] == own[0]
    # a longer prompt sharing it hits at the stored window's end, nowhere past it
    reset(llm)
    longer = p + prompt(spec, 3 * BS, seed=99)
    assert generate(llm, longer)[2] == 5 * BS
