"""The "method" section of the trace benchmark's output: how each figure is obtained."""

from __future__ import annotations

from bench.trace.reader import BLOCK_TOKENS


def describe_method(sizes: dict, host_ratio: float, disk_fraction: float | None,
                    hint_sigma: float, session_ttl_s: float | None,
                    replay_cost: float) -> dict:
    w = sizes["window_tokens"]
    disk = ("unbounded" if disk_fraction is None
            else f"{disk_fraction:g} x footprint; a chunk evicted from it is dropped")
    return {
        "block_bytes": f"layout {sizes['name']}: persistent {sizes['persistent_bytes_per_token']:g}"
                       f" B/token x {BLOCK_TOKENS} tokens per trace block = "
                       f"{sizes['block_bytes']} B",
        "window_bytes": f"ephemeral {sizes['ephemeral_bytes_per_token']:g} B/token x W={w} "
                        f"tokens = {sizes['window_bytes']} B per session, hbm/host only",
        "blocks": "a request's complete blocks (the first input_length // 512 hash_ids) are "
                  "its chunks; its partial last block is the session's tail, which kvtier "
                  "keeps in the manifest, not in a tier: left out (trace.tail_blocks)",
        "sessions": "a request continues the session of the earlier request whose "
                    "complete blocks are the longest prefix of its own (ids are prefix "
                    "hashes, so matching that last complete block id suffices; latest on a "
                    "tie) only if that request is still its session's latest and the session "
                    "is alive: restore, then spill the next generation; any other request "
                    "starts a new session from the prefix Lookup finds held (a spill naming "
                    "those chunks by key, then a restore reading them) and prefills the rest",
        "session_end": f"a session is deleted {session_ttl_s:g} s after its last request"
                       if session_ttl_s else "sessions are never deleted",
        "retention": "with retain_unreferenced (the results), chunks no session names stay "
                     "as cache entries a lookup finds; a policy that does not rank them "
                     "itself (lru, hint) has them evicted first (oldest retained first, "
                     "kvstore.prefix.chains.Retention); kvtier and belady rank them with the "
                     "rest; an evicted one moves down like any other block unless the full "
                     "tier below would not admit it (EvictionPolicy.admits: its policy ranks "
                     "it below all it holds), and is dropped where no tier takes it; without "
                     "retention they are freed from every tier at once",
        "headline": f"reuse_fast_value = (fast block hits among re-reads + {replay_cost:g} x "
                    f"window hits) / (block re-reads + {replay_cost:g} x resumes): a resume "
                    f"that finds no window replays W tokens, weighed as {replay_cost:g} chunk "
                    f"reads from disk (kvstore.eviction.reuse.REPLAY_COST_READS: bench.resume "
                    f"restores 8 chunks from disk in 1.35 ms and replays 128 tokens in 28 ms "
                    f"on the development machine); the goals (bench.trace.compare) use it",
        "capacities": f"footprint = unique blocks x block bytes; hbm = f x footprint, host = "
                      f"{host_ratio:g} x f x footprint, disk {disk}",
        "replay": "per request at its timestamp (virtual clock): sessions past their TTL "
                  "deleted; read its session's stored blocks (a continuation: "
                  "TierManager.restore) or its looked-up prefix - a hit in the highest tier "
                  "holding it, then promoted to hbm - and its session's window; prefill the "
                  "rest (new if never stored, else re-prefill); spill its blocks and a new "
                  "window with its hint; write back new blocks to disk; placement, eviction "
                  "cascade, protection of the blocks being read or spilled, freeing, "
                  "retention and write-back mirror kvstore.placement.stack.TierStack and the "
                  "manager's spill/restore",
        "validation": "the first N requests replayed, with the validation's session TTL, "
                      "through the real TierStack (every policy) and the real TierManager "
                      "(lookup, spill by key, restore, delete; Belady excepted) over "
                      "HBMTier, HostTier and DiskTier with real encoded chunks; agree = every "
                      "count equals the simulation's; covers: what the prefix exercised "
                      "(sessions ended, retained chunks read by a lookup, block reads from "
                      "disk, misses: resumes that replayed or reads no tier served)",
        "shapes": "generated workloads (bench.trace.shapes: chat, agent, forks, mix, bursts; "
                  "parameters and seed under each shape's report) replayed the same way, "
                  "policies kvtier, lru and belady",
        "reuse_by_kind": "re-reads of a block last used by the same session (its own "
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
        "hints": f"hint: true gap to the session's next request x exp({hint_sigma:g} z), "
                 f"z ~ N(0,1) per request (an oracle-derived estimate from the trace's "
                 f"future, standing for a framework predicting its pause); a session's "
                 f"last request hints 1e9 s; hint-perfect: sigma 0; hint-causal: "
                 f"the hints kvtier infers itself (kvstore.eviction.pause_estimate.PauseEstimator, "
                 f"no future knowledge): a session's first request hints the 90th "
                 f"percentile of the last 512 gaps seen so far over the share of first "
                 f"requests whose session came back so far, a later request a pause of "
                 f"0 (due now, then ranked by recency); each hint is attached when its "
                 f"request spills; HintPolicy sees them through kvstore.eviction.policies.HintBook "
                 f"(predicted returns in trace time: the earliest ahead among the sessions "
                 f"storing a block, kept when the block moves; a missed return ages the "
                 f"block; a block whose hints proved wrong is kept in LRU order)",
        "kvtier": "the project's policy (kvstore.eviction.reuse.ReusePolicy via "
                  "reuse_policies: one model shared by a stack's tiers), no future "
                  "knowledge: evicts the block of lowest learned hit density x loss cost "
                  "per byte (a window's loss weighed as the replay it costs) "
                  "(reads expected after its age over the time it is expected to stay, "
                  "per reuse class: reads so far x the pause its last hint predicted) "
                  "among 64 drawn at random (seeded), a copy a higher tier also holds "
                  "first; hints inferred as hint-causal's; kvtier-hint: the same policy "
                  "given hint's oracle-derived hints; kvtier-returns (a probe, not run by "
                  "default): the same told only whether each session comes back (a 60 s "
                  "pause if it does, 1e9 s if not)",
        "belady": "evict the block of largest weighted distance (next read - now) x size "
                  "/ cost, a window's loss costing the replay cost in chunk reads (never "
                  "read again: first), from a next-use table over the whole trace's read "
                  "sequence, in every tier, retained chunks ranked with the rest; a block "
                  "moving down enters a full tier only if its weighted distance is below "
                  "the victim's (bypass); optimal for one tier of equal-size blocks, and "
                  "on the hierarchy with window blobs the reference of the headline figure "
                  "(goals.belady_bound lists any point above the best reference)",
        "belady-blocks": "belady weighing every block alike (size and cost ignored): the "
                         "reference of the blocks' own fast hit rate",
    }
