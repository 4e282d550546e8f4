"""A same-host ReadChunks into a destination buffer: the chunks copied by the server into a
reply segment (the path before the shared host tier) against read in place from the host
tier's own slabs under a read lease, side by side in one run, beside a memcpy of the same
bytes.

``python -m bench.read_in_place --json`` runs two cases, each a read of independent
chunks (an SGLang backend's call: pages of raw bytes, a layout of one stream, keyed by
stand-in tokens) from a server whose host tier holds them:

- ``big``: 32 pages of 1 MiB (SGLang pages of 32 tokens of a Llama-8B-like rank), 32 MiB
  a call;
- ``pages``: 128 pages of 32 KiB (one-token pages, SGLang's default), one call.

A call is ``read_independent_chunks(..., in_place=True, check_digests=False)`` (as the
engine integrations call it: every chunk's header, section table, payload checksum and
stand-in tokens checked), each page's payload copied into a preallocated destination
(a (pages * page_bytes,) uint8 tensor), then ``release``. The reply-segment path is the
same server with its shared host tier hidden from the ReadChunks calls, so it copies the
chunks into the reply segment, which the client lends the caller instead. The server runs
in this process, on the same event loop: a call's time is the server's work plus the
client's. Medians of ``--repeats`` calls each, the two paths interleaved; ms a call and
GB/s (10^9 B) of page bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import numpy as np
import torch

from kvstore.format.chunk import encode_raw, head_bytes
from kvstore.format.layout import LayoutSpec, Stream
from kvtier.client import AsyncClient
from services.server.config_load import load_config
from services.server.server import create_server

KEY_TOKENS = 16  # stand-in tokens a page, as the SGLang backend keys them
CASES = {"big": (32, 1 << 20), "pages": (128, 32 << 10)}  # (pages a call, bytes a page)


def page_layout(page_bytes: int) -> LayoutSpec:
    return LayoutSpec(f"bench-page-{page_bytes}B",
                      (Stream("page", (page_bytes // 2 // KEY_TOKENS,), bits=16,
                              format="fp16"),),
                      chunk_tokens=KEY_TOKENS, vocab_size=1 << 16)


async def one_case(kv: AsyncClient, server, pages: int, page_bytes: int, repeats: int
                   ) -> dict:
    spec = page_layout(page_bytes)
    await kv.register_layout(spec)
    rng = np.random.default_rng(pages)
    tokens = rng.integers(0, 1 << 16, pages * KEY_TOKENS, dtype=np.uint32)
    raw = rng.integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    chunks = [encode_raw(spec, 0, tokens[i * KEY_TOKENS:(i + 1) * KEY_TOKENS], raw[i].data)
              for i in range(pages)]
    await kv.write_independent_chunks("bench", spec, tokens, chunks, ack="memory")
    offset = head_bytes(spec, KEY_TOKENS)
    destination = torch.empty(pages * page_bytes, dtype=torch.uint8)  # (pages * page_bytes,)
    dest = destination.numpy()
    arena = server.servicer.chunks.arena

    async def call(in_place: bool) -> float:
        server.servicer.chunks.arena = arena if in_place else None
        started = time.perf_counter()
        with await kv.read_independent_chunks("bench", spec, tokens, check_digests=False,
                                              in_place=True) as got:
            for i in range(pages):
                dest[i * page_bytes:(i + 1) * page_bytes] = np.frombuffer(
                    got.chunks[i], np.uint8, page_bytes, offset)
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"reply_segment": [], "in_place": []}
    source = torch.from_numpy(raw.reshape(-1))
    memcpy: list[float] = []
    for _ in range(2):  # warm: the segment leased, the pages moved into the tenant's slabs
        await call(False)
        await call(True)
    for _ in range(repeats):
        times["reply_segment"].append(await call(False))
        times["in_place"].append(await call(True))
        started = time.perf_counter()
        destination.copy_(source)
        memcpy.append(time.perf_counter() - started)
    assert torch.equal(destination, source), "the pages read are not the pages written"
    server.servicer.chunks.arena = arena
    total = pages * page_bytes
    out: dict = {"pages": pages, "page_bytes": page_bytes, "bytes": total}
    for path, seconds in (*times.items(), ("memcpy", memcpy)):
        median = statistics.median(seconds)
        out[path] = {"ms": round(median * 1e3, 3), "GBps": round(total / median / 1e9, 3)}
    out["in_place_vs_reply_segment"] = round(out["reply_segment"]["ms"]
                                             / out["in_place"]["ms"], 2)
    return out


async def measure(repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as data_dir:
        config = load_config(preset="test", env={}, overrides={
            "data_dir": data_dir, "host_bytes": 256 << 20, "disk_bytes": 0,
            "object_bytes": 0, "max_message_bytes": 256 << 20})
        server, port = await create_server(config)
        try:
            async with AsyncClient(f"127.0.0.1:{port}", shared_memory=True,
                                   max_message_bytes=256 << 20) as kv:
                return {name: await one_case(kv, server, pages, page_bytes, repeats)
                        for name, (pages, page_bytes) in CASES.items()}
        finally:
            await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(measure(args.repeats))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, case in result.items():
        print(f"{name}: {case['pages']} pages of {case['page_bytes']} B")
        for path in ("reply_segment", "in_place", "memcpy"):
            print(f"  {path:<14}{case[path]['ms']:>9.2f} ms {case[path]['GBps']:>7.2f} GB/s")
        print(f"  in place {case['in_place_vs_reply_segment']:.2f}x faster")


if __name__ == "__main__":
    main()
