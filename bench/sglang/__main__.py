"""kvtier as SGLang's HiCache L3 storage beside SGLang's own ``HiCacheFile``, through
SGLang 0.5.23's real host pool, in one run.

``python -m bench.sglang [--json] [--pages 64] [--batch 16] [--layers 8] [--page-size 32]
[--repeats 5] [--small-page-sizes 1,16] [--small-pages 256] [--small-batch 128]`` (in
.venv-sglang: ``make sglang``).

Configurations, one after the other in one run: ``--page-size`` tokens a page (32: 1 MiB
pages, the result's top-level keys), then each of ``--small-page-sizes`` (1: 32 KiB pages,
SGLang's default page size; 16: 512 KiB; "" for none), each a dict of the same keys in
``small_pages``, their pages ``--small-batch`` a call (128: SGLang's
``STORAGE_BATCH_SIZE``, what its controller passes for any prefetch or backup of 128
pages or more).

One ``MHATokenToKVPoolHost`` (page_first, bf16, 8 KV heads of 128: a Llama-8B-like rank's
geometry, ``--layers`` layers) holds ``--pages`` pages of random bytes. Each backend is
built by SGLang's own ``StorageBackendFactory``, then stores every page and loads it back
into a second pool, ``--batch`` pages a call (SGLang's batches are up to 128), the way
SGLang's cache controller calls it:

- kvtier: ``KVTierStorage`` (``dynamic``, ``interface_v1``) against a live kvtier server
  (``kvtier serve --preset test``, its own process, its host RAM tier holding every
  page): ``batch_set_v1`` / ``batch_get_v1`` with host indices, a call's pages one kvtier
  call each way. Every page read is checked end to end: the server sends only bytes of
  the BLAKE2b digest the page was written with, the client checks each chunk's header,
  section table, payload checksum (xxh3) and its key's stand-in tokens.
- hicache_file: ``HiCacheFile`` over a temporary directory (the OS page cache holds every
  file): the controller's legacy path, ``get_data_page`` + ``batch_set`` and
  ``batch_get`` into flat pages + ``set_from_flat_data_page``. It checks nothing.

Each set and get pass runs ``--repeats`` times over fresh keys (sets) or the same keys
(gets), the two backends' passes interleaved so a change in the machine's load falls on
both; the best pass counts. The get passes start once the kvtier server's write-back of
the pages it acked in memory has drained to its disk tier (it would otherwise run on the
same two cores as the gets). Every loaded page is compared with its source after the
timing: ``bytes_equal`` says all were. Figures: pages/s and GB/s (10^9 B) of page bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from kvtier.integrations.sglang.storage import KVTierStorage
from testing.live_server import LiveServer
from testing.sglang_pools import (
    KVTIER,
    backend,
    fill_random,
    host_pool,
    page_indices,
    storage_config,
)

LAYOUT = "page_first"
HEADS, HEAD_DIM = 8, 128


def _pools(args):
    tokens = 2 * args.pages * args.page_size  # the host pool holds twice this many
    make = lambda: host_pool("mha", LAYOUT, layers=args.layers, heads=HEADS,  # noqa: E731
                             head_dim=HEAD_DIM, page_size=args.page_size, device_tokens=tokens)
    return make(), make()


def _batches(args):
    return [list(range(i, min(i + args.batch, args.pages))) for i in range(0, args.pages,
                                                                            args.batch)]


def _kvtier_pass(store, pool, target, names, args, op: str) -> float:
    store.register_mem_pool_host(pool if op == "set" else target)  # v1 moves pages of it
    started = time.perf_counter()
    for batch in _batches(args):
        keys = [names[p] for p in batch]
        if op == "set":
            done = store.batch_set_v1(keys, page_indices(pool, batch))
        else:
            done = store.batch_get_v1(keys, page_indices(target, batch))
        if not all(done):
            raise RuntimeError(f"kvtier {op} failed pages: {done}")
    return time.perf_counter() - started


def _file_pass(files, pool, target, names, args, op: str) -> float:
    files.register_mem_pool_host(pool if op == "set" else target)
    started = time.perf_counter()
    for batch in _batches(args):
        keys = [names[p] for p in batch]
        if op == "set":
            if not files.batch_set(keys, [pool.get_data_page(p * pool.page_size)
                                          for p in batch]):
                raise RuntimeError("HiCacheFile set failed")
            continue
        pages = files.batch_get(keys, [target.get_dummy_flat_data_page() for _ in batch])
        for p, page in zip(batch, pages, strict=True):
            if page is None:
                raise RuntimeError(f"HiCacheFile get missed page {p}")
            target.set_from_flat_data_page(p * target.page_size, page)
    return time.perf_counter() - started


def _equal(pool, target, pages: int) -> bool:
    return all(torch.equal(pool.get_data_page(p * pool.page_size).view(torch.uint8),
                           target.get_data_page(p * target.page_size).view(torch.uint8))
               for p in range(pages))


def _rates(name: str, seconds: dict[str, float], args, page_bytes: int) -> dict:
    out = {}
    for op, best in seconds.items():
        out[f"{name}_{op}_s"] = best
        out[f"{name}_{op}_pages_per_s"] = args.pages / best
        out[f"{name}_{op}_GBps"] = args.pages * page_bytes / best / 1e9
    return out


def _settled(store, most_s: float = 120.0) -> None:
    """Wait (at most ``most_s``) until a kvtier server has copied every page it acked in
    memory to its disk tier: its background write-back would otherwise share the
    machine's two cores with the get passes, which HiCacheFile's finished writes do not."""
    if not isinstance(store, KVTierStorage):
        return
    deadline = time.monotonic() + most_s
    while store.client.stat().writeback_queue_depth and time.monotonic() < deadline:
        time.sleep(0.05)


def _compare(backends: dict, pool, target, args) -> tuple[dict, bool]:
    """The best pass of each backend and op, the backends' passes interleaved so a change
    in the machine's load falls on both; whether every loaded page equalled its source."""
    best = {name: {"set": float("inf"), "get": float("inf")} for name in backends}
    names = {}
    for _ in range(args.repeats):
        for name, (made, run_pass) in backends.items():
            run = uuid.uuid4().hex
            names[name] = [f"{run}-{p}" for p in range(args.pages)]
            seconds = run_pass(made, pool, target, names[name], args, "set")
            best[name]["set"] = min(best[name]["set"], seconds)
    for made, _ in backends.values():
        _settled(made)
    equal = True
    for _ in range(args.repeats):
        for name, (made, run_pass) in backends.items():
            target.kv_buffer.zero_()
            seconds = run_pass(made, pool, target, names[name], args, "get")
            best[name]["get"] = min(best[name]["get"], seconds)
            equal = equal and _equal(pool, target, args.pages)
    return best, equal


def run(args) -> dict:
    result = _configuration(args)
    sizes = [int(size) for size in args.small_page_sizes.split(",") if size.strip()]
    result["small_pages"] = [_configuration(argparse.Namespace(
        **{**vars(args), "page_size": size, "pages": args.small_pages,
           "batch": args.small_batch})) for size in sizes]
    return result


def _configuration(args) -> dict:
    pool, target = _pools(args)
    fill_random(pool, args.pages, seed=1)
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    result = {"pages": args.pages, "batch": args.batch, "page_bytes": page_bytes,
              "layers": args.layers, "page_size": args.page_size, "repeats": args.repeats,
              "layout": LAYOUT, "dtype": "bf16", "kv_heads": HEADS, "head_dim": HEAD_DIM}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-sglang-") as tmp:
        work = Path(tmp)
        host_bytes = 4 * args.repeats * args.pages * page_bytes  # every page in host RAM
        with LiveServer(work / "data", work, replay=False,
                        env={"KVTIER_HOST_BYTES": str(host_bytes)}) as live:
            extra = {**KVTIER, "server": live.target, "model_fingerprint": "bench@1",
                     "timeout_ms": 30000}
            kv = backend("dynamic", pool, storage_config("mha", LAYOUT, extra))
            files = backend("file", pool, storage_config(
                "mha", LAYOUT, {"file_storage_path": str(work / "hicache")}))
            best, result["bytes_equal"] = _compare(
                {"kvtier": (kv, _kvtier_pass), "hicache_file": (files, _file_pass)},
                pool, target, args)
            result["kvtier_shared_memory"] = kv.client.shared_memory
            kv.close()
    for name, seconds in best.items():
        result.update(_rates(name, seconds, args, page_bytes))
    result["get_vs_hicache_file"] = result["kvtier_get_GBps"] / result["hicache_file_get_GBps"]
    result["set_vs_hicache_file"] = result["kvtier_set_GBps"] / result["hicache_file_set_GBps"]
    result["cpus"] = os.cpu_count()
    result["load_avg"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sglang", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small-page-sizes", default="1,16",
                        help="tokens a page of each small-page configuration ('': none)")
    parser.add_argument("--small-pages", type=int, default=256)
    parser.add_argument("--small-batch", type=int, default=128)
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
