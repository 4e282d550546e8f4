"""``kvtier demo``: an agent-like scenario against an embedded server, through the client.

Several sessions read long contexts of held-out text (stdlib packages the model never
trained on, ``model.data.HELD_OUT``), one turn each, spilled after every turn. The host
tier is too small for all of them, so the earlier sessions are pushed down to disk, and
disk holds no window KV. After a pause every session resumes (through ``Resume``: the
window comes back from RAM, or is rebuilt by bounded replay), reads its next tokens and
is spilled again; then a second round. One row per resume:

  tier       lowest tier the session's blocks came from
  replayed   whether its window was rebuilt by replay (else it was still held in RAM)
  ready      Resume call until a model state ready to decode (restore + replay + decode)
  replay     the part of it spent rebuilding the window
  prefill    a full re-prefill of the same context, the alternative to kvtier, timed now
  top1       next-token agreement with a run that was never evicted: argmax on each of
             the next N tokens of text (both runs read the same text)
  greedy     share of the next N greedily generated tokens equal to that run's

``--json`` prints ``resumes``, ``replayed``, ``median_speedup_vs_prefill``,
``top1_agreement`` (mean of the rows) and the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.format.errors import KVTierError
from kvstore.format.hints import ResumeHint
from kvstore.format.layout import LayoutSpec
from kvtier.client import AsyncClient
from model.data import corpus
from model.infer import decode_step, prefill
from model.net import KVTierLM
from model.state import KVState
from replay.state_codec import state_to_chunks
from services.cli.generate import embedded_server, load_model, model_layout, resume_state

TENANT = "demo"


@dataclass
class Row:
    session: str
    round: int
    tokens: int  # context length at the resume
    tier: str
    replayed: bool
    replay_tokens: int
    ready_s: float
    replay_s: float  # the window's rebuild, part of ready_s
    prefill_s: float
    top1: float
    greedy: float

    @property
    def speedup(self) -> float:
        return self.prefill_s / self.ready_s if self.ready_s else float("inf")


@dataclass
class Session:
    name: str
    text: bytes  # the whole context this session will read, turn by turn
    read: int  # bytes of text read so far
    reference: KVState  # the same session in a process that never evicted it
    generation: int = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=2048,
                        help="tokens each session reads before its first pause")
    parser.add_argument("--next-tokens", type=int, default=32,
                        help="N: tokens read after each resume (and compared)")
    parser.add_argument("--rounds", type=int, default=2, help="resumes per session")
    parser.add_argument("--pause-s", type=float, default=0.5, help="pause between turns")
    parser.add_argument("--host-bytes", default="768KiB",
                        help="host RAM tier capacity: small, so sessions reach disk")
    parser.add_argument("--replay-tokens", type=int, default=128, help="R")
    parser.add_argument("--data-dir", type=Path,
                        help="keep the server's data here (default: a temporary dir)")
    parser.add_argument("--weights", type=Path, help="model weights (default: bundled)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steady timings on a shared machine)")


def run(args: argparse.Namespace) -> int:
    if min(args.sessions, args.context_tokens, args.next_tokens, args.rounds) < 1:
        print("kvtier demo: counts must be >= 1", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        model = load_model(args.weights)
        with contextlib.ExitStack() as stack:
            data_dir = args.data_dir or Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="kvtier-demo-")))
            rows = asyncio.run(scenario(args, model, data_dir))
    except (FileNotFoundError, ValueError, KVTierError) as exc:
        print(f"kvtier demo: {exc}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)
    report = summary(rows)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(rows, report)
    return 0


def say(args: argparse.Namespace, line: str) -> None:
    if not args.json:
        print(line, file=sys.stderr, flush=True)


async def scenario(args: argparse.Namespace, model: KVTierLM, data_dir: Path) -> list[Row]:
    spec = model_layout(model.cfg)
    texts = held_out_texts(args.sessions, args.context_tokens + args.rounds * args.next_tokens)
    async with (embedded_server(data_dir, model, host_bytes=args.host_bytes,
                                replay_tokens=args.replay_tokens) as address,
                AsyncClient(address) as kv):
        say(args, f"server on {address} (data in {data_dir}, host tier {args.host_bytes}); "
            f"{args.sessions} sessions of {args.context_tokens} held-out tokens")
        sessions = []
        for i, text in enumerate(texts):
            name = f"agent-{i}"
            state, _ = await compute(prefill, model, list(text[:args.context_tokens]))
            await spill(kv, spec, name, state, 1, args.pause_s)
            sessions.append(Session(name, text, args.context_tokens, branch(state)))
            say(args, f"  {name}: read {args.context_tokens} tokens, spilled")
        rows = []
        for round_ in range(1, args.rounds + 1):
            say(args, f"pause {args.pause_s}s (tool calls), then round {round_} of resumes")
            await asyncio.sleep(args.pause_s)
            # agents come back in their own order: the last to pause first, then mixed
            order = (sessions[::-1] if round_ == 1
                     else random.Random(round_).sample(sessions, len(sessions)))
            for s in order:
                rows.append(await resume_turn(args, model, kv, spec, s, round_))
                r = rows[-1]
                say(args, f"  {s.name}: from {r.tier}, "
                    f"{'replayed' if r.replayed else 'window held'}, ready {r.ready_s:.3f}s "
                    f"vs prefill {r.prefill_s:.2f}s, top1 {r.top1:.3f}")
    return rows


async def resume_turn(args: argparse.Namespace, model: KVTierLM, kv: AsyncClient,
                      spec: LayoutSpec, s: Session, round_: int) -> Row:
    resumed = await resume_state(kv, TENANT, s.name, model, spec, args.replay_tokens)
    if resumed.state is None:
        raise KVTierError(f"session {s.name} was lost")
    state = resumed.state
    context = s.text[:s.read]
    started = time.perf_counter()
    await compute(prefill, model, list(context), None, "none")
    prefill_s = time.perf_counter() - started
    following = list(s.text[s.read:s.read + args.next_tokens])
    top1, greedy = await compute(agreement, model, state, s.reference, following,
                                 args.next_tokens)
    s.read += args.next_tokens
    s.generation += 1
    await spill(kv, spec, s.name, state, s.generation, args.pause_s)
    return Row(s.name, round_, len(context), resumed.tier, resumed.replayed,
               resumed.replay_tokens, resumed.seconds, resumed.replay_seconds, prefill_s,
               top1, greedy)


async def spill(kv: AsyncClient, spec: LayoutSpec, name: str, state: KVState,
                generation: int, pause_s: float) -> None:
    chunks, tail, window = await asyncio.to_thread(state_to_chunks, spec, state)
    await kv.spill(TENANT, name, spec.layout_id, state.token_ids,
                   chunks=[c for _, c in chunks], tail=tail, window=window,
                   generation=generation, hint=ResumeHint(expected_pause_s=pause_s))


async def compute(fn, *args):
    """Model work off the event loop (the embedded server shares it)."""
    return await asyncio.to_thread(fn, *args)


def branch(state: KVState) -> KVState:
    """An independent continuation of a state: the model replaces a state's tensors
    rather than writing into them, so a shallow copy is enough."""
    return dataclasses.replace(state)


@torch.no_grad()
def agreement(model: KVTierLM, state: KVState, reference: KVState, tokens: list[int],
              greedy_tokens: int) -> tuple[float, float]:
    """Both states read ``tokens`` (in place). Returns (share of those positions whose
    argmax agree, share of the next ``greedy_tokens`` greedy tokens that are the same,
    generated on copies so the sessions do not keep them)."""
    got = prefill(model, tokens, state, logits="all")[1]
    want = prefill(model, tokens, reference, logits="all")[1]
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())

    def greedy(st: KVState, logits: torch.Tensor) -> list[int]:
        st, out = branch(st), []
        for _ in range(greedy_tokens):
            out.append(int(torch.argmax(logits)))
            logits = decode_step(model, st, out[-1])
        return out

    same = sum(a == b for a, b in zip(greedy(state, got[-1]), greedy(reference, want[-1]),
                                      strict=True))
    return top1, same / greedy_tokens


def held_out_texts(count: int, length: int) -> list[bytes]:
    """``count`` disjoint stretches of held-out text, ``length`` bytes each."""
    data = corpus(held_out=True)
    stride = len(data) // count
    if stride < length:
        raise ValueError(f"the held-out text ({len(data)} B) is too short for {count} "
                         f"sessions of {length} tokens")
    return [data[i * stride:i * stride + length] for i in range(count)]


def summary(rows: list[Row]) -> dict:
    return {
        "resumes": len(rows),
        "replayed": sum(r.replayed for r in rows),
        "median_speedup_vs_prefill": statistics.median(r.speedup for r in rows),
        "top1_agreement": statistics.fmean(r.top1 for r in rows),
        "rows": [{**dataclasses.asdict(r), "speedup": r.speedup} for r in rows],
    }


def print_table(rows: list[Row], report: dict) -> None:
    head = (f"{'session':<9} {'round':>5} {'tokens':>6} {'tier':<6} {'replayed':<8} "
            f"{'ready':>9} {'replay':>9} {'prefill':>9} {'speedup':>8} {'top1':>6} "
            f"{'greedy':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.session:<9} {r.round:>5} {r.tokens:>6} {r.tier:<6} "
              f"{'R=' + str(r.replay_tokens) if r.replayed else 'no':<8} "
              f"{r.ready_s * 1000:>7.1f}ms {r.replay_s * 1000:>7.1f}ms "
              f"{r.prefill_s * 1000:>7.0f}ms {r.speedup:>7.1f}x "
              f"{r.top1:>6.3f} {r.greedy:>6.3f}")
    print(f"\n{report['resumes']} resumes, {report['replayed']} replayed; median speedup vs "
          f"full re-prefill {report['median_speedup_vs_prefill']:.1f}x; top-1 agreement "
          f"with a never-evicted run {report['top1_agreement']:.3f}")
