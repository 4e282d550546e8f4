"""``kvtier list``: stored sessions (of one tenant), one line each, or JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvstore.format.errors import KVTierError
from services.cli.address import add_server_argument, client_options, failure
from services.cli.json_out import value_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_argument(parser)
    parser.add_argument("--tenant", default="", help="only this tenant's sessions")
    parser.add_argument("--json", action="store_true", help="print JSON lines")


def run(args: argparse.Namespace) -> int:
    from kvtier.sync import Client
    from kvtier.types import RetryPolicy

    try:
        with Client(args.server, timeout_s=30, retry=RetryPolicy(attempts=2),
                    **client_options(args)) as kv:
            sessions = kv.list(args.tenant)
    except KVTierError as exc:
        print(failure("list", args.server, exc), file=sys.stderr)
        return 1
    if args.json:
        for s in sessions:
            print(json.dumps(value_json(s)))
        return 0
    print(f"{'tenant/session':<40} {'gen':>5} {'tokens':>9} {'chunks':>6} {'window':>7} "
          f"{'tiers':<18} last access")
    for s in sessions:
        name = f"{s.session.tenant}/{s.session.session_id}"
        seen = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.last_access_unix))
        print(f"{name:<40} {s.generation:>5} {s.num_tokens:>9} {s.chunks:>6} "
              f"{s.window_tier or '-':>7} {','.join(s.tiers) or '-':<18} {seen}")
    print(f"{len(sessions)} sessions")
    return 0
