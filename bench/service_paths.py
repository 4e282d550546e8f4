"""Same-host fast path vs plain gRPC: spill and restore of one session through a real
loopback server, both paths measured in one run and printed side by side.

``python -m bench.service_paths --json`` prints, per path (``shm``, ``grpc``), the best
throughput in GB/s of encoded chunk bytes for: ``spill`` (chunks encoded beforehand),
``restore`` (verified bytes, not decoded) and ``restore_tensors`` (decoded to tensors, as
``kvtier.AsyncClient.restore`` returns them), and the ratios shm / grpc. The server runs
in this process on a host tier large enough for the session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import torch

from bench.codec import random_chunk
from kvstore.format.chunk import StreamData
from kvstore.format.registry import get_layout
from kvtier.client import AsyncClient
from kvtier.codec import as_tokens, encode_session
from services.server.config_load import load_config
from services.server.server import create_server


def session_streams(spec, chunks: int) -> dict[str, StreamData]:
    parts = [random_chunk(spec, i) for i in range(min(chunks, 4))]
    parts = [parts[i % len(parts)] for i in range(chunks)]
    return {name: StreamData(torch.cat([p[name].codes for p in parts], dim=1),
                             None if parts[0][name].scales is None
                             else torch.cat([p[name].scales for p in parts], dim=1))
            for name in parts[0]}


async def measure(layout: str, total_mb: float, repeats: int) -> dict:
    spec = get_layout(layout)
    chunk_bytes = spec.persistent_bytes_per_token * spec.chunk_tokens
    chunks = max(1, int(total_mb * 1e6 // chunk_bytes))
    tokens = torch.arange(chunks * spec.chunk_tokens)
    # Only the bytes are used (the client keys them for its tenant when it spills).
    enc = encode_session(spec, as_tokens(tokens), session_streams(spec, chunks), scope="")
    encoded = [enc.chunks[i] for i in range(chunks)]
    with tempfile.TemporaryDirectory() as data_dir:
        config = load_config(preset="test", env={}, overrides={
            "data_dir": data_dir, "host_bytes": int(total_mb * 4e6) + (64 << 20),
            "disk_bytes": 0, "object_bytes": 0, "max_message_bytes": 256 << 20})
        server, port = await create_server(config)
        out: dict = {"layout": layout, "chunks": chunks, "mb": chunks * chunk_bytes / 1e6}
        try:
            for path in ("shm", "grpc"):
                async with AsyncClient(f"127.0.0.1:{port}", shared_memory=path == "shm",
                                       max_message_bytes=256 << 20) as kv:
                    best = {"spill": float("inf"), "restore": float("inf"),
                            "restore_tensors": float("inf")}
                    for generation in range(1, repeats + 1):
                        session = f"bench-{path}-{generation}"
                        t0 = time.perf_counter()
                        await kv.spill("bench", session, spec, tokens, chunks=encoded,
                                       generation=generation)
                        t1 = time.perf_counter()
                        await kv.restore("bench", session, decode=False)
                        t2 = time.perf_counter()
                        await kv.restore("bench", session)
                        t3 = time.perf_counter()
                        await kv.delete("bench", session)
                        for name, seconds in (("spill", t1 - t0), ("restore", t2 - t1),
                                              ("restore_tensors", t3 - t2)):
                            best[name] = min(best[name], seconds)
                    out[path] = {f"{k}_gbps": out["mb"] / 1e3 / v for k, v in best.items()}
        finally:
            await server.stop(1)
    for name in ("spill", "restore", "restore_tensors"):
        out[f"{name}_ratio_shm_vs_grpc"] = (out["shm"][f"{name}_gbps"]
                                            / out["grpc"][f"{name}_gbps"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="deepseek-v3")
    parser.add_argument("--mb", type=float, default=32.0, help="session size in MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(measure(args.layout, args.mb, args.repeats))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['layout']}: {result['chunks']} chunks, {result['mb']:.1f} MB")
    names = ("spill", "restore", "restore_tensors")
    print(f"{'GB/s':<9}" + "".join(f"{n:>17}" for n in names))
    for path in ("shm", "grpc"):
        print(f"{path:<9}" + "".join(f"{result[path][f'{n}_gbps']:>17.2f}" for n in names))
    print(f"{'shm/grpc':<9}" + "".join(f"{result[f'{n}_ratio_shm_vs_grpc']:>16.2f}x"
                                       for n in names))


if __name__ == "__main__":
    main()
