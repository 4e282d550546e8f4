"""``kvtier serve``: run the gRPC server until SIGTERM or SIGINT, then stop gracefully
(in-flight calls finish, the write-back queue drains, tiers close). SIGHUP (or
``kvtier reload``) reloads tokens, quotas, the log level and the keyring
(``services.server.reload``): a bad file is refused and the last good version stays.

Configuration: ``--config FILE`` (TOML) and ``KVTIER_*`` environment variables over the
preset (``embedded`` by default); the flags below override both. Prints one line,
``kvtier serving on HOST:PORT``, once it accepts calls (``--listen 127.0.0.1:0`` picks a
free port; scripts read it from that line).

A server that cannot start (a bad config, its data directory in use or not a directory,
its port taken) prints one line naming the cause on stderr and exits with status 2; so
does one asked to listen off loopback without TLS and authentication, or to serve
metrics off loopback without TLS, unless ``--insecure`` is given
(``services.serving.tls``). ``--print-config`` runs the same checks
(``services.server.preflight.check``) before it prints, and refuses what ``serve``
would, with the same line and status; only what opening the store finds (the data
directory in use, a missing bucket) is left to ``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from kvstore.format.errors import KVTierError
from services.server import preflight
from services.server.config_load import PRESETS, load_config
from services.server.requests import configure_logging
from services.serving.lifecycle import (
    forget_pid,
    record_pid,
    record_reload,
    reload_on_hangup,
    stop_on_signals,
)
from services.serving.tls import INSECURE_FLAG


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (keys: services.server.config fields)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="base preset")
    parser.add_argument("--listen", help="host:port to serve on (default 127.0.0.1:50051)")
    parser.add_argument("--data-dir", help="directory of the disk and object tiers")
    parser.add_argument("--metrics-port", type=int,
                        help="serve Prometheus metrics on this port (0: off)")
    parser.add_argument("--redis-url", help="turn the Redis tier on (redis://host:port/db)")
    parser.add_argument("--host-bytes", help="host RAM tier capacity, e.g. 1GiB")
    parser.add_argument("--disk-bytes", help="disk tier capacity, e.g. 64GiB (0: no disk)")
    parser.add_argument("--replay-workers", help="comma-separated replay worker addresses")
    parser.add_argument(INSECURE_FLAG, action="store_true",
                        help="serve a non-loopback address without TLS and authentication, "
                        "or metrics without TLS (anyone reaching the port may read and "
                        "delete every session)")
    parser.add_argument("--print-config", action="store_true",
                        help="check the configuration as serve does (exit 2 with serve's "
                        "message if serve would refuse it), print it as JSON and exit")
    parser.add_argument("--log-level", help="DEBUG, INFO, ... (default: the config's "
                        "log_level, INFO)")
    parser.add_argument("--log-format", choices=("text", "json"),
                        help="log lines as text or one JSON object a line (default: the "
                        "config's log_format, text)")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level or "INFO", args.log_format or "text")
    # boto3 says at INFO where it found credentials: noise unless one asks for DEBUG;
    # a reload may lower the root level, not this one.
    logging.getLogger("botocore").setLevel(logging.WARNING)
    overrides = {"listen": args.listen, "data_dir": args.data_dir,
                 "metrics_port": args.metrics_port, "redis_url": args.redis_url,
                 "host_bytes": args.host_bytes, "disk_bytes": args.disk_bytes,
                 "replay_workers": args.replay_workers, "log_level": args.log_level,
                 "log_format": args.log_format}

    def read_config():  # at start and on each reload, from the same sources
        return load_config(args.config, preset=args.preset, overrides=overrides)

    try:
        config = read_config()
        preflight.check(config, insecure=args.insecure)
    except KVTierError as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvtier serve: cannot start: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    if args.print_config:
        print(json.dumps(config.summary(), indent=2))
        return 0
    return asyncio.run(_serve(config, read_config))


async def _serve(config, read_config) -> int:
    from services.server.reload import reload as reload_server
    from services.server.server import create_server

    try:
        server, port = await create_server(config, freeze_startup=True)
    except KVTierError as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvtier serve: cannot start: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    reloads = 0

    def reload() -> None:
        nonlocal reloads
        reloads += 1
        ok, line = reload_server(server, read_config)
        try:
            record_reload(config.data_dir, reloads, ok, line)
        except OSError as exc:
            logging.getLogger(__name__).warning("cannot record the reload's outcome: %s", exc)

    reload_on_hangup(reload)
    pid_file = record_pid(config.data_dir)
    host = config.listen.rpartition(":")[0]
    extra = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
    print(f"kvtier serving on {host}:{port}{extra}", flush=True)
    try:
        await stop.wait()
    finally:
        forget_pid(pid_file)
        await server.stop()
    return 0
