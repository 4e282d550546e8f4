"""``kvtier drain``: drain a server before it stops (the Drain RPC, admin;
``kvstore.session.draining``).

    kvtier drain --server kv-1:50051 [--json] [--timeout S] [--tls-ca ... --token-file ...]

The server refuses new spills, forks and prefix chunk writes from then on (UNAVAILABLE: a
routed ``Client(servers=[...])`` sends them to another node at once), waits for the writes
it had admitted, writes every memory-acked session back to a durable tier, and, in a fleet,
moves the windows it holds to live peers (``AdoptWindow``: the session resumes there
without replay) and releases those no peer takes (another node resumes them replaying
the window), so routers stop sending them to it. One progress line per step on stderr; once
done, a summary on stdout (``--json``: the last progress message, numbers as numbers),
and the node can be stopped without losing a session. The node stays draining until it
stops; a second drain joins the first.

Exit status: 0 drained, 1 the server refused or could not be reached, or ``--timeout``
passed first (a write-back that keeps failing: its sessions are counted as
writeback_failed; nothing is lost while the node runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from kvstore.format.errors import KVTierError
from services.cli.address import add_server_argument, client_options, failure
from services.cli.json_out import value_json

if TYPE_CHECKING:
    from kvtier.types import DrainProgress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the drain may take (default %(default)s)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between progress lines while a step waits "
                        "(default %(default)s)")


def progress_line(step: DrainProgress) -> str:
    """One line per progress message."""
    return (f"kvtier drain: {step.phase:<9} in flight {step.writes_in_flight}  write-back "
            f"pending {step.writeback_pending} (failed sessions {step.writeback_failed})  "
            f"windows held {step.windows_held}, moved {step.windows_moved}, released "
            f"{step.windows_released}")


def run(args: argparse.Namespace) -> int:
    from kvtier.sync import Client

    try:
        with Client(args.server, timeout_s=args.timeout, **client_options(args)) as kv:
            last = kv.drain(lambda step: print(progress_line(step), file=sys.stderr,
                                               flush=True),
                            progress_interval_s=args.interval)
    except KVTierError as exc:
        print(failure("drain", args.server, exc), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(value_json(last)))
    elif last.done:
        moved = (f", {last.windows_moved} windows moved to peers (those sessions resume there "
                 "without replay)" if last.windows_moved else "")
        released = (f", {last.windows_released} windows released (those sessions replay on "
                    "another node)" if last.windows_released else "")
        held = (f"; {last.windows_held} windows go with the process (a resume replays)"
                if last.windows_held else "")
        print(f"{args.server} drained: every session durable{moved}{released}{held}; "
              "it may be stopped")
    return 0 if last.done else 1
