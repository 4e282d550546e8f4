"""``kvtier stat``: the server's tiers (usage, lookups, hits, hit rate), sessions,
write-back queue depth, replays and node id, from the Stat RPC; ``--session`` also
describes a session, with the node holding its window and that node's address (where a
fleet's router sends it); ``--tenant`` also prints a tenant's use against its quotas,
``--metrics-url`` the Prometheus endpoint's ``kvtier_*`` samples; ``--fleet`` (a fleet node)
also the fleet's view: sessions in the shared bucket (what every node's listing shows, where
``sessions`` counts those this node has loaded), the nodes it has seen, the garbage
collection's epoch and this node's compare-and-swap outcomes, and every node's liveness:
its state and last heartbeat's age, DOWN when it is older than the server's
``fleet_down_after_s`` (``--json``: a "fleet" object beside the other keys; every number
a JSON number)."""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.format.errors import InvalidRequest, KVTierError, TierUnavailable
from services.cli.address import add_server_argument, client_options, failure
from services.cli.json_out import value_json

if TYPE_CHECKING:
    from kvtier.types import FleetStat, TenantUsage, TierStat


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def hit_rate(hits: int, lookups: int) -> str:
    return f"{100 * hits / lookups:5.1f}%" if lookups else "    -"


def tier_table(tiers: Sequence[TierStat], deltas: dict[str, tuple[int, int]] | None = None
               ) -> list[str]:
    """One line per tier; ``deltas``: (lookups, hits) since the previous sample."""
    head = f"{'tier':<8} {'used':>11} {'capacity':>11} {'items':>8} {'lookups':>9} " \
           f"{'hits':>9} {'hit rate':>8}"
    if deltas is not None:
        head += f" {'recent':>8}"
    lines = [head]
    for t in tiers:
        line = (f"{t.name:<8} {human_bytes(t.used_bytes):>11} {human_bytes(t.capacity_bytes):>11}"
                f" {t.items:>8} {t.lookups:>9} {t.hits:>9} {hit_rate(t.hits, t.lookups):>8}")
        if deltas is not None:
            lookups, hits = deltas.get(t.name, (0, 0))
            line += f" {hit_rate(hits, lookups):>8}"
        if not t.available:
            line += "  UNAVAILABLE"
        lines.append(line)
    return lines


def usage_table(usage: TenantUsage) -> list[str]:
    """A tenant's use against each quota."""
    lines = [f"tenant {usage.tenant}", f"{'quota':<14} {'in use':>12} {'limit':>12}"]
    for quota, human in (("sessions", str), ("durable_bytes", human_bytes),
                         ("memory_bytes", human_bytes)):
        limit = getattr(usage, f"{quota}_limit")
        shown = "unlimited" if limit is None else human(limit)
        line = f"{quota:<14} {human(getattr(usage, quota)):>12} {shown:>12}"
        if usage.rejections.get(quota):
            line += f"  {usage.rejections[quota]} refused"
        lines.append(line)
    # not a quota: retained chunks fill the room durable_bytes leaves, and give way first
    lines.append(f"{'retained_bytes':<14} {human_bytes(usage.retained_bytes):>12} "
                 f"{'(cache)':>12}")
    return lines


def fleet_lines(fleet: FleetStat) -> list[str]:
    """The fleet's view: one line per node's last heartbeat, DOWN
    past the server's ``fleet_down_after_s``."""
    cas = "   ".join(f"{result} {count}" for result, count in sorted(fleet.cas.items()))
    lines = [f"fleet: sessions {fleet.sessions}   nodes seen {len(fleet.nodes_seen)} "
             f"({', '.join(fleet.nodes_seen)})",
             f"{'node':<16} {'address':<24} {'state':<9} {'heartbeat':>10}"]
    for node in fleet.nodes:
        lines.append(f"{node.node_id:<16} {node.address:<24} {node.state:<9} "
                     f"{node.heartbeat_age_s:>8.1f} s" + ("  DOWN" if node.down else ""))
    lines += [f"fleet gc: epoch {fleet.gc_epoch} {fleet.gc_state}"
              + (f" (by {fleet.gc_sweeper})" if fleet.gc_sweeper else ""),
              f"manifest CAS on this node: {cas or '-'}"]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_argument(parser)
    parser.add_argument("--session", metavar="TENANT/ID", help="also describe this session")
    parser.add_argument("--tenant", default="", help="also show this tenant's use against "
                        "its quotas")
    parser.add_argument("--fleet", action="store_true", help="also show the fleet's view "
                        "(a fleet node: sessions in the shared bucket, nodes, gc epoch)")
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")
    parser.add_argument("--metrics-url", help="also print kvtier_* samples from this URL "
                        "(e.g. https://127.0.0.1:9100/metrics, checked with --tls-ca)")


def run(args: argparse.Namespace) -> int:
    from kvtier.sync import Client
    from kvtier.types import RetryPolicy

    tenant, _, session_id = (args.session or "").partition("/")
    try:
        # One retry: a server restarting right now answers; none there fails in a second.
        with Client(args.server, timeout_s=10, retry=RetryPolicy(attempts=2),
                    **client_options(args)) as kv:
            reply = kv.stat(tenant, session_id, usage_of=args.tenant, fleet=args.fleet)
    except KVTierError as exc:
        print(failure("stat", args.server, exc), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(value_json(reply),
                         indent=2))
    else:
        print("\n".join(tier_table(reply.tiers)))
        print(f"node {reply.node_id}   sessions {reply.sessions}   write-back queue "
              f"{reply.writeback_queue_depth}   replays {reply.replays}")
        print(f"retained {reply.retained_chunks} chunks, {human_bytes(reply.retained_bytes)}"
              " (unreferenced, kept as cache for prefix reuse)")
        if reply.session is not None:
            s = reply.session
            print(f"session {s.session.tenant}/{s.session.session_id}: {s.num_tokens} tokens,"
                  f" {s.chunks} chunks, generation {s.generation}, layout {s.layout_id}, "
                  f"tiers {','.join(s.tiers) or '-'}, window {s.window_tier or 'dropped'}")
            # The node whose memory holds the window: a router sends the session there.
            print(f"window node {s.window_node_id} at {s.window_node_address or '-'}"
                  if s.window_node_id else "window node - (a resume anywhere replays)")
        if reply.tenant_usage is not None:
            print("\n".join(usage_table(reply.tenant_usage)))
        if reply.fleet is not None:
            print("\n".join(fleet_lines(reply.fleet)))
    if args.metrics_url:
        try:
            text = fetch_metrics(args.metrics_url, args)
        except KVTierError as exc:
            print(f"kvtier stat: {exc}", file=sys.stderr)
            return 1
        print("\n".join(line for line in text.splitlines() if line.startswith("kvtier_")))
    return 0


def fetch_metrics(url: str, args: argparse.Namespace) -> str:
    """The text at ``url``; over https checked against ``--tls-ca`` (else the system's
    CAs), presenting ``--tls-cert``/``--tls-key`` when given, as the gRPC calls do."""
    context = None
    if url.startswith("https:"):
        try:
            context = ssl.create_default_context(cafile=args.tls_ca or None)
            if args.tls_cert:
                context.load_cert_chain(args.tls_cert, args.tls_key or None)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidRequest(f"--metrics-url {url}: cannot load the TLS files: "
                                 f"{exc}") from exc
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            return response.read().decode()
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise TierUnavailable(f"--metrics-url {url}: the certificate does not verify "
                                  f"({reason.verify_message}); pass the server's CA as "
                                  "--tls-ca") from exc
        raise TierUnavailable(f"--metrics-url {url}: {reason}") from exc
    except (OSError, ValueError) as exc:  # a reset connection, a malformed URL
        raise TierUnavailable(f"--metrics-url {url}: {exc}") from exc
