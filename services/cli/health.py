"""``kvtier health``: ask a server's (or replay worker's) gRPC health service whether it
serves; exit 0 when SERVING, 1 otherwise. Made for container healthchecks, so it loads
neither torch nor the client, and takes the same TLS and token flags as the other tools.

    kvtier health --server 127.0.0.1:50051 --tls-ca /certs/ca.pem
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvstore.format.errors import KVTierError
from services.cli.address import ClientOptions, add_server_argument, client_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_argument(parser)
    parser.add_argument("--service", default="", help="the service to check (default: the "
                        "server as a whole; e.g. kvtier.v1.KVTier)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the "
                        "answer (default %(default)s)")


async def check(target: str, service: str, timeout_s: float, options: ClientOptions
                ) -> str:
    """The status name the health service answers (``SERVING``, ``NOT_SERVING``, ...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtier.channel import Credentials, open_channel, tls_mismatch

    credentials = Credentials(**options)
    async with open_channel(target, credentials) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            problem = (await tls_mismatch(target, credentials, exc.details() or "")
                       if exc.code() == grpc.StatusCode.UNAVAILABLE else None)
            return exc.code().name + (f" ({problem})" if problem else "")
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def run(args: argparse.Namespace) -> int:
    try:
        status = asyncio.run(check(args.server, args.service, args.timeout,
                                   client_options(args)))
    except KVTierError as exc:  # unreadable credential files
        print(f"kvtier health: {exc}", file=sys.stderr)
        return 1
    print(f"{args.server} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1
