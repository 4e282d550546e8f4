"""Per-tier put/get throughput next to the raw medium, measured in one run.

``python -m bench.tiers --json [--size-mib 1 --count 32]`` prints for each tier (hbm, host,
redis, disk, object-local, object-s3) ``put_gbps`` and ``get_gbps`` for values of the given
size, next to ``raw_put_gbps`` / ``raw_get_gbps`` of the bare medium in the same run:

- hbm, host: torch ``copy_`` between preallocated buffers (device <-> host on CUDA);
- redis: plain SET / GET of the same bytes with a redis-py asyncio client;
- disk: plain file write + fsync per value, and plain reads of it;
- object-local: plain file write + fsync per value into its own file, and plain reads;
- object-s3: plain ``put_object`` / ``get_object`` with boto3 against the same server.

For redis and disk it also reports the tier sealed (``kvstore.encryption.tiers``, AES-256-GCM
encryption at rest) against the same tier in clear, interleaved in the same run:
``sealed_put_gbps`` / ``sealed_get_gbps`` and the ratios ``sealed_put_vs_clear`` /
``sealed_get_vs_clear`` (1.0: encryption costs nothing). Beside each best-of ratio,
``put_vs_raw_median`` / ``get_vs_raw_median``: the median of the per-repeat ratios (the
tier and the raw medium alternate which goes first), steadier on a busy machine.

Calls are sequential (one in flight), as the raw figures are. It starts its own
redis-server and an in-process moto S3 server on loopback ports. The memory tiers'
``get`` hands out a read-only view of the stored bytes (no copy) on the CPU, so their
get may exceed memcpy: ``get_zero_copy`` says so. GB/s means 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from bench.backing import start_redis
from kvstore.tiers.base import Tier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.object import ObjectTier, ObjectTierConfig
from kvstore.tiers.redis import RedisTier, RedisTierConfig
from testing.live_server import free_port

S3_CREDENTIALS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench",
                  "region_name": "us-east-1"}


Op = Callable[[], Awaitable[None]]


async def _compare(tier_ops: tuple[Op, Op], raw_ops: tuple[Op, Op], repeats: int
                   ) -> tuple[tuple[float, float], tuple[float, float], dict]:
    """Best seconds of (put, get) for the tier and the raw medium, and the median over
    repeats of each repeat's raw / tier ratio (``put_vs_raw_median``, ``get_vs_raw_median``).
    The four are run in turn within each repeat, raw first in even repeats and the tier
    first in odd ones, so that load from other processes and the order hit them alike."""
    times: list[list[float]] = [[], [], [], []]
    for repeat in range(repeats):
        order = [0, 1, 2, 3] if repeat % 2 == 0 else [2, 3, 0, 1]
        for index in order:
            started = time.perf_counter()
            await (*raw_ops, *tier_ops)[index]()
            times[index].append(time.perf_counter() - started)
    best = [min(t) for t in times]
    medians = {f"{op}_vs_raw_median": statistics.median(
        raw / tier for raw, tier in zip(times[i], times[i + 2], strict=True))
        for i, op in enumerate(("put", "get"))}
    return (best[2], best[3]), (best[0], best[1]), medians


def _tier_ops(tier: Tier, values: list[bytes]) -> tuple[Op, Op]:
    keys = [f"bench-{i}" for i in range(len(values))]

    async def put_all() -> None:
        for key, value in zip(keys, values, strict=True):
            await tier.put(key, value)

    async def get_all() -> None:
        for key in keys:
            await tier.get(key)

    return put_all, get_all


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw_copy(device: torch.device, values: list[bytes]) -> tuple[Op, Op]:
    """Copy host -> device buffers (put) and device -> host buffers (get), preallocated."""
    host = [torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in values]
    stored = [torch.empty_like(h, device=device) for h in host]
    out = [torch.empty_like(h) for h in host]

    async def put_all() -> None:
        for dst, src in zip(stored, host, strict=True):
            dst.copy_(src)
        _sync(device)

    async def get_all() -> None:
        for dst, src in zip(out, stored, strict=True):
            dst.copy_(src)
        _sync(device)

    return put_all, get_all


def _raw_redis(client, values: list[bytes]) -> tuple[Op, Op]:
    keys = [f"raw-{i}" for i in range(len(values))]

    async def put_all() -> None:
        for key, value in zip(keys, values, strict=True):
            await client.set(key, value)

    async def get_all() -> None:
        for key in keys:
            await client.get(key)

    return put_all, get_all


def _raw_files(root: Path, values: list[bytes], *, one_file: bool) -> tuple[Op, Op]:
    """Plain writes + fsync per value (into one log file, or a file each) and plain reads."""
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / ("log" if one_file else f"raw-{i}") for i in range(len(values))]

    async def put_all() -> None:
        if one_file:
            with open(paths[0], "wb") as file:
                for value in values:
                    file.write(value)
                    file.flush()
                    os.fsync(file.fileno())
            return
        for path, value in zip(paths, values, strict=True):
            with open(path, "wb") as file:
                file.write(value)
                file.flush()
                os.fsync(file.fileno())

    async def get_all() -> None:
        if one_file:
            with open(paths[0], "rb") as file:
                for value in values:
                    file.read(len(value))
            return
        for path in paths:
            with open(path, "rb") as file:
                file.read()

    return put_all, get_all


def _raw_s3(client, bucket: str, values: list[bytes]) -> tuple[Op, Op]:
    keys = [f"raw/{i}" for i in range(len(values))]

    async def put_all() -> None:
        for key, value in zip(keys, values, strict=True):
            client.put_object(Bucket=bucket, Key=key, Body=value)

    async def get_all() -> None:
        for key in keys:
            client.get_object(Bucket=bucket, Key=key)["Body"].read()

    return put_all, get_all


def _sealed(inner: Tier, count: int) -> Tier:
    """``inner`` sealed with a throwaway key, the bench keys claimed for one tenant."""
    from kvstore.encryption.seal import Keyring, MasterKey
    from kvstore.encryption.tiers import BlockDomain, BlockDomains, EncryptedTier

    domains = BlockDomains()
    for i in range(count):
        domains.claim(f"bench-{i}", BlockDomain("tenant:bench", 0))
    return EncryptedTier(inner, Keyring([MasterKey("bench", os.urandom(32))]), domains)


def _row(name: str, count: int, size: int, tier_s: tuple[float, float],
         raw_s: tuple[float, float], **extra: object) -> dict:
    total = count * size
    put_s, get_s = tier_s
    raw_put_s, raw_get_s = raw_s
    return {"tier": name, "count": count, "value_bytes": size,
            "put_gbps": total / put_s / 1e9, "get_gbps": total / get_s / 1e9,
            "raw_put_gbps": total / raw_put_s / 1e9, "raw_get_gbps": total / raw_get_s / 1e9,
            "put_vs_raw": raw_put_s / put_s, "get_vs_raw": raw_get_s / get_s, **extra}


async def run(size: int, count: int, repeats: int, workdir: Path) -> list[dict]:
    values = [os.urandom(size) for _ in range(count)]
    slow = values[: max(1, count // 4)]  # fsync- and HTTP-bound media get fewer values
    capacity = 4 * count * size
    rows = []

    async def measure(name: str, tier: Tier, raw: tuple[Op, Op], some: list[bytes],
                      sealed: Tier | None = None, **extra: object) -> None:
        tier_s, raw_s, medians = await _compare(_tier_ops(tier, some), raw, repeats)
        extra.update(medians)
        if sealed is not None:  # a ratio from the same run: the two interleaved
            (put_s, get_s), (clear_put_s, clear_get_s), _ = await _compare(
                _tier_ops(sealed, some), _tier_ops(tier, some), repeats)
            total = len(some) * size
            extra.update(sealed_put_gbps=total / put_s / 1e9, sealed_get_gbps=total / get_s / 1e9,
                         sealed_put_vs_clear=clear_put_s / put_s,
                         sealed_get_vs_clear=clear_get_s / get_s)
            await sealed.close()
        rows.append(_row(name, len(some), size, tier_s, raw_s, **extra))
        await tier.close()

    for tier in (HBMTier(capacity), HostTier(capacity)):
        await measure(tier.name, tier, _raw_copy(tier.device, values), values,
                      get_zero_copy=tier.device.type == "cpu")

    if shutil.which("redis-server"):
        import redis.asyncio as aioredis

        port = free_port()
        process, url = start_redis(workdir, port), f"redis://127.0.0.1:{port}/0"
        client = aioredis.Redis.from_url(url)
        try:
            sealed = _sealed(RedisTier(url, capacity, RedisTierConfig(prefix="sealed:")), count)
            await measure("redis", RedisTier(url, capacity), _raw_redis(client, values), values,
                          sealed)
        finally:
            await client.aclose()
            process.kill()
            process.wait()
    else:
        rows.append({"tier": "redis", "skipped": "redis-server is not on PATH"})

    try:
        from kvstore.tiers.disk import DiskTier
    except ImportError as exc:  # written by another helper; may lag behind this bench
        rows.append({"tier": "disk", "skipped": f"kvstore.tiers.disk.tier: {exc}"})
    else:
        # Durable puts (fsync before the ack) against a plain append + fsync per value.
        await measure("disk", DiskTier(workdir / "disk", capacity),
                      _raw_files(workdir / "raw-disk", slow, one_file=True), slow,
                      _sealed(DiskTier(workdir / "sealed-disk", capacity), count))

    await measure("object-local", ObjectTier(workdir / "objects", capacity),
                  _raw_files(workdir / "raw-objects", slow, one_file=False), slow)

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, **S3_CREDENTIALS)
        client.create_bucket(Bucket="bench")
        tier = ObjectTier("s3://bench/tier", capacity,
                          ObjectTierConfig(endpoint_url=endpoint, **S3_CREDENTIALS))
        await measure("object-s3", tier, _raw_s3(client, "bench", slow), slow)
    finally:
        server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--size-mib", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads for the raw copies: a 1 MiB copy gains "
                        "little from more, and OpenMP spinning on a busy machine makes them "
                        "erratic")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    size = int(args.size_mib * (1 << 20))
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        rows = asyncio.run(run(size, args.count, args.repeats, Path(tmp)))
    if args.json:
        print(json.dumps({"value_bytes": size, "load_average_1m": os.getloadavg()[0],
                          "tiers": {r.pop("tier"): r for r in rows}}, indent=2))
        return 0
    print(f"{'tier':<13} {'n':>4} {'put':>8} {'raw put':>8} {'get':>8} {'raw get':>8} "
          f"{'get/raw':>8} {'sealed put/clear':>17} {'get/clear':>9}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['tier']:<13} skipped: {r['skipped']}")
            continue
        print(f"{r['tier']:<13} {r['count']:>4} {r['put_gbps']:>7.2f}G {r['raw_put_gbps']:>7.2f}G "
              f"{r['get_gbps']:>7.2f}G {r['raw_get_gbps']:>7.2f}G {r['get_vs_raw']:>8.2f}"
              + (f" {r['sealed_put_vs_clear']:>17.2f} {r['sealed_get_vs_clear']:>9.2f}"
                 if "sealed_put_vs_clear" in r else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
