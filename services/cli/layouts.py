"""``kvtier layouts``: the shipped layout specs and what they cost per token."""

from __future__ import annotations

import argparse
import json

from kvstore.layout import all_layouts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list")


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 3)


def run(args: argparse.Namespace) -> int:
    rows = []
    for spec in all_layouts():
        row = spec.summary()
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
        f"{'layout':<18} {'persistent B/tok':>17} {'window B/tok':>13} "
        f"{'bf16 B/tok':>11} {'reduction':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['name']:<18} {r['persistent_bytes_per_token']:>17,} "
            f"{r['ephemeral_bytes_per_token']:>13,} {r['bf16_baseline_bytes_per_token']:>11,} "
            f"{r['reduction_vs_bf16']:>9,}x"
        )
    return 0
