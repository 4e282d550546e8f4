"""Write bench/REPORT.md and its PNG plots (``bench.report_plots``) from the JSON
``bench.all`` collected.

``python -m bench.report [--results bench/results.json] [--out-dir bench]``

Every figure in the report is read from the results file; nothing here measures anything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import peers
from bench.report_plots import PATH_LABELS, RESUME_PATHS, plot_fidelity, plot_resume, plot_trace
from bench.seams.report import section as seams_section
from bench.sglang.report import section as sglang_section
from bench.trace.report import section as trace_section
from bench.vllm.report import section as vllm_section
from stress.adversarial.report import section as adversarial_section
from stress.faults.report import section as faults_section
from stress.fuzz.report import section as fuzz_section
from stress.markdown import table


def _ms(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def _ok(stage: dict | None) -> bool:
    return bool(stage) and "error" not in stage and "skipped" not in stage


def _problem(name: str, stage: dict | None) -> list[str]:
    if stage is None:
        return [f"_{name}: not run._", ""]
    return [f"_{name}: {stage.get('error') or stage.get('skipped')}_", ""]


def machine_section(results: dict) -> list[str]:
    m = results["machine"]
    rows = [["CPU", f"{m['cpu_model']} ({m['cpus']} cores, {m['cpus_usable']} usable)"],
            ["memory", f"{m['memory_gib']} GiB"], ["CUDA", m["cuda"]],
            ["python / torch / triton", f"{m['python']} / {m['torch']} / {m['triton']}"],
            ["platform", m["platform"]], ["git commit", m["git_commit"]],
            ["model weights", f"commit {m.get('weights_commit') or 'none (not committed)'}"],
            ["date", m["date_utc"]],
            ["load average (1, 5, 15 min) at start / end",
             f"{_load(m['load_average_at_start'])} / {_load(results['load_average_at_end'])}"],
            ["torch threads", results["torch_threads"]], ["sizes", results["sizes"]]]
    return ["## Machine", ""] + table(["", ""], rows) + [""]


def _load(values) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def resume_section(stage: dict) -> list[str]:
    out = ["## Resume against re-prefill (`python -m bench.resume`)", "",
           f"Driven: {stage['driven']}. Model: `{_model(stage['model'])}`. Replay R = "
           f"{stage['replay_tokens']}; best of {stage['repeats']} (prefill once); page cache "
           "dropped for the files read before each timed read. `verified`: the next-byte "
           "distribution decoded from the resumed state is within a KL of "
           f"{stage['kl_tol']} nats of the never-evicted session's (n/a: prefill is the "
           "reference; the naive cache is not this model's format); `top-1` says whether "
           "their argmax agree.", "", "![time to ready](resume_time.png)", ""]
    rows = []
    for row in stage["contexts"]:
        for name in RESUME_PATHS:
            p = row["paths"].get(name, {"skipped": "not run"})
            if "seconds" not in p:
                rows.append([row["context"], PATH_LABELS[name],
                             f"not measured: {p.get('error') or p['skipped']}"] + [""] * 5)
                continue
            kl = p.get("check", {}).get("kl_nats")
            rows.append([row["context"], PATH_LABELS[name], _ms(p["seconds"]),
                         f"{p['speedup_vs_prefill']:.1f}x", f"{p['stored_bytes_per_token']:.1f}",
                         "n/a" if p["verified"] is None else p["verified"],
                         "" if kl is None else f"{kl:.1e}",
                         "" if kl is None else p["check"]["top1_agreement"] == 1.0])
    out += table(["context", "path", "time to ready", "speedup vs prefill",
                  "stored B/token", "verified", "next-token KL", "top-1"], rows) + [""]
    rows = [[row["context"], name, _ms(p["restore_s"]), _ms(p["replay_s"]), _ms(p["decode_s"])]
            for row in stage["contexts"] for name, p in row["paths"].items()
            if "restore_s" in p]
    out += ["Where the tier paths spend their time:", ""]
    out += table(["context", "path", "restore (read + verify)", "replay",
                  "decode to KVState"], rows) + [""]
    rows = [[row["context"], _ms(row["paths"]["host"]["spill_s"]),
             _ms(row["paths"]["naive"]["spill_s"])] for row in stage["contexts"]]
    out += ["Writing the session (not part of time to ready):", ""]
    out += table(["context", "kvtier spill, durable ack (host + disk)",
                  "naive torch.save + fsync"], rows) + [""]
    naive = stage["contexts"][-1]["paths"]["naive"]
    out += [f"The medium: the naive file of the largest context was read back at "
            f"{naive['stored_bytes'] / naive['seconds'] / 1e9:.2f} GB/s with its page cache "
            "dropped (a virtual disk; its reads may be served by the host's cache).", ""]
    g = stage["goal"]
    out += [f"Goal (disk >= 20x faster than re-prefill at 16k, widening with context): "
            f"disk speedup at 16384 = {_num(g['disk_speedup_at_16384'])}, met: "
            f"{g['met_20x_at_16384']}; widening: {g['widening_with_context']}; every checked "
            f"path verified: {g['all_verified']}.", ""]
    return out


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.1f}x"



def _model(info: dict) -> str:
    return f"{info['weights']} (sha256 {info['sha256_16']}...)" if info["trained"] else \
        f"RANDOM INIT, not the trained weights: {info['note']}"


def _cell(row: dict) -> str:
    """A fidelity row's name: its kind of text and context (a run before kinds: its
    context)."""
    return f"{row['kind']} {row['context']}" if "kind" in row else str(row["context"])


def fidelity_section(stage: dict) -> list[str]:
    out = ["## Replay fidelity (`python -m bench.fidelity`)", "",
           f"Model: `{_model(stage['model'])}`. "
           + ("Text outside the training corpus (prose and source code, "
              "`bench.held_out_text`)" if "stated_replay_tokens" in stage else "Held-out text")
           + f", {stage['segments']} stretches per context, the next "
           f"{stage['follow_tokens']} bytes teacher-forced after the "
           "resume; KL(never-evicted || resumed) and top-1 agreement of the next-byte "
           "distributions, bits/byte on the actual bytes. W = "
           f"{stage['window']}.", "", "![fidelity](fidelity.png)", ""]
    rows = [[_cell(row), name, f"{v['kl_nats']:.2e}", f"{v['top1_agreement']:.4f}",
             f"{v['bits_per_byte']:.4f}", f"{v['ref_bits_per_byte']:.4f}",
             f"{v['bpb_rel_diff']:+.2%}", " / ".join(f"{q:.1e}" for q in v["kl_by_quarter"])]
            for row in stage["contexts"] for name, v in row["variants"].items()]
    out += table(["context", "resume", "KL (nats)", "top-1", "bits/byte",
                  "never-evicted bits/byte", "bits/byte change", "KL by quarter"], rows)
    g = stage["goal"]
    out += ["", f"Goal at R = {g['replay_tokens']} (top-1 >= {g['top1_at_least']}, KL <= "
            f"{g['kl_at_most']:g} nats, bits/byte within {g['bpb_within']:.1%}): per context "
            f"{g['met_per_context']}; **{'met' if g['met'] else 'NOT met'}**"
            + (f" (at R = 128: {g['met_at_128']})" if "met_at_128" in g else "") + ".", ""]
    pv = stage.get("parts")
    if pv and pv["per_context"]:
        out += ["What each part is worth (bits/byte lost, as a share of the never-evicted "
                "session's): the window (R = 0 against R = 128) and the global KV "
                f"(window-only against R = 0); goal: each at least {pv['clearly_worse_by']:.0%}.",
                ""]
        out += table(["context", "window dropped (R=0 vs R=128)",
                      "global KV dropped too (window-only vs R=0)", "window-only vs R=128",
                      "clearly ordered"],
                     [[c, f"{p['r0_vs_r128']:+.2%}", f"{p['window_only_vs_r0']:+.2%}",
                       f"{p['window_only_vs_r128']:+.2%}", "yes" if p["ordered"] else "**no**"]
                      for c, p in pv["per_context"].items()])
        out += ["", f"**{'met' if pv['met'] else 'NOT met'}**.", ""]
    return out


def bytes_section(stage: dict) -> list[str]:
    per = stage["bytes_per_token"]
    out = ["## Bytes per token on disk (`python -m bench.bytes`)", "",
           f"{len(stage['sessions'])} real sessions ({', '.join(map(str, stage['sessions']))} "
           f"tokens of held-out text, {stage['tokens']} in all) spilled through the "
           "TierManager and demoted to the disk tier.", ""]
    out += table(["what", "bytes/token"], [[k, "-" if v is None else f"{v:.2f}"]
                                            for k, v in per.items()])
    out += ["", f"Disk total / spec = {stage['disk_vs_spec']:.3f}; bf16 baseline / disk total = "
            f"{stage['bf16_vs_disk']:.1f}x. `manifests` carries the token ids and the partial "
            "last chunk of each session, stored once, in the segments. `disk_total` counts "
            "the live records and the index's own values; `disk_segments` is the files' size, "
            "with `disk_dead` (superseded records that compaction reclaims) in it."]
    if "goal" in stage:
        out.append(f"Goal: at most {stage['goal']['disk_total_max']} B/token on disk (held, "
                   "and the files' size): "
                   f"**{'met' if stage['goal']['met_40_b_per_token'] else 'NOT met'}**.")
    out.append("")
    return out


def codec_tiers_section(codec: dict | None, tiers: dict | None) -> list[str]:
    out = ["## Codec and tiers (`python -m bench.codec`, `python -m bench.tiers`)", ""]
    if _ok(codec):
        out += table(["layout", "chunk B", "zstd", "encode GB/s", "decode GB/s",
                      "run decode GB/s", "memcpy GB/s", "decode / memcpy",
                      "run decode / memcpy", "joined run / memcpy", "run / hot memcpy",
                      "stored / raw"],
                     [[r["layout"], r["chunk_payload_bytes"], r["zstd_level"] or "-",
                       f"{r['encode_gbps']:.2f}", f"{r['decode_gbps']:.2f}",
                       f"{r['decode_run_gbps']:.2f}", f"{r['memcpy_gbps']:.2f}",
                       f"{r['decode_vs_memcpy']:.2f}", f"{r['decode_run_vs_memcpy']:.2f}",
                       f"{r.get('decode_run_joined_vs_memcpy', float('nan')):.2f}",
                       f"{r.get('decode_run_vs_memcpy_hot', float('nan')):.2f}",
                       f"{r['stored_bytes'] / r['payload_bytes']:.3f}"] for r in codec["rows"]])
        out += ["", "decode: one `decode_chunk` per chunk; run decode: the chunks as one "
                "session through `decode_chunks` (one tensor per stream), as a restore of a "
                "whole session does, from one buffer as a shared-memory restore hands them "
                "over; joined run: from a buffer per chunk (inline bytes), joined first. "
                "The decodes and the memcpy take turns; hot memcpy: repeated back to back, "
                "its buffers warm in cache.", ""]
        if "goal" in codec:
            out += [f"Slowest uncompressed run decode: "
                    f"{codec['goal']['decode_run_vs_memcpy_min']:.2f}x memcpy (goal 0.3x: "
                    f"{'met' if codec['goal']['met_0_3x_every_layout'] else 'NOT met'}).", ""]
    else:
        out += _problem("codec", codec)
    if _ok(tiers):
        rows = [[name, r.get("count", ""), f"{r['put_gbps']:.2f}", f"{r['raw_put_gbps']:.2f}",
                 f"{r['get_gbps']:.2f}", f"{r['raw_get_gbps']:.2f}", f"{r['get_vs_raw']:.2f}"]
                if "skipped" not in r else [name, r["skipped"], "", "", "", "", ""]
                for name, r in tiers["tiers"].items()]
        out += [f"Values of {tiers['value_bytes']} B, one call in flight, each tier next to "
                "its bare medium in the same run (GB/s):", ""]
        out += table(["tier", "values", "put", "raw put", "get", "raw get", "get / raw"],
                     rows) + [""]
        zero_copy = [n for n, r in tiers["tiers"].items() if r.get("get_zero_copy")]
        if zero_copy:
            out += [f"{', '.join(zero_copy)}: `get` hands out a read-only view of the stored "
                    "bytes (no copy) on the CPU, so it can exceed memcpy.", ""]
    else:
        out += _problem("tiers", tiers)
    return out


def replay_batch_section(stage: dict) -> list[str]:
    out = ["## Batched replay (`python -m bench.replay_batch`)", "",
           f"R = {stage['replay_tokens']}, {stage['threads']} torch thread(s), random weights "
           "and synthetic global KV of each context's shape. \"n in one call\": n replays one "
           "after another over one `replay_batch` call of the same n sessions (above 1: "
           "batching is faster). The worker batches at most 8,192 tokens of context per "
           "call.", ""]
    keys = [k for k in stage["rows"][0] if k.startswith("batched_speedup_")]
    out += table(["context", "one replay", *[f"{k.rsplit('_', 1)[1]} in one call"
                                            for k in keys]],
                 [[row["context"], _ms(row["replay_ms"] / 1000),
                   *[f"{row[k]:.2f}x" for k in keys]] for row in stage["rows"]])
    return out + [""]


def _routing(stage: dict) -> list[str]:
    """Routed against unrouted resumes, and a fresh node's first resume (runs that have them)."""
    routes, first = stage.get("routing"), stage.get("first_resume")
    out = []
    if routes:
        out += table(["resume", "median", "p90", "replayed"],
                     [[f"{way} ({label})", _ms(r["median_ms"] / 1000), _ms(r["p90_ms"] / 1000),
                       f"{r['replayed']}/{r['resumes']}"]
                      for way, label in (("routed", "`servers=[a, b, c]`: the home node"),
                                         ("unrouted", "round-robin over a, b, c"),
                                         ("other_node", "those not on the home node"))
                      for r in [routes[way]]])
        out += ["", f"Routed / unrouted: {routes['speedup']}x faster (median).", ""]
    if first:
        out += table(["fresh node", "start to serving", "first resume"],
                     [[f"replay_warmup {'on' if f['replay_warmup'] else 'off'}",
                       f"{f['start_s']} s", _ms(f["first_resume_ms"] / 1000)] for f in first])
        out += [""]
    return out


def fleet_section(stage: dict) -> list[str]:
    paths = stage["time_to_ready"]
    out = ["## Fleet (`python -m bench.fleet`)", "",
           f"Real `kvtier serve` replicas (metadata = \"shared\") on one redis-server and one "
           f"moto S3 server, all on this machine's {stage['cpus']} cores; sessions of "
           f"{stage['tokens']} tokens ({stage['chunks']} chunks) of the bundled model, spilled "
           f"durable on a; median of {stage['sessions']} resumes each (decoded, over gRPC), "
           f"replay R = {stage['replay_tokens']}.", ""]
    out += table(["path", "time to ready", "vs re-prefill", "replayed", "chunks from"],
                 [[name.replace("_", " "), _ms(p["median_ms"] / 1000),
                   f"{p['speedup_vs_prefill']:.2f}x", p.get("replayed", "-"),
                   ", ".join(p.get("tiers", [])) or "-"] for name, p in paths.items()])
    m = stage["manifest_round_trip"]
    out += ["", f"Manifest compare-and-swap ({m['bytes']} B, {m['count']} generations): PUT "
            f"If-Match p50 {m['put_p50_ms']} ms (p95 {m['put_p95_ms']}), GET p50 "
            f"{m['get_p50_ms']} ms, both p50 {m['round_trip_p50_ms']} ms "
            f"(p95 {m['round_trip_p95_ms']}).", ""]
    out += table(["replicas", "resumes", "clients", "resumes/s", "replayed"],
                 [[r["replicas"], r["resumes"], r["clients"], r["resumes_per_s"],
                   r["replayed"]] for r in stage["aggregate"]])
    out += ["", f"3 replicas / 1: {stage['scaling_3_vs_1']}x (each resume routed to the node "
            "Stat names as holding its window; the replicas share this machine's cores, so "
            "this is not a fleet's scaling across machines).", ""]
    out += _routing(stage)
    run = stage.get("run")  # the stage's own run, merged beside the others' figures
    if run:
        out += [f"This stage's run: commit {run['git_commit']}, {run['date_utc']}, load "
                f"average {run['load_average_at_start'][0]} at its start and "
                f"{run['load_average_at_end'][0]} at its end on {stage['cpus']} cores (other "
                "work shared the machine: compare the paths within the run).", ""]
    return out


def _parts_clause(fid: dict, row: dict) -> str:
    p = fid.get("parts", {}).get("per_context", {}).get(_cell(row))
    if not p:
        return ""
    return (f"; R=0 {p['r0_vs_r128']:+.1%} of the bits/byte beside it, window-only "
            f"{p['window_only_vs_r128']:+.1%}")


def headlines(stages: dict) -> list[str]:
    out = ["## Headlines", ""]
    res = stages.get("resume")
    if _ok(res):
        for row in res["contexts"]:
            p = row["paths"]
            out.append(f"- {row['context']} tokens: disk resume {_ms(p['disk']['seconds'])} vs "
                       f"re-prefill {_ms(p['prefill']['seconds'])} "
                       f"(**{p['disk']['speedup_vs_prefill']:.0f}x**"
                       + (f", via the gRPC server {p['disk-grpc']['speedup_vs_prefill']:.0f}x"
                          if "seconds" in p.get("disk-grpc", {}) else "") + "); host "
                       f"{p['host']['speedup_vs_prefill']:.0f}x, object "
                       f"{p['object']['speedup_vs_prefill']:.0f}x, naive torch.load "
                       f"{p['naive']['speedup_vs_prefill']:.0f}x at "
                       f"{p['naive']['stored_bytes_per_token']:.0f} B/token.")
    fid = stages.get("fidelity")
    if _ok(fid):
        r = fid["goal"]["replay_tokens"]
        for row in fid["contexts"]:
            v = row["variants"].get(f"R={r}")
            if v:
                met = fid["goal"]["met_per_context"].get(_cell(row))
                where = _cell(row) if "kind" in row else f"context {row['context']}"
                out.append(f"- Fidelity at R={r}, {where}: top-1 "
                           f"{v['top1_agreement']:.4f}, bits/byte {v['bpb_rel_diff']:+.3%}, "
                           f"KL {v['kl_nats']:.1e} nats (goal {'met' if met else 'NOT met'})"
                           + _parts_clause(fid, row) + ".")
    byt = stages.get("bytes")
    if _ok(byt):
        per = byt["bytes_per_token"]
        out.append(f"- Disk holds {per['disk_total']:.1f} B/token (spec {per['spec']:.0f}, "
                   f"bf16 baseline {per['bf16_baseline']:.0f}: "
                   f"{byt['bf16_vs_disk']:.0f}x smaller).")
    tr = stages.get("trace")
    if _ok(tr):
        fractions = sorted({r["capacity_fraction"] for r in tr["results"]})
        for fraction in dict.fromkeys((fractions[0], fractions[len(fractions) // 2])):
            rates = ", ".join(f"{r['policy']} {r['reuse_fast_value']:.3f}"
                              for r in tr["results"] if r["capacity_fraction"] == fraction)
            out.append(f"- Trace, hbm at {fraction:g} of the footprint (host "
                       f"{tr['tiers']['host_ratio']:g}x that): hbm + host hit rate among "
                       f"re-reads, windows weighed as replays: {rates}.")
        out.append("  (`kvtier` is the project's policy with the hints kvtier infers from "
                   "past requests alone; `hint` is given each session's true next gap with "
                   "noise, an oracle-derived estimate, and `kvtier-hint` is kvtier's policy "
                   "given those; `hint-causal` HintPolicy with inferred hints; `belady` is "
                   "the offline optimum. See the method notes in `bench/trace/run.py`.)")
    fa = stages.get("faults")
    if _ok(fa):
        cases = fa["enospc"] + fa["eio"]
        out.append(f"- Faults: {fa['acked_lost']} of {fa['acked_durable']} durable acks lost "
                   f"over {fa['images']} power-loss images; {fa['summary']['cases_recovered']}"
                   f"/{len(cases)} ENOSPC/EIO cases recovered; repair bit-exact: "
                   f"{fa['summary']['repair_bit_exact']}.")
    vl = stages.get("vllm")
    if _ok(vl) and "goal" in vl:
        goals = [g for k, g in vl["goal"].items() if k != "all_met"]
        out.append(f"- vLLM connector, {vl['headline_case']}: kvtier host-RAM hit "
                   f"{_times(vl['host_hit_vs_example_hit'])} the ExampleConnector hit, miss "
                   f"with the connector {_times(vl['miss_connector_vs_miss'])} the miss "
                   f"without, load {_times(vl['load_vs_memcpy'])} memcpy; goals met "
                   f"{sum(g['met'] is True for g in goals)} of {len(goals)} "
                   f"({sum(g['met'] is None for g in goals)} not measured).")
    sg = stages.get("sglang")
    if _ok(sg):
        small = "".join(f"; at {c['page_size']}-token pages ({c['page_bytes'] >> 10} KiB) get "
                        f"{_times(c['get_vs_hicache_file'])}, set "
                        f"{_times(c['set_vs_hicache_file'])}"
                        for c in sg.get("small_pages", []))
        out.append(f"- SGLang HiCache storage: kvtier get {sg['kvtier_get_GBps']:.2f} GB/s, "
                   f"set {sg['kvtier_set_GBps']:.2f} GB/s through SGLang's host pool at "
                   f"{sg['page_size']}-token pages, {_times(sg['get_vs_hicache_file'])} and "
                   f"{_times(sg['set_vs_hicache_file'])} SGLang's HiCacheFile{small}.")
    return out + [""]


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def hf_section(stage: dict) -> list[str]:
    if "contexts" not in stage:  # bench.hf --parts llama
        return llama_int4_section(stage["llama_test"]) + [""]
    out = ["## transformers DeepseekV4 (`python -m bench.hf`)", "",
           f"{stage['model']}: {stage['parameters']:,} parameters, layout {stage['layout']} "
           f"(entries at {stage['bits']} bits), spilled and resumed through a real server "
           f"with `kvtier.integrations.transformers`, the server's replay running the same "
           f"model. Fidelity over the next {stage['follow_tokens']} tokens (the never-evicted "
           "model's greedy continuation, teacher-forced) against the never-evicted cache; "
           "R = 0: no replay, zero window. Random weights give flat next-token distributions, "
           "so top-1 agreement flips on tiny logit changes: read KL first. The run's first resume "
           "(the first context, R = 128) includes the server loading its model.", ""]
    rows = []
    for n, row in stage["contexts"].items():
        for r, f in row["replays"].items():
            ready = (f"{_ms(f['ready_seconds'])} ({f['speedup_vs_prefill']:.1f}x)"
                     if "ready_seconds" in f else "-")
            rows.append([n, r, f"{f['kl_nats']:.4f}", f"{f['top1_agreement']:.2f}",
                         f["greedy_match_tokens"], ready])
    out += table(["tokens", "R", "KL (nats)", "top-1", "greedy match", "ready (vs prefill)"],
                 rows)
    out += [""] + [f"{n} tokens: persisted {row['persisted_bytes_per_token']:.1f} B/token, "
                   f"the model's own cache at bf16 {row['bf16_bytes_per_token']:.1f} B/token "
                   f"({row['persisted_vs_bf16']:.1f}x); re-prefill "
                   f"{_ms(row['prefill_seconds'])}." for n, row in stage["contexts"].items()]
    if "llama_test" in stage:
        out += [""] + llama_int4_section(stage["llama_test"])
    if "sliding_replay" in stage:
        out += [""] + sliding_replay_section(stage["sliding_replay"])
    return out + [""]


def _kl(value: float) -> str:
    """A mean KL; below 1e-8 (negative too: float noise around 0) it is noise."""
    return "< 1e-8" if value < 1e-8 else f"{value:.1e}"


def sliding_replay_section(stage: dict) -> list[str]:
    """bench.hf's ``sliding_replay``: bounded replay of sliding layers per architecture."""
    out = ["## transformers sliding layers: bounded replay per architecture "
           "(`python -m bench.hf --json`, `sliding_replay`)", "",
           f"`window=\"replay\"`: full layers kept, sliding layers rebuilt from the last R "
           f"tokens. The {stage['model']}, loaded unchanged into each architecture; "
           f"{stage['held_out_stretches']} held-out stretches, {stage['context_tokens']:,}-byte "
           f"context, the next {stage['follow_tokens']} bytes teacher-forced, against the "
           "never-evicted cache.", ""]
    rows = []
    for name, arch in stage.items():
        if not isinstance(arch, dict):
            continue
        layers = ", ".join(arch["layers"])
        for r, f in arch["by_R"].items():
            default = " (W - 1, the default)" if int(r) == arch["R"] else ""
            rows.append([f"{name} ({layers}), W = {arch['W']}", f"{r}{default}",
                         f"{f['top1_agreement']:.4f}", _kl(f["kl_nats"])])
    return out + table(["architecture (layers)", "R", "top-1 agreement", "KL (nats)"], rows)


def llama_int4_section(stage: dict) -> list[str]:
    """bench.hf's ``llama_test``: int4 engine K/V judged on the trained Llama test model."""
    goal = {"kl": 1e-3, "top1": 0.99, "bytes": 0.3}
    kl, top1, size = stage["int4_kl"], stage["int4_top1"], stage["int4_bytes_vs_bf16"]
    out = ["## int4 engine K/V on the trained Llama test model "
           "(`python -m bench.hf --json`, `llama_test`)", "",
           f"{stage['model']}, {stage['held_out_stretches']} stretches of held-out text: "
           f"prefill {stage['context_tokens']:,} bytes, spill that cache through a real "
           "server at bf16 and at `bits=4` (`kvtier.integrations.transformers`), resume the "
           f"int4 one, teacher-force the next {stage['follow_tokens']} held-out bytes from "
           "both caches. The format: per token and head, groups of 32 channels with one fp16 "
           "scale, symmetric (docs/wire-format.md \"int4 K/V of an engine\"); vLLM stores the "
           "same with `value_format` `int4`.", ""]
    def met(ok: bool) -> str:
        return "met" if ok else "not met"
    out += table(["", "goal", "measured"], [
        ["`int4_kl` (mean KL(bf16 \\|\\| int4), nats)", "<= 1e-3",
         f"{kl:.1e}: {met(kl <= goal['kl'])}"],
        ["`int4_top1`", ">= 0.99", f"{top1:.4f}: {met(top1 >= goal['top1'])}"],
        ["`int4_bytes_vs_bf16` (bytes the spills sent)", "<= 0.3x",
         f"{size:.3f}x: {met(size <= goal['bytes'])}"]])
    out += ["", "Other 4-bit arrangements of the same caches, fake-quantized in the same run "
            "(`variants`; bytes per value against bf16's 2):", ""]
    out += table(["arrangement", "KL (nats)", "top-1", "bytes vs bf16"], [
        [name, f"{v['kl_nats']:.1e}", f"{v['top1_agreement']:.4f}",
         f"{v['bytes_vs_bf16']:.3f}x"] for name, v in stage["variants"].items()])
    return out


def separately(stage: dict) -> list[str]:
    """The note under a stage rerun on its own (``bench.all --merge``)."""
    r = stage.get("recorded_separately")
    if not r:
        return []
    return [f"This section was rerun on its own (`bench.all --merge`): commit {r['git_commit']}, "
            f"model weights {r['weights_commit'] or 'not committed'}, {r['date_utc']}, sizes "
            f"{r['sizes']}, {r['torch_threads']} torch thread(s), load average "
            f"{_load(r['load_average_at_start'])} at start / {_load(r['load_average_at_end'])} "
            "at end; the machine table above is the full run's.", ""]


def write_report(results: dict, out_dir: Path) -> Path:
    """Write REPORT.md and the PNGs into ``out_dir``; returns the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stages = results["stages"]
    lines = ["# kvtier benchmark report", "",
             "Produced by `make bench` (`python -m bench.all`); raw figures in "
             "[results.json](results.json). Each benchmark's module docstring says how each "
             "figure is obtained. Ratios are measured side by side in one run; absolute "
             "times are this machine's, which was shared with other work (see load average).",
             ""]
    lines += headlines(stages) + machine_section(results)
    sections = (("resume", resume_section, plot_resume, "resume_time.png"),
                ("fidelity", fidelity_section, plot_fidelity, "fidelity.png"),
                ("trace", trace_section, plot_trace, "trace_hit_rate.png"),
                ("bytes", bytes_section, None, None),
                ("replay_batch", replay_batch_section, None, None),
                ("fuzz", fuzz_section, None, None),
                ("adversarial", adversarial_section, None, None),
                ("faults", faults_section, None, None),
                ("fleet", fleet_section, None, None),
                ("hf", hf_section, None, None),
                ("seams", seams_section, None, None),
                ("vllm", vllm_section, None, None),
                ("sglang", sglang_section, None, None))
    for name, section, plot, png in sections:
        stage = stages.get(name)
        if not _ok(stage):
            lines += [f"## {name}", ""] + _problem(name, stage)
            continue
        if plot is not None:
            plot(stage, out_dir / png)
        lines += section(stage) + separately(stage)
    lines += codec_tiers_section(stages.get("codec"), stages.get("tiers"))
    lines += peers.section()
    walls = ", ".join(f"{n} {s['wall_s']} s" for n, s in stages.items())
    lines += [f"Wall time per stage: {walls}.", ""]
    report = out_dir / "REPORT.md"
    report.write_text("\n".join(lines))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results.json")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    args = parser.parse_args(argv)
    print(write_report(json.loads(args.results.read_text()), args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
