"""How close a resumed session's predictions stay to the never-evicted session's, per
replay length R, on text the bundled model never saw; measured in one run.

``python -m bench.fidelity --json [--contexts 1024,4096 --segments 16]
[--prose DIR ... --code DIR ...]``

For each kind of text (prose and source code, ``bench.held_out_text``: found on this
machine outside the training corpus, the interpreter's standard library; ``--prose`` and
``--code`` name other directories to draw from), each context length C and each of
``--segments`` stretches (each from another file), the model prefills C bytes: the
never-evicted session. Its state is encoded as the store keeps it
(``replay.state_codec.state_to_chunks``) and resumed as:

- ``exact``: the window kept exactly (decoded from the host tier's bytes, no replay);
- ``R=0``: the window dropped and not rebuilt (an empty window; the compressed global
  KV alone carries the past);
- ``R=128`` and ``R=<stated>``: the window rebuilt by the real replay worker
  (``replay.worker.ReplayWorker``) rerunning the last R tokens against the stored
  global KV; the stated R is the layout's ``replay_tokens``, the R at which it states
  fidelity holds (docs/wire-format.md section 1), which a Resume uses by default;
- ``window-only``: the global KV dropped: the session rebuilt from its last W tokens
  alone, as if it had begun there (what a store keeping only the window would give; the
  window path is relative in position, so only the missing past differs).

Then each, and the never-evicted session, reads the next ``--follow`` (256) bytes of
the same stretch teacher-forced (``model.infer.prefill`` with all logits). Over those
positions, pooled over segments: ``kl_nats`` = mean KL(never-evicted || resumed) of the
next-byte distributions, ``top1_agreement`` = share of positions whose argmax agree,
``bits_per_byte`` of the actual next bytes for the resumed session next to
``ref_bits_per_byte`` of the never-evicted one, ``bpb_rel_diff`` = their relative
difference, and ``kl_by_quarter`` (the mean KL over each quarter of the positions, to
show where after the resume the error sits).

Goals, for every kind and context (``goal``): at the stated R, top-1 agreement >= 0.999,
mean KL <= 1e-4 nats and bits/byte within 0.1% of the never-evicted session (``goal``
also says whether R = 128 meets them: ``met_at_128``); and the value of each part
(``parts``, ``part_values``): R = 0 worse than R = 128, and window-only worse than R = 0,
each by at least 1% of the never-evicted bits/byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from bench.held_out_text import KINDS, stretches
from bench.resume import (
    add_model_arguments,
    compare_logits,
    fork,
    model_from_args,
    spec_for,
)
from model.infer import prefill
from model.net import KVTierLM
from model.state import KVState
from replay.state_codec import state_from_chunks, state_to_chunks
from replay.worker import ReplayWorker

SHORT_R = 128  # the replay length the goal was first set at, measured beside the stated R
GOAL_TOP1, GOAL_KL, GOAL_BPB = 0.999, 1e-4, 0.001
CLEARLY_WORSE = 0.01  # of the never-evicted bits/byte, between R=128, R=0 and window-only
WINDOW_ONLY = "window-only"


def without_replay(state: KVState) -> KVState:
    """R = 0: a window-less state given an empty window (needs n % m == 0: no tail)."""
    if state.n_tokens % state.cfg.block:
        raise ValueError(f"R=0 needs a context that is a multiple of m={state.cfg.block}")
    empty = KVState.empty(state.cfg, state.token_ids.device)
    return KVState(state.cfg, state.token_ids, state.enc_latent, state.enc_index_keys,
                   state.dec_latent, empty.window_k, empty.window_v, empty.enc_tail,
                   empty.dec_tail)


async def resumed_states(worker: ReplayWorker, state: KVState, replays: tuple[int, ...]
                         ) -> dict[str, KVState]:
    """Every resume variant of ``state``, each built from the bytes the store keeps."""
    cfg = worker.model.cfg
    spec = spec_for(cfg)
    chunks, tail, window = state_to_chunks(spec, state)
    data = [c for _, c in chunks]
    ids = state.token_ids
    out = {"exact": state_from_chunks(cfg, ids, data, tail, window, spec=spec)}
    for r in replays:
        if r == 0:
            out["R=0"] = without_replay(state_from_chunks(cfg, ids, data, tail, None, spec=spec))
            continue
        rebuilt = (await worker.rebuild(spec, ids, data, tail, r)).window
        out[f"R={r}"] = state_from_chunks(cfg, ids, data, tail, rebuilt, spec=spec)
    out[WINDOW_ONLY] = prefill(worker.model, ids[-cfg.window:], logits="none")[0]
    return out


def bits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position bits of the actual next bytes: logits (T, vocab), targets (T,)."""
    return F.cross_entropy(logits.double(), targets, reduction="none") / math.log(2)


def kl_per_position(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    lr, lg = F.log_softmax(ref.double(), -1), F.log_softmax(got.double(), -1)
    return (lr.exp() * (lr - lg)).sum(-1)


async def segment_logits(model: KVTierLM, worker: ReplayWorker, ids: torch.Tensor, context: int,
                         replays: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Logits (follow, vocab) over ids[context:-1] for the reference and every variant."""
    state, _ = prefill(model, ids[:context], logits="none")
    follow = ids[context:-1]
    out = {"ref": prefill(model, follow, fork(state), logits="all")[1]}
    for name, resumed in (await resumed_states(worker, state, replays)).items():
        out[name] = prefill(model, follow, resumed, logits="all")[1]
    return out


def summarize(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    """Pooled figures of one variant; ref, got (positions, vocab); targets (positions,)."""
    kl = kl_per_position(ref, got)
    b_ref, b_got = bits(ref, targets).mean().item(), bits(got, targets).mean().item()
    return {"kl_nats": kl.mean().item(),
            "top1_agreement": compare_logits(ref, got)["top1_agreement"],
            "bits_per_byte": b_got, "ref_bits_per_byte": b_ref,
            "bpb_rel_diff": (b_got - b_ref) / b_ref,
            "kl_by_quarter": [q.mean().item() for q in kl.chunk(4)]}


def stated_replay_tokens(model: KVTierLM) -> int:
    """The R at which the model's layout states fidelity holds (``SHORT_R`` where it
    states none)."""
    return spec_for(model.cfg).replay_tokens or SHORT_R


async def run(model: KVTierLM, model_info: dict, contexts: list[int], *, segments: int = 4,
              follow: int = 256, replays: tuple[int, ...] | None = None,
              kinds: tuple[str, ...] = KINDS, roots: dict[str, list[Path]] | None = None,
              seed: int = 0) -> dict:
    """Every kind, context and variant (see the module docstring); ``replays`` default
    to 0, 128 and the stated R; ``roots`` (by kind) replace where the text is drawn
    from, ``seed`` which stretches are drawn; ``model_info`` says which weights ``model``
    has (``bench.resume.load_model``)."""
    stated = stated_replay_tokens(model)
    replays = replays if replays is not None else tuple(sorted({0, SHORT_R, stated}))
    worker = ReplayWorker(model)
    started = time.perf_counter()
    rows = []
    try:
        for kind in kinds:
            for context in contexts:
                rows.append(await _cell(model, worker, kind, context, segments, follow,
                                        replays, (roots or {}).get(kind), seed))
    finally:
        await worker.close()
    return {"benchmark": "fidelity", "model": model_info, "follow_tokens": follow,
            "segments": segments, "seed": seed, "replays": list(replays),
            "stated_replay_tokens": stated,
            "window": model.cfg.window, "torch_threads": torch.get_num_threads(),
            "load_average_1m": os.getloadavg()[0],
            "elapsed_s": round(time.perf_counter() - started, 1),
            "contexts": rows, "goal": goal(rows, stated), "parts": part_values(rows)}


async def _cell(model: KVTierLM, worker: ReplayWorker, kind: str, context: int,
                segments: int, follow: int, replays: tuple[int, ...],
                roots: list[Path] | None, seed: int) -> dict:
    """One kind of text at one context, pooled over its stretches."""
    per_variant: dict[str, list[torch.Tensor]] = {}
    targets, sources = [], []
    for where, text in stretches(kind, context + follow + 1, segments, seed=seed,
                                 roots=roots):
        ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        for name, logits in (await segment_logits(model, worker, ids, context,
                                                  replays)).items():
            per_variant.setdefault(name, []).append(logits)
        # the logits at ids[context + i] predict ids[context + i + 1]
        targets.append(ids[context + 1:])
        sources.append(where)
    ref, tgt = torch.cat(per_variant.pop("ref")), torch.cat(targets)
    return {"kind": kind, "context": context, "positions": int(tgt.numel()),
            "sources": sources,
            "variants": {name: summarize(ref, torch.cat(pieces), tgt)
                         for name, pieces in per_variant.items()}}


def cell_name(row: dict) -> str:
    return f"{row['kind']} {row['context']}"


def goal(rows: list[dict], replay_tokens: int) -> dict:
    """At ``replay_tokens`` (the stated R), for every kind and context: top-1 >= 0.999,
    KL <= 1e-4 nats and |bits/byte change| <= 0.1%; and the same at R = 128."""
    def met_at(r: int) -> dict[str, bool]:
        key = f"R={r}"
        return {cell_name(row): _meets(row["variants"][key]) for row in rows
                if key in row["variants"]}

    met, short = met_at(replay_tokens), met_at(SHORT_R)
    return {"replay_tokens": replay_tokens, "top1_at_least": GOAL_TOP1, "kl_at_most": GOAL_KL,
            "bpb_within": GOAL_BPB, "met_per_context": met,
            "met": bool(met) and all(met.values()), "met_at_128": short}


def _meets(v: dict) -> bool:
    return (v["top1_agreement"] >= GOAL_TOP1 and v["kl_nats"] <= GOAL_KL
            and abs(v["bpb_rel_diff"]) <= GOAL_BPB)


def part_values(rows: list[dict]) -> dict:
    """What the window and the global KV are each worth, per kind and context: the
    bits/byte R = 0 loses against R = 128 (the window dropped), and window-only against
    R = 0 (the global KV dropped too, the window kept), as shares of the never-evicted
    bits/byte."""
    key = f"R={SHORT_R}"
    per = {}
    for r in rows:
        v = r["variants"]
        if not {key, "R=0", WINDOW_ONLY} <= set(v):
            continue
        ref = v[key]["ref_bits_per_byte"]
        window = (v["R=0"]["bits_per_byte"] - v[key]["bits_per_byte"]) / ref
        global_kv = (v[WINDOW_ONLY]["bits_per_byte"] - v["R=0"]["bits_per_byte"]) / ref
        per[cell_name(r)] = {
            "r0_vs_r128": window, "window_only_vs_r0": global_kv,
            "window_only_vs_r128": window + global_kv,
            "ordered": window >= CLEARLY_WORSE and global_kv >= CLEARLY_WORSE}
    return {"clearly_worse_by": CLEARLY_WORSE, "per_context": per,
            "met": bool(per) and all(p["ordered"] for p in per.values())}


def format_table(result: dict) -> str:
    lines = [f"model: {result['model']}",
             f"{'text':<6} {'context':>8} {'variant':<11} {'KL nats':>10} {'top-1':>7} "
             f"{'bpb':>7} {'ref bpb':>8} {'bpb diff':>9}"]
    for row in result["contexts"]:
        for name, v in row["variants"].items():
            lines.append(f"{row['kind']:<6} {row['context']:>8} {name:<11} {v['kl_nats']:>10.2e} "
                         f"{v['top1_agreement']:>7.4f} {v['bits_per_byte']:>7.4f} "
                         f"{v['ref_bits_per_byte']:>8.4f} {v['bpb_rel_diff']:>+9.2%}")
    lines.append(f"goal: {result['goal']}")
    lines.append(f"parts: {result['parts']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--segments", type=int, default=16,
                        help="stretches per kind and context (pooled), each from another file")
    parser.add_argument("--follow", type=int, default=256, help="positions scored after resume")
    parser.add_argument("--seed", type=int, default=0, help="which stretches are drawn")
    parser.add_argument("--replays", default="",
                        help="replay lengths (default: 0, 128 and the layout's stated R)")
    for kind in KINDS:
        parser.add_argument(f"--{kind}", type=Path, action="append", default=None,
                            help=f"a directory to draw {kind} from instead of this "
                            "machine's defaults (repeatable)")
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(run(*model_from_args(args),
                             [int(x) for x in args.contexts.split(",") if x],
                             segments=args.segments, follow=args.follow,
                             replays=tuple(int(x) for x in args.replays.split(",") if x) or None,
                             roots={k: getattr(args, k) for k in KINDS if getattr(args, k)},
                             seed=args.seed))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
