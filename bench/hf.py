"""The transformers integration on DeepseekV4: bytes, time to ready and replay fidelity.

``python -m bench.hf --json [--contexts 1024,4096 --follow 64]``

A tiny DeepseekV4 (``tiny_config``: 4 layers - sliding, CSA, HCA, CSA - hidden 128, 4
routed experts, about 1.0 M parameters) with **seeded random weights** (transformers'
own initialisation, seed ``--seed``; no checkpoint is downloaded), on random token ids.
For each context C it prefills C tokens (the never-evicted cache), spills that cache
through a real kvtier server (in this process, ``replay_hf_model`` = the config, so the
server's Resume replays with the same weights) with ``kvtier.integrations.transformers``,
and resumes it:

- ``persisted_bytes_per_token``: bytes the spill sent (chunks + tail, the window dropped)
  per token; ``bf16_bytes_per_token``: the model's own cache at bf16 (compressed entries
  per token, plus the window and partial-block state spread over C);
- ``ready_seconds``: ``async_resume_cache`` (restore + the server's replay, checked by its
  replay count, + building the cache; the server loads its model on the first one)
  against ``prefill_seconds`` (re-prefilling C tokens), ``speedup_vs_prefill``;
- per R in 0, 128, 256: ``kl_nats`` (mean KL(never-evicted || resumed)) and
  ``top1_agreement`` over the next ``--follow`` tokens (the never-evicted model's greedy
  continuation, teacher-forced), and ``greedy_match_tokens`` (leading tokens of a greedy
  continuation from the resumed cache equal to the never-evicted one's). R = 0 replays
  nothing: the window rows are zeros (a DeepseekV4 cache past W tokens must hold W - 1
  rows) and the partial-block state is empty.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

REPLAYS = (0, 128, 256)


def tiny_config(**changes):
    from transformers import DeepseekV4Config

    fields = dict(
        vocab_size=512, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=64,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, hc_mult=2,
        hc_sinkhorn_iters=4, sliding_window=128, o_groups=2, o_lora_rank=64, index_n_heads=4,
        index_head_dim=32, index_topk=16, partial_rotary_factor=0.25,
        max_position_embeddings=8192,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"])
    return DeepseekV4Config(**(fields | changes))


def tiny_model(seed: int = 0, **changes):
    """The tiny DeepseekV4 with weights drawn from ``seed`` (what ``replay_hf_seed`` of
    a config JSON gives the server's replayer)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(**changes)).eval()


@torch.no_grad()
def follow_logits(model, cache, follow: torch.Tensor) -> torch.Tensor:
    """(len(follow), vocab) logits of the teacher-forced tokens after the cache's."""
    return model(follow[None], past_key_values=cache, use_cache=True).logits[0].float()


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                  reduction="batchmean")
    return {"kl_nats": kl.item(),
            "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


@torch.no_grad()
def greedy(model, ids: torch.Tensor, cache, count: int) -> torch.Tensor:
    """``count`` greedy tokens after ``ids`` (n + 1 tokens: the cache holds the first n)."""
    out = model.generate(ids[None], past_key_values=cache, max_new_tokens=count,
                         do_sample=False, min_new_tokens=count)
    return out[0, len(ids):]


def leading_matches(a: torch.Tensor, b: torch.Tensor) -> int:
    same = (a == b).tolist() + [False]
    return same.index(False)


def zero_window_cache(spec, model, n: int, persistent: dict):
    from kvstore.format.hf import deepseek_v4
    from kvstore.format.hf.quant import encode_values

    stream = spec.stream("window")
    rows = min(n, model.config.sliding_window - 1)
    zeros = torch.zeros(stream.layers, rows, *stream.entry_shape)
    return deepseek_v4.build_cache(spec, model, n, persistent,
                                   {"window": encode_values(stream, zeros)})


async def run(contexts: list[int], follow: int, seed: int, bits: int) -> dict:
    from kvstore.format.hf.model_layouts import persistent_bf16_bytes_per_token
    from kvtier import AsyncClient
    from kvtier.integrations.transformers import (
        async_resume_cache,
        async_spill_cache,
        model_layout,
    )
    from services.server.config_load import load_config
    from services.server.server import create_server

    model = tiny_model(seed)
    spec = model_layout(model, bits)
    params = sum(p.numel() for p in model.parameters())
    out = {"model": "tiny DeepseekV4, seeded random weights (transformers init, seed "
                    f"{seed}), no checkpoint", "parameters": params,
           "layout": spec.layout_id, "bits": bits, "follow_tokens": follow,
           "torch_threads": torch.get_num_threads(), "contexts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        config_json = Path(tmp) / "config.json"
        model.config.to_json_file(config_json)
        config = load_config(preset="test", env={}, overrides={
            "data_dir": Path(tmp) / "data", "replay_hf_model": str(config_json),
            "replay_hf_seed": seed})
        server, port = await create_server(config)
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as kv:
                for n in contexts:
                    out["contexts"][str(n)] = await _context(kv, model, spec, n, follow, seed,
                                                             async_spill_cache,
                                                             async_resume_cache,
                                                             persistent_bf16_bytes_per_token)
        finally:
            await server.stop(0.5)
    return out


async def _context(kv, model, spec, n, follow, seed, spill, resume, bf16_entries) -> dict:
    from kvstore.format.hf.deepseek_v4 import persistent_streams, window_streams

    gen = torch.Generator().manual_seed(seed + n)
    ids = torch.randint(0, model.config.vocab_size, (n + 1,), generator=gen)
    started = time.perf_counter()
    with torch.no_grad():
        cache = model(ids[None, :n], use_cache=True).past_key_values
    prefill_s = time.perf_counter() - started
    continuation = greedy(model, ids, copy.deepcopy(cache), follow)
    forced = torch.cat([ids[n:], continuation[:-1]])  # the next `follow` inputs
    ref = follow_logits(model, copy.deepcopy(cache), forced)
    row = {"tokens": n, "prefill_seconds": prefill_s, "replays": {}}
    ephemeral = sum(d.codes.numel() * 2 for d in window_streams(spec, model.config,
                                                                cache).values())
    row["bf16_bytes_per_token"] = bf16_entries(spec) + ephemeral / n
    for r in REPLAYS:
        session = f"ctx{n}-r{r}"
        result = await spill(kv, "bench", session, model, cache, ids[:n], generation=1,
                             ack="durable", bits=spec.stream("csa.kv").bits)
        row["persisted_bytes_per_token"] = result.bytes_received / n
        if r == 0:
            persistent = persistent_streams(spec, model.config, cache)
            resumed, ready_s = zero_window_cache(spec, model, n, persistent), None
        else:
            replays = (await kv.stat()).replays
            started = time.perf_counter()
            resumed, _ = await resume(kv, "bench", session, model, replay_tokens=r,
                                      replay="server")
            ready_s = time.perf_counter() - started
            if (await kv.stat()).replays != replays + 1:
                raise RuntimeError(f"the server did not replay session {session}")
        figures = compare(ref, follow_logits(model, copy.deepcopy(resumed), forced))
        figures["greedy_match_tokens"] = leading_matches(
            greedy(model, ids, resumed, follow), continuation)
        if ready_s is not None:
            figures |= {"ready_seconds": ready_s, "speedup_vs_prefill": prefill_s / ready_s}
        row["replays"][str(r)] = figures
        print(f"bench.hf: {n} tokens R={r}: {figures}", file=sys.stderr, flush=True)
    row["persisted_vs_bf16"] = row["bf16_bytes_per_token"] / row["persisted_bytes_per_token"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--follow", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(run([int(c) for c in args.contexts.split(",")], args.follow,
                             args.seed, args.bits))
    print(json.dumps(result, indent=2) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
