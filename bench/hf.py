"""The transformers integration: DeepseekV4's bytes, time to ready and replay fidelity;
int4 K/V judged on the trained Llama test model.

``python -m bench.hf --json [--contexts 1024,4096 --follow 64 --parts deepseek,llama]``

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

``llama`` (``--parts llama``): the trained Llama test model (model/weights/llama_test,
``python -m model.train_llama``), run in bf16, on ``LLAMA_STRETCHES`` stretches of held-out
text (model.data's held-out packages): it prefills ``LLAMA_CONTEXT`` bytes, spills that
cache at bf16 and at ``bits=4`` through the server, resumes the int4 one and
teacher-forces the next ``LLAMA_FOLLOW`` held-out bytes from both caches: ``int4_kl``
(mean KL(bf16 || int4) in nats per token), ``int4_top1`` (top-1 agreement) and
``int4_bytes_vs_bf16`` (bytes the int4 spills sent / the bf16 spills'). ``variants``: the
same figures for other 4-bit arrangements of the same caches, applied in place
(fake-quantized, not stored), with each one's bytes per value against bf16's.

``sliding`` (``--parts sliding``): the sliding-layer bounded replay
(``kvstore.format.hf.sliding_replay``, the transformers integration's ``window="replay"``)
per architecture, the trained Llama test model's weights loaded unchanged (float32) into
``mistral_all_sliding`` (MistralConfig, every layer sliding, W = ``SLIDING_WINDOW``) and
``qwen2_alternating`` (Qwen2Config, layer_types sliding / full alternating, the same W,
its qkv biases zeros): on the same held-out stretches, the never-evicted cache of
``LLAMA_CONTEXT`` bytes against the one whose sliding layers were dropped and rebuilt by
replaying the last R bytes (full layers kept), teacher-forcing the next ``LLAMA_FOLLOW``
bytes: ``sliding_replay: {arch: {R, agreement, kl, by_R}}`` (top-1 agreement and mean KL
(never-evicted || replayed) in nats; the top level at R = W - 1, the default).
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
LLAMA_CONTEXT, LLAMA_FOLLOW, LLAMA_STRETCHES = 1024, 256, 4
# the sliding-layer replay: the trained Llama's weights under a sliding window of W, the
# replay lengths R measured (the first, W - 1, is the integration's default)
SLIDING_WINDOW = 128
SLIDING_REPLAYS = (127, 254, 508)


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


async def _with_server(work):
    """``work(AsyncClient)`` against a fresh in-process server."""
    from kvtier import AsyncClient
    from services.server.config_load import load_config
    from services.server.server import create_server

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(preset="test", env={}, overrides={"data_dir": Path(tmp) / "data"})
        server, port = await create_server(config)
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as kv:
                return await work(kv)
        finally:
            await server.stop(0.5)


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


async def llama_int4(kv) -> dict:
    """The ``llama`` figures (module docstring), through the server behind ``kv``."""
    from kvtier.integrations.transformers import async_resume_cache, async_spill_cache
    from model.data import corpus
    from model.eval import segments
    from model.train_llama import load_llama_test

    model = load_llama_test(dtype=torch.bfloat16)
    stretches = segments(corpus(held_out=True), LLAMA_STRETCHES, LLAMA_CONTEXT + LLAMA_FOLLOW)
    sent = {16: 0, 4: 0}
    refs, gots, variants = [], [], {name: [] for name in VARIANTS}
    for i, stretch in enumerate(stretches):
        ids = torch.tensor(list(stretch), dtype=torch.int64)
        context, follow = ids[:LLAMA_CONTEXT], ids[LLAMA_CONTEXT:]
        with torch.no_grad():
            cache = model(context[None], use_cache=True).past_key_values
        refs.append(follow_logits(model, copy.deepcopy(cache), follow))
        for bits in sent:
            result = await async_spill_cache(kv, "bench", f"llama-{i}-{bits}", model, cache,
                                             context, generation=1, ack="durable",
                                             bits=bits)
            sent[bits] += result.bytes_received
        resumed, _ = await async_resume_cache(kv, "bench", f"llama-{i}-4", model)
        gots.append(follow_logits(model, resumed, follow))
        for name, (quantize, _) in VARIANTS.items():
            changed = copy.deepcopy(cache)
            for layer in changed.layers:
                layer.keys, layer.values = quantize(layer.keys, layer.values)
            variants[name].append(follow_logits(model, changed, follow))
    ref = torch.cat(refs)
    shipped = compare(ref, torch.cat(gots))
    return {"model": "trained Llama test model (model/weights/llama_test), bf16",
            "held_out_stretches": LLAMA_STRETCHES, "context_tokens": LLAMA_CONTEXT,
            "follow_tokens": LLAMA_FOLLOW, "int4_kl": shipped["kl_nats"],
            "int4_top1": shipped["top1_agreement"], "int4_bytes_vs_bf16": sent[4] / sent[16],
            "variants": {name: compare(ref, torch.cat(got)) | {
                "bytes_vs_bf16": VARIANTS[name][1]} for name, got in variants.items()}}


def sliding_variant(arch: str, trained):
    """The trained Llama's weights under ``arch``'s attention pattern (``sliding`` doc)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    c = trained.config
    shape = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                 intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                 num_attention_heads=c.num_attention_heads,
                 num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                 max_position_embeddings=c.max_position_embeddings,
                 rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters,
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                 pad_token_id=None, sliding_window=SLIDING_WINDOW)
    if arch == "mistral_all_sliding":
        model = MistralForCausalLM(MistralConfig(**shape))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, layer_types=[
            "sliding_attention", "full_attention"] * (c.num_hidden_layers // 2)))
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                torch.nn.init.zeros_(p)
    missing, unexpected = model.load_state_dict(trained.state_dict(), strict=False)
    if unexpected or any(not k.endswith("_proj.bias") for k in missing):
        raise RuntimeError(f"{arch}: weights do not fit ({missing}, {unexpected})")
    return model.eval()


def sliding_replay() -> dict:
    """The ``sliding`` figures (module docstring)."""
    from kvstore.format.hf.sliding_replay import replay_sliding_layers
    from model.data import corpus
    from model.eval import segments
    from model.train_llama import load_llama_test

    trained = load_llama_test(dtype=torch.float32)
    stretches = segments(corpus(held_out=True), LLAMA_STRETCHES, LLAMA_CONTEXT + LLAMA_FOLLOW)
    out = {}
    for arch in ("mistral_all_sliding", "qwen2_alternating"):
        model = sliding_variant(arch, trained)
        refs, gots = [], {r: [] for r in SLIDING_REPLAYS}
        for stretch in stretches:
            ids = torch.tensor(list(stretch), dtype=torch.int64)
            context, follow = ids[:LLAMA_CONTEXT], ids[LLAMA_CONTEXT:]
            with torch.no_grad():
                cache = model(context[None], use_cache=True).past_key_values
            refs.append(follow_logits(model, copy.deepcopy(cache), follow))
            for r in SLIDING_REPLAYS:
                dropped = copy.deepcopy(cache)
                for layer in dropped.layers:
                    if layer.is_sliding:  # what a resume without the window holds
                        layer.keys, layer.values = layer.keys[:, :, :0], layer.values[:, :, :0]
                rebuilt = replay_sliding_layers(model, dropped, context, r)
                gots[r].append(follow_logits(model, rebuilt, follow))
        ref = torch.cat(refs)
        by_r = {str(r): compare(ref, torch.cat(got)) for r, got in gots.items()}
        first = by_r[str(SLIDING_REPLAYS[0])]
        out[arch] = {"R": SLIDING_REPLAYS[0], "W": SLIDING_WINDOW,
                     "agreement": first["top1_agreement"], "kl": first["kl_nats"],
                     "layers": [("sliding" if w else "full") for w in
                                (layer.is_sliding for layer in cache.layers)],
                     "by_R": by_r}
        print(f"bench.hf: sliding replay {arch}: {out[arch]}", file=sys.stderr, flush=True)
    return {"model": "trained Llama test model (model/weights/llama_test) weights, float32",
            "held_out_stretches": LLAMA_STRETCHES, "context_tokens": LLAMA_CONTEXT,
            "follow_tokens": LLAMA_FOLLOW, **out}


def _per_token(x: torch.Tensor, group: int, bits: int = 4, zero_point: bool = False
               ) -> torch.Tensor:
    """x (..., D) rounded as groups of ``group`` along its last axis with fp16 scales
    (and fp16 minimums as zero points)."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    if zero_point:
        low = g.amin(-1, keepdim=True).half().float()
        scale = ((g.amax(-1, keepdim=True) - low) / (2 ** bits - 1)).half().float()
        safe = torch.where(scale > 0, scale, 1.0)
        out = torch.round((g - low) / safe).clamp(0, 2 ** bits - 1) * scale + low
    else:
        qmax = 2 ** (bits - 1) - 1
        scale = (g.abs().amax(-1, keepdim=True) / qmax).half().float()
        safe = torch.where(scale > 0, scale, 1.0)
        out = torch.round(g / safe).clamp(-qmax - 1, qmax) * scale
    return out.reshape(x.shape).to(x.dtype)


def _per_channel(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """x (1, H, T, D) rounded per channel over groups of ``tokens`` tokens, with zero
    points (KIVI's keys); the last T % tokens rows as they are (KIVI's residual)."""
    full = x.shape[2] // tokens * tokens
    b, h, _, d = x.shape
    groups = x[:, :, :full].reshape(b, h, full // tokens, tokens, d).transpose(-1, -2)
    out = x.clone()
    out[:, :, :full] = _per_token(groups, tokens, zero_point=True).transpose(-1, -2) \
        .reshape(b, h, full, d)
    return out


def _keep_recent(quantize, rows: int):
    def kept(k: torch.Tensor, v: torch.Tensor):
        qk, qv = quantize(k, v)
        qk[:, :, -rows:], qv[:, :, -rows:] = k[:, :, -rows:], v[:, :, -rows:]
        return qk, qv
    return kept


def _int4_tokens(k, v):
    return _per_token(k, 32), _per_token(v, 32)


# name -> ((K, V) (1, H, T, D) -> their rounded values, bytes per value / bf16's 2)
VARIANTS = {
    "per_token_g32 (the int4 format)": (_int4_tokens, (0.5 + 2 / 32) / 2),
    "per_token_g16": (lambda k, v: (_per_token(k, 16), _per_token(v, 16)), (0.5 + 2 / 16) / 2),
    "per_token_g64_zero_point": (
        lambda k, v: (_per_token(k, 64, zero_point=True), _per_token(v, 64, zero_point=True)),
        (0.5 + 4 / 64) / 2),
    "kivi_k_channel16_v_token32_zero_points": (
        lambda k, v: (_per_channel(k, 16), _per_token(v, 32, zero_point=True)),
        (0.5 + 4 / 16 + 0.5 + 4 / 32) / 4),
    "kivi_k_channel64_v_token64_zero_points": (
        lambda k, v: (_per_channel(k, 64), _per_token(v, 64, zero_point=True)),
        (0.5 + 4 / 64) / 2),
    "per_token_g32_recent128_bf16": (
        _keep_recent(_int4_tokens, 128),
        ((1 - 128 / LLAMA_CONTEXT) * (0.5 + 2 / 32) + 128 / LLAMA_CONTEXT * 2) / 2),
    "k_int8_v_int4": (lambda k, v: (_per_token(k, 64, bits=8), _per_token(v, 32)),
                      (1 + 2 / 64 + 0.5 + 2 / 32) / 4),
    "k_bf16_v_int4": (lambda k, v: (k, _per_token(v, 32)), (2 + 0.5 + 2 / 32) / 4),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--follow", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--parts", default="deepseek,llama,sliding",
                        help="deepseek (the DeepseekV4 figures), llama (int4 on the trained "
                        "Llama test model), sliding (the sliding-layer replay on its weights)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    known = {"deepseek", "llama", "sliding"}
    if parts - known:
        parser.error(f"unknown parts {sorted(parts - known)}")
    result = {}
    if "deepseek" in parts:
        result = asyncio.run(run([int(c) for c in args.contexts.split(",")], args.follow,
                                 args.seed, args.bits))
    if "llama" in parts:
        result["llama_test"] = asyncio.run(_with_server(llama_int4))
    if "sliding" in parts:
        result["sliding_replay"] = sliding_replay()
    print(json.dumps(result, indent=2) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
