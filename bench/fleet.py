"""A fleet's resume paths and throughput, one run (docs/fleet.md).

``python -m bench.fleet --json [--tokens 4096] [--sessions 4] [--resumes 96] [--rounds 5]``

Real ``kvtier serve`` child processes (``testing.live_server.Child``), configured only by
their environment (``KVTIER_METADATA=shared``, ``KVTIER_NODE_ID``, the S3 and Redis
keys: ``bench.backing``), share one redis-server and one moto S3 server (both child
processes on loopback). Sessions are the bundled model's own prefill state
(``model/weights``) of ``--tokens`` token ids, spilled on node a with ack="durable" and
the window. Time to ready is one ``kvtier.AsyncClient.resume`` (decoded: persistent
streams and window), median over ``--sessions`` sessions, each path's first resume on a
node (its model load) untimed:

- ``same_replica_window_kept``: resume on a, whose host tier holds chunks and window;
- ``other_replica_replay``: resume on b (chunks from the shared Redis, which a's spills
  wrote them through to; the window rebuilt by the server's in-process replay of R = 128
  tokens);
- ``cold_node_s3_only``: a node started after the spills with no Redis and empty caches:
  every chunk from the bucket, then replay;
- ``re_prefill``: the bundled model prefilling the token ids (what a miss costs).

``manifest_round_trip``: a store opened as a fleet node in this process
(``services.server.store.open_manager``) writes a manifest by conditional PUT
(``If-Match`` on the ETag its GET saw) and reads it back, ``--manifests`` times: p50 and
p95 of the CAS put, the get, and both. ``aggregate``: resumes per second of
``--resumes`` resumes of ``--sessions`` hot sessions by ``--clients`` concurrent
clients, with 1 replica (every session homed on a) and with 3 (session i spilled on
node i % 3, each resume sent to the node ``Stat`` names as holding its window, as a
router would). ``routing``: ``--rounds`` resumes of each of ``--sessions`` sessions
spilled on a, routed (``AsyncClient(servers=[a, b, c])``: the home node, no replay) against
unrouted (round-robin over a, b, c), and of those the ones on another node (a replay):
median and p90.
``first_resume``: a node started after the spills, with ``replay_warmup`` on and off:
seconds to serving and its first resume (a replay; off, it loads the model first). Every
replica shares the machine's cores (recorded beside the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench.backing import Backing
from testing.live_server import ROOT, Child

REPLAY_TOKENS = 128


def log(message: str) -> None:
    print(f"bench.fleet: {message}", file=sys.stderr, flush=True)


def node(backing: Backing, workdir: Path, name: str, *, redis: bool = True,
         warmup: bool = False) -> Child:
    env = {**backing.env(redis=redis), "KVTIER_NODE_ID": name, "KVTIER_LISTEN": "127.0.0.1:0",
           "KVTIER_DATA_DIR": str(workdir / name), "KVTIER_HOST_BYTES": "1GiB",
           "KVTIER_REPLAY": "in-process", "KVTIER_REPLAY_WARMUP": str(warmup).lower(),
           "PYTHONPATH": str(ROOT)}
    return Child([sys.executable, "-m", "services.cli", "serve", "--preset", "test",
                  "--log-level", "WARNING"], "kvtier serving on ", workdir / f"{name}.log", env)


def start_all(children: list[Child]) -> list[str]:
    with ThreadPoolExecutor(len(children)) as pool:
        return list(pool.map(Child.start, children))


def session_state(tokens: int) -> tuple[torch.Tensor, list[bytes], bytes, bytes, float]:
    """(ids, chunks, tail, window) of the bundled model's prefill, and that prefill's
    seconds (after a short warm-up prefill)."""
    from kvstore.format.registry import get_layout
    from model.checkpoint import load_bundled
    from model.config import BUNDLED
    from model.infer import prefill
    from replay.state_codec import state_to_chunks

    model = load_bundled()
    ids = torch.randint(0, BUNDLED.vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    prefill(model, ids[:256], logits="none")
    started = time.perf_counter()
    state, _ = prefill(model, ids, logits="none")
    seconds = time.perf_counter() - started
    chunks, tail, window = state_to_chunks(get_layout("kvtier-bundled"), state)
    return ids, [c for _, c in chunks], tail, window, seconds


async def timed_resumes(target: str, tenant: str, names: list[str]) -> dict:
    """Resume ``names`` on ``target`` one by one (the first untimed: a warm-up)."""
    from kvtier import AsyncClient

    seconds, tiers, replayed = [], set(), 0
    async with AsyncClient(target) as kv:
        for i, name in enumerate(names):
            started = time.perf_counter()
            got = await kv.resume(tenant, name)
            took = time.perf_counter() - started
            if i:
                seconds.append(took)
                tiers.add(got.tier)
                replayed += got.replayed
    return {"median_ms": round(1000 * statistics.median(seconds), 2),
            "min_ms": round(1000 * min(seconds), 2), "resumes": len(seconds),
            "replayed": replayed, "tiers": sorted(tiers)}


async def spill_all(target: str, tenant: str, names: list[str], state: tuple) -> None:
    from kvtier import AsyncClient

    ids, chunks, tail, window, _ = state
    async with AsyncClient(target) as kv:
        for name in names:
            await kv.spill(tenant, name, "kvtier-bundled", ids, chunks=chunks, tail=tail,
                           window=window, generation=1, ack="durable")


def spread(seconds: list[float]) -> dict:
    return {"median_ms": round(1000 * statistics.median(seconds), 2),
            "p90_ms": round(1000 * statistics.quantiles(seconds, n=10)[-1], 2)}


async def routing(targets: list[str], tenant: str, sessions: int, rounds: int,
                  state: tuple) -> dict:
    """Resumes of ``sessions`` sessions spilled on targets[0], ``rounds`` each: routed
    (one ``AsyncClient(servers=targets)``: each to the node holding its window) and
    unrouted (round-robin over the nodes, as a balancer without affinity: round r of
    every session on targets[r % n]). A replay of the last R tokens leaves the window's
    home where it was, so an unrouted resume lands on the home node one time in n;
    ``other_node``: the unrouted resumes that did not (each a replay)."""
    from kvtier import AsyncClient

    names = [f"r{i}" for i in range(sessions)]
    await spill_all(targets[0], tenant, names, state)

    async def timed(kv: AsyncClient, name: str) -> tuple[float, bool]:
        started = time.perf_counter()
        got = await kv.resume(tenant, name)
        return time.perf_counter() - started, got.replayed

    async with AsyncClient(servers=targets) as kv:
        routed = [await timed(kv, name) for _ in range(rounds) for name in names]
    kvs = [AsyncClient(t) for t in targets]
    try:
        unrouted = [await timed(kvs[r % len(kvs)], name) for r in range(1, rounds + 1)
                    for name in names]
    finally:
        for kv in kvs:
            await kv.close()
    other = [(s, r) for s, r in unrouted if r]  # those that landed off the session's home
    out = {name: {**spread([s for s, _ in runs]), "resumes": len(runs),
                  "replayed": sum(r for _, r in runs)}
           for name, runs in (("routed", routed), ("unrouted", unrouted),
                              ("other_node", other))}
    out["speedup"] = round(out["unrouted"]["median_ms"] / out["routed"]["median_ms"], 2)
    return out


async def first_resume(backing: Backing, workdir: Path, name: str, warmup: bool) -> dict:
    """A node started now (``replay_warmup`` on or off): seconds to serving, and its first
    resume of ``paths/warm`` (a replay: the window is another node's)."""
    from kvtier import AsyncClient

    child = node(backing, workdir, name, warmup=warmup)
    started = time.perf_counter()
    target = await asyncio.to_thread(child.start)
    ready = time.perf_counter() - started
    try:
        async with AsyncClient(target) as kv:
            started = time.perf_counter()
            got = await kv.resume("paths", "warm")
            seconds = time.perf_counter() - started
    finally:
        child.stop()
    return {"replay_warmup": warmup, "start_s": round(ready, 2),
            "first_resume_ms": round(1000 * seconds, 2), "replayed": got.replayed}


async def manifest_round_trip(backing: Backing, workdir: Path, count: int) -> dict:
    """CAS put and get of one session's manifest, ``count`` times, through a fleet
    node's own store (no chunks named, so the put's touch-before-commit is empty)."""
    from kvstore.session.manifest import SessionManifest, manifest_key
    from services.server.config_load import load_config
    from services.server.store import open_manager

    backing.aws()
    overrides = {k[len("KVTIER_"):].lower(): v for k, v in backing.env(redis=False).items()
                 if k.startswith("KVTIER_")}
    config = load_config(preset="test", env={}, overrides={
        **overrides, "node_id": "bench", "data_dir": workdir / "meta"})
    manager = await open_manager(config)
    meta, key = manager.meta, manifest_key("bench", "manifest")
    puts, gets = [], []
    try:
        for generation in range(1, count + 1):
            manifest = SessionManifest(tenant="bench", session_id="manifest",
                                       layout_id="kvtier-bundled", generation=generation,
                                       token_ids=np.arange(4096, dtype=np.uint32), chunk_keys=(),
                                       chunk_sizes=(), node_id="bench")
            started = time.perf_counter()
            await meta.commit({key: manifest.encode()})  # If-Match the ETag last read
            put = time.perf_counter()
            assert SessionManifest.decode(await meta.get(key)).generation == generation
            gets.append(time.perf_counter() - put)
            puts.append(put - started)
    finally:
        await manager.close()

    def pct(values: list[float], q: int) -> float:
        return round(1000 * statistics.quantiles(values, n=100)[q - 1], 3)

    both = [p + g for p, g in zip(puts, gets, strict=True)]
    return {"count": count, "bytes": len(manifest.encode()),
            **{f"{name}_p{q}_ms": pct(values, q) for name, values in
               (("put", puts), ("get", gets), ("round_trip", both)) for q in (50, 95)}}


async def aggregate(targets: list[str], tenant: str, sessions: int, resumes: int,
                    clients: int, state: tuple) -> dict:
    """Resumes per second over ``targets``: session i homed on targets[i % n], each
    resume routed to the address Stat names as its window's node."""
    from kvtier import AsyncClient

    names = [f"s{i}" for i in range(sessions)]
    await asyncio.gather(*(spill_all(targets[i % len(targets)], tenant, names[i::len(targets)],
                                     state) for i in range(len(targets))))
    async with AsyncClient(targets[0]) as kv:  # the router: one Stat per session
        routes = {name: (await kv.stat(tenant, name)).session.window_node_address
                  for name in names}
    assert set(routes.values()) == set(targets), routes
    order = itertools.cycle(names)
    work = [next(order) for _ in range(resumes)]
    replayed = 0

    async def client(share: list[str]) -> None:
        nonlocal replayed
        kvs = {t: AsyncClient(t) for t in targets}
        try:
            for name in share:
                replayed += (await kvs[routes[name]].resume(tenant, name)).replayed
        finally:
            for kv in kvs.values():
                await kv.close()

    await client(names)  # warm: every connection up
    started = time.perf_counter()
    await asyncio.gather(*(client(work[i::clients]) for i in range(clients)))
    seconds = time.perf_counter() - started
    return {"replicas": len(targets), "resumes": resumes, "clients": clients,
            "seconds": round(seconds, 3), "resumes_per_s": round(resumes / seconds, 1),
            "replayed": replayed}


async def run(tokens: int, sessions: int, resumes: int, clients: int, manifests: int,
              rounds: int, workdir: Path) -> dict:
    state = await asyncio.to_thread(session_state, tokens)
    log(f"prefill of {tokens} tokens: {state[4]:.3f} s")
    names = ["warm", *[f"s{i}" for i in range(sessions)]]
    with Backing(workdir) as backing:
        children = [node(backing, workdir, name) for name in "abc"]
        try:
            a, b, c = await asyncio.to_thread(start_all, children)
            await spill_all(a, "paths", names, state)
            log("paths: spilled on a")
            paths = {"same_replica_window_kept": await timed_resumes(a, "paths", names),
                     "other_replica_replay": await timed_resumes(b, "paths", names)}
            cold = node(backing, workdir, "cold", redis=False)
            children.append(cold)
            paths["cold_node_s3_only"] = await timed_resumes(
                await asyncio.to_thread(cold.start), "paths", names)
            paths["re_prefill"] = {"median_ms": round(1000 * state[4], 2)}
            log(f"paths: {json.dumps(paths)}")
            routes = await routing([a, b, c], "routing", sessions, rounds, state)
            log(f"routing: {json.dumps(routes)}")
            first = [await first_resume(backing, workdir, f"fresh-{w}", w)
                     for w in (True, False)]
            log(f"first resume: {json.dumps(first)}")
            manifest = await manifest_round_trip(backing, workdir, manifests)
            log(f"manifest: {json.dumps(manifest)}")
            rates = [await aggregate([a], "one", sessions, resumes, clients, state),
                     await aggregate([a, b, c], "three", sessions, resumes, clients, state)]
            log(f"aggregate: {json.dumps(rates)}")
        finally:
            for child in children:
                child.stop()
    prefill_ms = paths["re_prefill"]["median_ms"]
    for path in paths.values():
        path["speedup_vs_prefill"] = round(prefill_ms / path["median_ms"], 2)
    return {"tokens": tokens, "sessions": sessions, "replay_tokens": REPLAY_TOKENS,
            "chunks": len(state[1]), "cpus": os.cpu_count(), "time_to_ready": paths,
            "manifest_round_trip": manifest, "aggregate": rates, "routing": routes,
            "first_resume": first,
            "scaling_3_vs_1": round(rates[1]["resumes_per_s"] / rates[0]["resumes_per_s"], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--resumes", type=int, default=120)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--manifests", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5, help="routing: resumes per session")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.sessions < 3 or args.manifests < 2:
        parser.error("--sessions must be >= 3 (one per replica) and --manifests >= 2")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-") as tmp:
        result = asyncio.run(run(args.tokens, args.sessions, args.resumes, args.clients,
                                 args.manifests, args.rounds, Path(tmp)))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, path in result["time_to_ready"].items():
            print(f"{name:<26} {path['median_ms']:>9.2f} ms  "
                  f"{path['speedup_vs_prefill']:>7.2f}x vs prefill")
        m = result["manifest_round_trip"]
        print(f"manifest CAS put + get    {m['round_trip_p50_ms']:>9.2f} ms p50")
        for way in ("routed", "unrouted", "other_node"):
            r = result["routing"][way]
            print(f"{way + ' resume':<26} {r['median_ms']:>9.2f} ms  p90 {r['p90_ms']:.2f} ms "
                  f"({r['replayed']}/{r['resumes']} replayed)")
        for f in result["first_resume"]:
            print(f"first resume, warm-up {'on ' if f['replay_warmup'] else 'off'} "
                  f"{f['first_resume_ms']:>9.2f} ms")
        for rate in result["aggregate"]:
            print(f"{rate['replicas']} replica(s)               "
                  f"{rate['resumes_per_s']:>9.1f} resumes/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
