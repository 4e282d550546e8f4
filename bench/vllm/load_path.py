"""The connector's load path alone, beside a memcpy of the same bytes, in one run.

``load_vs_memcpy()`` stores a prompt's blocks (the mid model's shape at 4k tokens by
default: 8 layers, 4 KV heads of 64, bf16, blocks of 128 tokens, 32 MiB of KV) in a kvtier
server of its own process on this host (``testing.live_server``, as bench.vllm runs it) with
a host RAM tier that holds them, under the engine-page layout (``value_format`` auto) and
the token-major one (portable), then loads each ``repeats`` times with
``transfers.run_load`` into a fake CPU paged cache (no engine; one torch thread, as vLLM's
CPU worker; the blocks in reverse order, so each layer's are scattered), and copies the
same number of bytes with one ``torch`` memcpy as many times, all interleaved. Medians:

    {"load_GBps": ..., "memcpy_GBps": ..., "load_vs_memcpy": ..., "load_s": ...,
     "bytes": ..., "stages": {...}, "token_major": {"load_vs_memcpy": ..., ...}}

(the top level is the engine pages' load, ``token_major`` the portable layout's).

``stages`` splits a load in two (``profile_stages``, medians of ``repeats`` more): the
ReadChunks call with the client's checks (``read_chunks_s``), and the rest of the load, the
block writes (``write_s``). Run in .venv-vllm (the connector imports vLLM):
``python -m bench.vllm.load_path``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from testing import vllm_models
from testing.live_server import LiveServer

TENANT = "bench-load"
FINGERPRINT = "bench-load-path"


def _store(client, spec, shape, blocks: int, pages: bool):
    from kvtier.integrations.vllm.config import ConnectorConfig
    from kvtier.integrations.vllm.repack import PagedLayout
    from kvtier.integrations.vllm.stats import StatsCounter
    from kvtier.integrations.vllm.transfers import Store

    config = ConnectorConfig.from_extra({"tenant": TENANT, "model_fingerprint": FINGERPRINT,
                                         "ack": "memory"})
    paged = PagedLayout("cpu", shape.kv_heads, shape.head_size, shape.block_size, pages)
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(blocks, shape.kv_heads, shape.block_size, 2 * shape.head_size,
                          generator=g).to(shape.dtype) for _ in range(shape.layers)]
    return Store(client, config, spec, paged, layers, shape.dtype, StatsCounter())


def load_vs_memcpy(model: vllm_models.LlamaSpec = vllm_models.MID, tokens: int = 4096,
                   repeats: int = 7, block_size: int = 128) -> dict:
    """Load GB/s of ``tokens`` tokens of ``model``'s KV from host RAM against a memcpy of
    the same bytes, medians of ``repeats`` runs each (see the module docstring)."""
    from kvtier.integrations.vllm.layout import CacheShape, rank_layout
    from kvtier.integrations.vllm.metadata import LoadPlan, SavePlan
    from kvtier.integrations.vllm.transfers import run_save
    from kvtier.sync import Client

    torch.set_num_threads(1)  # as vLLM's CPU worker runs
    head = model.hidden // model.heads
    # a fake cache of CPU_ATTN's shape; the vec path's arrangement, as named
    shape = CacheShape(model.layers, model.kv_heads, head, block_size, model.vocab,
                       torch.bfloat16, 1, "cpu_attn.vec")
    count = tokens // block_size
    ids = tuple(vllm_models.prompt(model, count * block_size, seed=1))
    kv_bytes = count * block_size * model.layers * 2 * model.kv_heads * head * 2
    with tempfile.TemporaryDirectory(prefix="kvtier-load-path-") as tmp, \
            LiveServer(Path(tmp) / "data", Path(tmp), replay=False,
                       env={"KVTIER_HOST_BYTES": str(8 * kv_bytes + (64 << 20))}) as live, \
            Client(live.target) as client:
        order = tuple(range(count + 7, 7, -1))  # other blocks than the source's
        targets = {}
        for value_format in ("auto", "portable"):
            spec = rank_layout(shape, 0, value_format)
            client.register_layout(spec)
            pages = value_format == "auto"
            source = _store(client, spec, shape, count, pages)
            plan = SavePlan("save", ids, 0, tuple(range(count)))
            raw = [source.paged.take(layer, source.block_index(plan.block_ids))
                   for layer in source.layers]
            run_save(source, plan, raw)
            if source.stats.take().data["save_errors"]:
                raise RuntimeError("the bench's save failed")
            targets[value_format] = target = _store(client, spec, shape, count + 8, pages)
            load(target, ids, order, count)  # warm: the segment leased, pages faulted in
            for i, layer in enumerate(target.layers):
                if not torch.equal(layer[list(order)].view(torch.int16),
                                   source.layers[i][:count].view(torch.int16)):
                    raise RuntimeError("the bench's load wrote other values")
        src = torch.empty(kv_bytes, dtype=torch.uint8).random_(0, 255)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm

        def memcpy() -> float:
            started = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - started

        # interleaved, so all see the same load on the machine
        pages, tokens, copies = zip(*[(load(targets["auto"], ids, order, count),
                                       load(targets["portable"], ids, order, count),
                                       memcpy()) for _ in range(repeats)], strict=True)
        stages = {f: profile_stages(targets[f], LoadPlan("load", ids, 0, order), repeats)
                  for f in targets}
    copy_s = statistics.median(copies)

    def result(loads, stage: dict) -> dict:
        load_s = statistics.median(loads)
        return {"load_GBps": kv_bytes / load_s / 1e9, "load_vs_memcpy": copy_s / load_s,
                "load_s": load_s, "stages": stage}

    return {**result(pages, stages["auto"]), "memcpy_GBps": kv_bytes / copy_s / 1e9,
            "memcpy_s": copy_s, "bytes": kv_bytes,
            "token_major": result(tokens, stages["portable"])}


def load(store, ids: tuple[int, ...], order: tuple[int, ...], count: int) -> float:
    """Seconds of one ``run_load`` of ``count`` chunks of ``ids`` into blocks ``order``."""
    from kvtier.integrations.vllm.metadata import LoadPlan
    from kvtier.integrations.vllm.transfers import LoadJob, run_load

    job = LoadJob.of(LoadPlan("load", ids, 0, order), len(store.layers))
    started = time.perf_counter()
    run_load(store, job)
    took = time.perf_counter() - started
    if job.loaded_chunks != count:
        raise RuntimeError(f"the bench's load loaded {job.loaded_chunks} of {count} chunks")
    return took


def profile_stages(store, plan, repeats: int) -> dict[str, float]:
    """Medians of ``repeats``: seconds of the ReadChunks call alone (the reply read in
    place and checked), and of the rest of a whole load (the block writes)."""
    from kvtier.integrations.vllm.transfers import LoadJob, run_load

    reads, loads = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        with store.client.read_chunks(
                store.config.tenant, store.spec, list(plan.token_ids),
                first_chunk=plan.first_chunk, max_chunks=len(plan.block_ids),
                model_fingerprint=store.config.model_fingerprint, check_digests=False,
                in_place=True):
            reads.append(time.perf_counter() - started)
        job = LoadJob.of(plan, len(store.layers))
        started = time.perf_counter()
        run_load(store, job)
        loads.append(time.perf_counter() - started)
    read_s = statistics.median(reads)
    return {"read_chunks_s": read_s, "write_s": statistics.median(loads) - read_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile one run's loads")
    args = parser.parse_args()
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        result = load_vs_memcpy(tokens=args.tokens, repeats=args.repeats)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    else:
        result = load_vs_memcpy(tokens=args.tokens, repeats=args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
