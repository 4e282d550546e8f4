"""``kvtier fork``: start a session from another session's prefix (copy on write)."""

from __future__ import annotations

import argparse
import sys

from kvstore.format.errors import KVTierError
from services.cli.address import add_server_argument, client_options, failure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_argument(parser)
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--upto-tokens", type=int, required=True,
                        help="rounded down to a chunk boundary unless the source's length")
    parser.add_argument("source", help="the session to fork")
    parser.add_argument("new", help="the new session's id")


def run(args: argparse.Namespace) -> int:
    from kvtier.sync import Client
    from kvtier.types import RetryPolicy

    try:
        with Client(args.server, timeout_s=30, retry=RetryPolicy(attempts=2),
                    **client_options(args)) as kv:
            reply = kv.fork(args.tenant, args.source, args.new, upto_tokens=args.upto_tokens)
    except KVTierError as exc:
        print(failure("fork", args.server, exc), file=sys.stderr)
        return 1
    window = "kept" if reply.window_kept else "rebuilt by replay on resume"
    print(f"{args.tenant}/{args.new}: generation {reply.generation}, {reply.num_tokens} "
          f"tokens, {reply.chunks} chunks shared, window {window}")
    return 0
