"""Attacks on the service from outside, each against a real server and replay worker in
child processes (``testing.live_server``), each reporting whether it held and what it
measured: peak server RSS and the longest concurrent Stat (the event loop's stall)
during the bombs, whether a victim got its own bytes and the dedupe count an attacker
saw, RSS and Stat latency with 300 idle Spill streams open, and so on.

``python -m stress.adversarial [--json] [--sizes quick|tiny] [--only 2b_zstd_bomb,...]``

Cases (``stress.adversarial.cases``): 1a evil spills the victim's prompt tokens with its
own KV, 1b two fine-tunes of one layout, 1c the dedupe count as an oracle of another
tenant's holdings; 2a a chunk with a wrong section table, 2b a small zstd chunk that
would expand to 700 MiB, 2c a window part claiming 2 GiB; 3a a restore told to write
into a 0400 /dev/shm file (by lease id and by the old reply_buffer field), 3b a spill
told to read a planted /dev/shm file, 3c lease ids "." and "..", 3d restores whose
segments are never mapped; 4 token ids outside the vocabulary; 5a a 20 kB session id,
5b DATA_LOSS details; 6 undecodable bytes to every method; 7 300 idle Spill streams;
8 a repeated Spill; and (``stress.adversarial.layouts``) 9a a layout registered under
another tenant's layout name or a preset's, 9b a tenant registering where only admins
may, 9c a Lookup of another tenant's prompt, 9d a Fork of another tenant's session.
``all_held`` is true when every case held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from stress.adversarial import cases as attacks
from stress.adversarial import layouts as layout_attacks
from stress.adversarial.cases import Context
from testing.live_server import LiveServer

SIZES = {
    "quick": {"bomb_mib": 700, "window_bomb_mib": 2048, "idle_streams": 300,
              "unmapped_restores": 12, "idle_settle_s": 2.0},
    # small enough for a test: the same attacks, smaller bombs and fewer streams
    "tiny": {"bomb_mib": 256, "window_bomb_mib": 256, "idle_streams": 60,
             "unmapped_restores": 8, "idle_settle_s": 1.0},
}
CASES = {**attacks.CASES, **layout_attacks.CASES}
SHM_PER_CLIENT_MIB, SHM_TOTAL_MIB = 4, 6  # segments are 1 MiB at least: counts bound them
IDLE_S = 4.0  # the server's stream_idle_s: idle streams are cut after this


def server_env() -> dict[str, str]:
    return {"KVTIER_SHM_LEASE_BYTES_PER_CLIENT": str(SHM_PER_CLIENT_MIB << 20),
            "KVTIER_SHM_LEASE_BYTES_TOTAL": str(SHM_TOTAL_MIB << 20),
            "KVTIER_STREAM_IDLE_S": str(IDLE_S)}


async def run_cases(ctx: Context, names: list[str]) -> dict:
    out = {}
    for name in names:
        started = time.perf_counter()
        try:
            result = await CASES[name](ctx)
        except Exception as exc:  # noqa: BLE001 - a case that cannot run did not hold
            result = {"held": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        result["server_alive"] = ctx.live.server.alive()
        result["held"] = result["held"] and result["server_alive"]
        result["seconds"] = round(time.perf_counter() - started, 2)
        out[name] = result
        print(f"stress.adversarial: {name} held={result['held']}", file=sys.stderr, flush=True)
    return out


def run_adversarial(sizes_name: str = "quick", only: list[str] | None = None) -> dict:
    sizes = {**SIZES[sizes_name], "shm_per_client_mib": SHM_PER_CLIENT_MIB,
             "shm_total_mib": SHM_TOTAL_MIB}
    names = only or list(CASES)
    with tempfile.TemporaryDirectory(prefix="kvtier-adversarial-") as tmp:
        tmp = Path(tmp)
        with LiveServer(tmp / "data", tmp, env=server_env()) as live:
            ctx = Context(live, tmp / "data", sizes)
            try:
                cases = asyncio.run(run_cases(ctx, names))
            finally:
                ctx.close()
    return {"all_held": all(c["held"] for c in cases.values()), "sizes": sizes_name,
            "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress.adversarial",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", choices=sorted(SIZES), default="quick")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    unknown = set(only) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    result = run_adversarial(args.sizes, only or None)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, case in result["cases"].items():
            print(f"{name}: {'held' if case['held'] else 'NOT HELD'} "
                  + json.dumps({k: v for k, v in case.items() if k != "held"}))
        print(f"all_held: {result['all_held']}")
    return 0 if result["all_held"] else 1

