"""The "method" section of the trace benchmark's output: how each figure is obtained."""

from __future__ import annotations

from bench.trace_reader import BLOCK_TOKENS


def describe_method(sizes: dict, host_ratio: float, disk_fraction: float | None,
                    hint_sigma: float) -> dict:
    w = sizes["window_tokens"]
    disk = ("unbounded" if disk_fraction is None
            else f"{disk_fraction:g} x footprint; a chunk evicted from it is dropped")
    return {
        "block_bytes": f"layout {sizes['name']}: persistent {sizes['persistent_bytes_per_token']:g}"
                       f" B/token x {BLOCK_TOKENS} tokens per trace block = "
                       f"{sizes['block_bytes']} B",
        "window_bytes": f"ephemeral {sizes['ephemeral_bytes_per_token']:g} B/token x W={w} "
                        f"tokens = {sizes['window_bytes']} B per conversation, hbm/host only",
        "blocks": "a request's complete blocks (the first input_length // 512 hash_ids) are "
                  "its chunks; its partial last block is the session's tail, which kvtier "
                  "keeps in the manifest, not in a tier: left out (trace.tail_blocks)",
        "conversations": "a request resumes the earlier request whose complete blocks "
                         "(input_length // 512 of them) are the longest prefix of its own "
                         "hash_ids (ids are prefix hashes, so matching that last complete "
                         "block id suffices; latest request on a tie); else it starts one",
        "capacities": f"footprint = unique blocks x block bytes; hbm = f x footprint, host = "
                      f"{host_ratio:g} x f x footprint, disk {disk}",
        "replay": "per request at its timestamp (virtual clock): read its blocks (reads="
                  "prefix: all its complete blocks, as an engine looking its prompt up by "
                  "chunk key; reads=session: only its conversation's stored blocks, as "
                  "TierManager.restore) - a hit in the highest tier holding it, then "
                  "promoted to hbm - read the conversation's window, spill its blocks and a "
                  "new window with its hint, free blocks no conversation stores any more, "
                  "write back new blocks to disk; placement, eviction cascade, protection "
                  "of the blocks being read or spilled, freeing and write-back mirror "
                  "kvstore.placement.TierStack and the manager's spill/restore",
        "validation": "the first N requests replayed through the real TierStack (prefix "
                      "reads, every policy) and the real TierManager (session reads, "
                      "Belady excepted) over HBMTier, HostTier and DiskTier with real "
                      "encoded chunks; agree = every count equals the simulation's",
        "reuse_by_kind": "re-reads of a block last read by the same conversation (its own "
                         "history) or by another one (a shared prefix, deduplicated), each "
                         "with its fast (hbm + host) hit rate",
        "block_hit_rate": "per tier: block reads served by that tier / all block reads; new: "
                          "first read ever (prefill of new tokens, same for every policy); "
                          "reprefill: read before but in no tier now; reuse_hit_rate divides "
                          "by reads that are not first reads; fast = hbm + host",
        "bytes_moved": "bytes written into each tier, by cause: spill (new blocks and "
                       "windows), promotion (read below hbm, copied up), demotion (evicted, "
                       "moved down), writeback (copy to the durable tier)",
        "replays": f"resumes whose window blob was in neither hbm nor host: each reruns "
                   f"W={w} tokens (replay_tokens); reprefill_* count blocks missing from "
                   f"every tier",
        "hints": f"hint: true gap to the conversation's next request x exp({hint_sigma:g} z), "
                 f"z ~ N(0,1) per request (an oracle-derived estimate from the trace's "
                 f"future, standing for a framework predicting its pause); a conversation's "
                 f"last request hints 1e9 s; hint-perfect: sigma 0; hint-causal: "
                 f"the hints kvtier infers itself (kvstore.pause_estimate.PauseEstimator, "
                 f"no future knowledge): a conversation's first request hints the 90th "
                 f"percentile of the last 512 gaps seen so far over the share of first "
                 f"requests whose conversation came back so far, a later request a pause of "
                 f"0 (due now, then ranked by recency); each hint is attached when its "
                 f"request spills; HintPolicy sees them through kvstore.policy.HintBook "
                 f"(predicted returns in trace time: the earliest ahead among the sessions "
                 f"storing a block, kept when the block moves; a missed return ages the "
                 f"block; a block whose hints proved wrong is kept in LRU order)",
        "belady": "evict the block whose next read is farthest ahead (never again: first), "
                  "from a next-use table over the whole trace's read sequence, in every "
                  "tier; optimal for one tier of equal-size blocks, a reference (not a "
                  "proven bound) for the hierarchy with window blobs",
    }
