"""``python -m kvtier.conformance --server ADDR``: see ``kvtier.conformance``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from kvtier.channel import Credentials
from kvtier.conformance import Context, Result, all_checks, run


def report(results: list[Result], as_json: bool) -> str:
    failed = sum(not r.ok for r in results)
    if as_json:
        return json.dumps({"passed": len(results) - failed, "failed": failed,
                           "checks": [{"name": r.name, "ok": r.ok, "detail": r.detail}
                                      for r in results]}, indent=1)
    width = max((len(r.name) for r in results), default=0)
    lines = [f"{r.name:<{width}}  {'PASS' if r.ok else 'FAIL'}  {r.detail}" for r in results]
    return "\n".join([*lines, f"{len(results) - failed} passed, {failed} failed"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.conformance",
                                     description="check a kvtier server against the spec")
    parser.add_argument("--server", required=True, help="host:port of the server")
    parser.add_argument("--tls-ca", help="CA of the server's certificate (TLS)")
    parser.add_argument("--token", help="bearer token (allowed to RegisterLayout)")
    parser.add_argument("--tenant", default="conformance", help="tenant to spill under")
    parser.add_argument("--vectors", type=Path, help="the golden vectors (tests/vectors)")
    parser.add_argument("--max-message-bytes", type=int, default=8 << 20,
                        help="the server's max_message_bytes (default 8 MiB)")
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    args = parser.parse_args(argv)
    context = Context(args.server, Credentials(tls_ca=args.tls_ca, token=args.token),
                      args.tenant, args.vectors, args.max_message_bytes)
    results = asyncio.run(run(all_checks(), context))
    print(report(results, args.json))
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
