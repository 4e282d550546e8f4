"""Bytes per token the disk tier really holds for spilled sessions, against the layout
spec's figure (``kvtier layouts``) and the plain bf16 cache of the same model.

``python -m bench.bytes --json [--sessions 1000,3000,8192]``

Real sessions: the bundled model prefills held-out text (``model.data``) of each length
(lengths that are not multiples of the 512-token chunk leave a partial tail, as real
sessions do). Each is spilled through a ``TierManager`` over real host, disk and object
tiers in a temp dir (durable ack, window included), then demoted to the disk tier, as a
paused session ends up. Then, over all sessions together, per token:

- ``spec``: persistent bytes/token computed from the layout spec (what ``kvtier
  layouts`` prints); ``bf16_baseline``: the spec's plain cache (every layer's bf16 K and V);
- ``encoded_chunks``: the codec's bytes for the full chunks (headers and checksums
  included) over the tokens they cover;
- ``manifests``: the session manifests (token ids at the fewest bytes that hold them,
  the encoded tail chunk, the chunk keys), held by the disk tier in its segments, once
  each (``kvstore/tiers/disk/meta.py``);
- ``disk_live_records``: the live records of the segments (the index's exact
  accounting: headers, keys, chunk values, the manifests' records);
- ``index_meta_values``: metadata values the LMDB index holds itself (the derived
  records: reference counts, retention marks);
- ``disk_total``: live records + index-held values over every token, the headline
  figure: what the tier holds, each byte once;
- ``disk_segments``: the segment files on the file system (``st_size``), which also
  counts ``disk_dead``: records superseded (a manifest rewritten, a chunk deleted) that
  compaction reclaims, reported beside the headline, not in it (a demotion leaves
  the manifest as it is);
- ``lmdb_allocated``: the index environment's allocated file blocks (page-granular,
  shared by every session, so it too is reported beside the headline);
- ``object_zstd``: the object tier's stored bytes after the sessions are demoted there
  (zstd level 3), plus the manifests, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

from bench.resume import (
    TENANT,
    add_model_arguments,
    held_out_ids,
    model_from_args,
    open_store,
    spec_for,
    spill_state,
)
from kvstore.session.manifest import manifest_key
from model.infer import prefill
from model.net import KVTierLM


def allocated(root: Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the files under ``root``."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return (sum(p.stat().st_size for p in files),
            sum(p.stat().st_blocks * 512 for p in files))


async def measure(model: KVTierLM, model_info: dict, lengths: list[int], root: Path) -> dict:
    """Spill sessions of ``lengths`` tokens under ``root`` and count the bytes (see the
    module docstring); ``model_info`` says which weights ``model`` has."""
    spec = spec_for(model.cfg)
    manager = await open_store(root)
    chunk_bytes = full_tokens = 0
    try:
        for i, n in enumerate(lengths):
            state, _ = prefill(model, held_out_ids(n, offset=i / max(len(lengths), 1)),
                               logits="none")
            await spill_state(manager, spec, f"s{i}", state)
            await manager.demote(TENANT, f"s{i}", "disk")
        await manager.drain()
        disk, objects = manager.tiers[1], manager.tiers[2]
        manifests = 0
        for i in range(len(lengths)):
            manifest = await manager.get_manifest(TENANT, f"s{i}")
            if manifest.window_key is not None or any(
                    manager.where(key) != ["disk"] for key in manifest.chunk_keys):
                raise RuntimeError(f"session s{i} is not on the disk tier alone")
            manifests += len(await manager.meta.get(manifest_key(TENANT, f"s{i}")))
            chunk_bytes += sum(manifest.chunk_sizes)
            full_tokens += len(manifest.chunk_keys) * spec.chunk_tokens
        segments_apparent, segments_allocated = allocated(disk.segment_dir)
        index_apparent, index_allocated = allocated(disk.path / "index")
        live_records = sum(info.live_bytes for info in disk.segments())
        index_values = sum(len(value) for _, value, _ in disk.index.meta_scan(b""))
        live = disk.used_bytes
        for i in range(len(lengths)):
            await manager.demote(TENANT, f"s{i}", "object")
        await manager.drain()
        object_bytes = objects.used_bytes
    finally:
        await manager.close()
    tokens = sum(lengths)
    per_token = {
        "spec": spec.persistent_bytes_per_token,
        "bf16_baseline": spec.bf16_baseline_bytes_per_token,
        "encoded_chunks": chunk_bytes / full_tokens if full_tokens else None,
        "disk_live_values": live / tokens,
        "manifests": manifests / tokens,
        "disk_live_records": live_records / tokens,
        "index_meta_values": index_values / tokens,
        "disk_total": (live_records + index_values) / tokens,
        "disk_segments": segments_apparent / tokens,
        "disk_dead": (segments_apparent - live_records) / tokens,
        "lmdb_allocated": index_allocated / tokens,
        "object_zstd": (object_bytes + manifests) / tokens,
    }
    return {
        "benchmark": "bytes", "model": model_info, "layout": spec.layout_id,
        "sessions": lengths, "tokens": tokens, "chunk_tokens": spec.chunk_tokens,
        "bytes": {"encoded_chunks": chunk_bytes, "disk_live_values": live,
                  "segment_files": segments_apparent,
                  "segment_files_allocated": segments_allocated,
                  "manifests": manifests, "live_records": live_records,
                  "index_meta_values": index_values, "lmdb_apparent": index_apparent,
                  "lmdb_allocated": index_allocated, "object_stored": object_bytes},
        "bytes_per_token": per_token,
        "disk_vs_spec": per_token["disk_total"] / per_token["spec"],
        "bf16_vs_disk": per_token["bf16_baseline"] / per_token["disk_total"],
        # on disk: what the tier holds, and its files' size too
        "goal": {"disk_total_max": 40, "met_40_b_per_token":
                 max(per_token["disk_total"], per_token["disk_segments"]) <= 40},
        "load_average_1m": os.getloadavg()[0],
    }


def format_table(result: dict) -> str:
    lines = [f"model: {result['model']}",
             f"{len(result['sessions'])} sessions, {result['tokens']} tokens: bytes per token"]
    lines += [f"  {name:<18} {'-' if v is None else f'{v:10.2f}'}"
              for name, v in result["bytes_per_token"].items()]
    lines.append(f"disk total / spec = {result['disk_vs_spec']:.3f}; "
                 f"bf16 baseline / disk total = {result['bf16_vs_disk']:.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1000,3000,8192",
                        help="comma-separated session lengths (tokens)")
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.sessions.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="kvtier-bytes-") as tmp:
        result = asyncio.run(measure(*model_from_args(args), lengths, Path(tmp)))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
