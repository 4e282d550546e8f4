"""kvtier's disk tier side by side with LMCache's LocalDiskBackend, on the same work.

``python -m bench.peers --lmcache-venv DIR [--peers-dir DIR] [--runs 3]`` runs the shared
peer bench (``side_by_side.sh`` of ``--peers-dir``: 256 values of 1 MiB of bf16 bytes,
stored, page cache dropped, read back cold concurrently and one after another, checked
byte for byte; the two alternate, ``--runs`` each, in one sitting) and writes
``bench/peers_lmcache.json``, which the report reads: per path the medians of both and
kvtier / LMCache. ``--from-jsonl FILE`` summarizes the lines of a run already made.

LMCache runs from its own virtual environment (never the project's); dropping the page
cache needs root. LMCache never fsyncs, so its durable store is its store plus an fsync
of its files afterwards. ``goal``: durable store >= 1.2x, cold reads >= 1.0x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "peers_lmcache.json"
# (path, LMCache key, kvtier key, goal ratio or None)
PAIRS = (
    ("durable store", "lmc_store_plus_fsync_GBps", "kvt_store_durable_GBps", 1.2),
    ("durable store, concurrent single puts", "lmc_store_plus_fsync_GBps",
     "kvt_store_concurrent_puts_durable_GBps", None),
    ("store, LMCache without fsync", "lmc_store_GBps", "kvt_store_durable_GBps", None),
    ("cold concurrent read", "lmc_retrieve_cold_batched_GBps", "kvt_get_cold_concurrent_GBps",
     1.0),
    ("cold sequential read", "lmc_retrieve_cold_seq_GBps", "kvt_get_cold_seq_GBps", 1.0),
)


def summarize(lines: list[dict]) -> dict:
    """Medians per path from side_by_side.sh's lines ({"who": ..., "r": {...}})."""
    def median(who: str, key: str) -> float | None:
        values = [line["r"][key] for line in lines if line["who"] == who and key in line["r"]]
        return statistics.median(values) if values else None

    rows = []
    for path, theirs, ours, goal in PAIRS:
        lmc, kvt = median("lmcache", theirs), median("kvtier", ours)
        ratio = kvt / lmc if lmc and kvt is not None else None
        rows.append({"path": path, "lmcache_gbps": lmc, "kvtier_gbps": kvt,
                     "kvtier_vs_lmcache": ratio, "goal": goal,
                     "met": None if goal is None or ratio is None else ratio >= goal})
    runs = {who: sum(line["who"] == who for line in lines) for who in ("kvtier", "lmcache")}
    exact = all(v for line in lines for k, v in line["r"].items() if k.endswith("exact"))
    first = next((line["r"] for line in lines if line["who"] == "kvtier"), {})
    return {"benchmark": "peers", "peer": "LMCache 0.5.6 LocalDiskBackend", "runs": runs,
            "value_bytes": first.get("value_bytes"), "values": first.get("n"),
            "rows": rows, "all_exact": exact,
            "raw_write_fsync_each_gbps": median("lmcache", "raw_write_fsync_each_GBps"),
            "raw_read_cold_seq_gbps": median("lmcache", "raw_read_cold_seq_GBps"),
            "load_average_1m": os.getloadavg()[0],
            "goals_met": all(r["met"] is not False for r in rows)}


def section(path: Path = RESULT) -> list[str]:
    """The report's section, from the committed result of the last run."""
    out = ["## Side by side with LMCache (`python -m bench.peers`)", ""]
    if not path.exists():
        return out + [f"_not run: no {path.name}_", ""]
    got = json.loads(path.read_text())
    out += [f"{got['values']} values of {got['value_bytes']} B, {got['peer']} against "
            "kvtier's DiskTier at their storage layers, page cache dropped before reads, "
            f"alternating, medians of {got['runs']['kvtier']} runs each (GB/s); every value "
            f"read back byte for byte: {got['all_exact']}. Raw sequential cold reads of the "
            f"same files: {got['raw_read_cold_seq_gbps']:.2f} GB/s. kvtier fsyncs and "
            "checksums; LMCache does neither. Not part of `make bench` (it needs LMCache's "
            f"own environment and root); load average {got['load_average_1m']:.1f}.", ""]
    rows = [[r["path"], _gbps(r["kvtier_gbps"]), _gbps(r["lmcache_gbps"]),
             "-" if r["kvtier_vs_lmcache"] is None else f"{r['kvtier_vs_lmcache']:.2f}x",
             "-" if r["goal"] is None else f">= {r['goal']}x: {'met' if r['met'] else 'NOT met'}"]
            for r in got["rows"]]
    header = ["path", "kvtier", "LMCache", "kvtier / LMCache", "goal"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return out + [""]


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def run(peers_dir: Path, lmcache_venv: Path, runs: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="kvtier-peers-") as tmp:
        out = Path(tmp) / "side_by_side.jsonl"
        subprocess.run(["bash", str(peers_dir / "side_by_side.sh"), str(HERE.parent),
                        str(lmcache_venv), str(runs)], check=True,
                       env={**os.environ, "OUT": str(out)}, stdout=subprocess.DEVNULL)
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lmcache-venv", type=Path)
    parser.add_argument("--peers-dir", type=Path, default=HERE.parent.parent / "shared" / "peers")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--from-jsonl", type=Path)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    if args.from_jsonl is not None:
        lines = [json.loads(x) for x in args.from_jsonl.read_text().splitlines() if x.strip()]
    elif args.lmcache_venv is None:
        parser.error("--lmcache-venv (a virtual environment with lmcache 0.5.6) or "
                     "--from-jsonl is needed")
    else:
        lines = run(args.peers_dir, args.lmcache_venv, args.runs)
    result = summarize(lines)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
