"""``kvtier layouts``: the layout specs and what they cost per token: this build's
presets, or with ``--server`` every layout that server serves (ListLayouts: presets,
its config's and those registered at run time)."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.format.errors import KVTierError
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import all_layouts
from services.cli.address import add_credential_arguments, client_options, failure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", metavar="HOST:PORT",
                        help="list the layouts this kvtier server serves (default: this "
                        "build's presets)")
    add_credential_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list")


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 3)


def _served(args: argparse.Namespace) -> list[tuple[LayoutSpec, dict]]:
    from kvtier.sync import Client
    from kvtier.types import RetryPolicy

    with Client(args.server, timeout_s=30, retry=RetryPolicy(attempts=2),
                **client_options(args)) as kv:
        return [(info.spec, {"builtin": info.builtin, "layout_json": info.layout_json})
                for info in kv.layouts()]


def run(args: argparse.Namespace) -> int:
    if args.server:
        try:
            specs = _served(args)
        except KVTierError as exc:
            print(failure("layouts", args.server, exc), file=sys.stderr)
            return 1
    else:
        specs = [(spec, {}) for spec in all_layouts()]
    rows = []
    for spec, extra in specs:
        row = spec.summary() | extra
        for key in (
            "persistent_bytes_per_token",
            "ephemeral_bytes_per_token",
            "bf16_baseline_bytes_per_token",
            "reduction_vs_bf16",
        ):
            row[key] = _number(row[key])
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = (
        f"{'layout':<20} {'persistent B/tok':>17} {'window B/tok':>13} "
        f"{'bf16 B/tok':>11} {'reduction':>10}  replayer"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['name']:<20} {r['persistent_bytes_per_token']:>17,} "
            f"{r['ephemeral_bytes_per_token']:>13,} {r['bf16_baseline_bytes_per_token']:>11,} "
            f"{r['reduction_vs_bf16']:>9,}x  {r['replayer']}"
        )
    return 0
