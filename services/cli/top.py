"""``kvtier top``: hit rate per tier, live, redrawn every ``--interval`` seconds; the
``recent`` column is the hit rate over the last interval only."""

from __future__ import annotations

import argparse
import sys
import time

from kvstore.format.errors import KVTierError
from services.cli.address import add_server_argument, client_options, failure
from services.cli.stat import human_bytes, tier_table

CLEAR = "\x1b[H\x1b[2J"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_argument(parser)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--iterations", type=int, default=0, help="stop after N (0: never)")


def run(args: argparse.Namespace) -> int:
    from kvtier.sync import Client

    previous: dict[str, tuple[int, int]] = {}
    redraw = sys.stdout.isatty()
    count = 0
    try:
        with Client(args.server, timeout_s=10, **client_options(args)) as kv:
            while True:
                reply = kv.stat()
                deltas = {t.name: (t.lookups - previous.get(t.name, (0, 0))[0],
                                   t.hits - previous.get(t.name, (0, 0))[1])
                          for t in reply.tiers}
                previous = {t.name: (t.lookups, t.hits) for t in reply.tiers}
                used = sum(t.used_bytes for t in reply.tiers)
                lines = [f"kvtier top  {args.server}  {time.strftime('%H:%M:%S')}  "
                         f"sessions {reply.sessions}  stored {human_bytes(used)}  "
                         f"write-back {reply.writeback_queue_depth}  replays {reply.replays}",
                         "", *tier_table(reply.tiers, deltas)]
                print((CLEAR if redraw else "") + "\n".join(lines), flush=True)
                count += 1
                if args.iterations and count >= args.iterations:
                    return 0
                time.sleep(args.interval)
    except KVTierError as exc:
        print(failure("top", args.server, exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
