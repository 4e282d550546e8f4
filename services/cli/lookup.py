"""``kvtier lookup``: how many tokens of a sequence the server already holds (prefix reuse)."""

from __future__ import annotations

import argparse
import sys

from kvstore.format.errors import KVTierError
from services.cli.address import add_server_argument, client_options, failure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_argument(parser)
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--layout", default="kvtier-bundled")
    parser.add_argument("--model", default="", help="the model fingerprint the chunks bind")
    parser.add_argument("--dedupe-domain", default="", help="a shared dedupe domain")
    parser.add_argument("tokens", help="token ids, comma separated")


def run(args: argparse.Namespace) -> int:
    from kvtier.sync import Client
    from kvtier.types import RetryPolicy

    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        print(f"kvtier lookup: token ids must be integers, got {args.tokens!r}", file=sys.stderr)
        return 2
    try:
        with Client(args.server, timeout_s=30, retry=RetryPolicy(attempts=2),
                    **client_options(args)) as kv:
            held = kv.lookup(args.tenant, args.layout, tokens, model=args.model or None,
                             dedupe_domain=args.dedupe_domain)
    except KVTierError as exc:
        print(failure("lookup", args.server, exc), file=sys.stderr)
        return 1
    print(f"{held} of {len(tokens)} tokens held")
    return 0
