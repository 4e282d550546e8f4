"""``kvtier generate``: the bundled model as an inference worker that keeps its sessions in
kvtier.

    kvtier generate --session s1 --prompt "def parse(" [--server HOST:PORT] [--data-dir DIR]

Each run resumes the session (Resume: restore, plus bounded replay when the window was
dropped), runs the prompt's bytes through the model, decodes greedily, prints the
continuation on stdout and spills the session back (durably) before it exits; a later
run with the same session continues from there. Without ``--server`` an embedded server
runs in this process on a temporary port over ``--data-dir`` (default ./data), so
sessions outlive the process on its disk tier; its windows live in RAM only, so the next
run rebuilds the window by replay. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvstore.format.errors import KVTierError, LayoutMismatch, SessionNotFound
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import register_layout
from kvtier.client import AsyncClient
from model.config import BUNDLED, ModelConfig, layout_spec
from model.infer import decode_step, prefill
from model.net import KVTierLM
from model.state import KVState
from replay.state_codec import state_from_chunks, state_to_chunks
from replay.worker import ReplayWorker
from services.cli.address import add_credential_arguments, client_options, server_from_env
from services.server.config_load import load_config


def model_layout(cfg: ModelConfig) -> LayoutSpec:
    """The layout a model's sessions are stored under (registered in this process):
    "kvtier-bundled" for the bundled config, a name derived from the config otherwise."""
    if cfg == BUNDLED:
        return layout_spec(cfg)
    digest = xxhash.xxh3_64_hexdigest(cfg.to_json().encode())[:8]
    return register_layout(layout_spec(cfg, name=f"kvtier-custom-{digest}"))


def load_model(weights: Path | None) -> KVTierLM:
    from model.checkpoint import BUNDLED_WEIGHTS, load

    return load(weights or BUNDLED_WEIGHTS)


@contextlib.asynccontextmanager
async def embedded_server(data_dir: Path, model: KVTierLM, **overrides
                          ) -> AsyncIterator[str]:
    """A kvtier server on a free loopback port over ``data_dir``, replaying windows with
    ``model`` in this process (no second copy of the weights); yields its address."""
    from services.server.server import create_server

    config = load_config(preset="embedded", overrides={
        "listen": "127.0.0.1:0", "data_dir": data_dir, "metrics_port": 0, "replay": "off",
        **overrides})
    server, port = await create_server(config)
    # the config's in-process backend would load the weights a second time
    server.servicer.use_replay(ReplayWorker(model), frozenset({model_layout(model.cfg).replayer}))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()


@dataclass
class Resumed:
    state: KVState | None  # None: a new session
    generation: int
    tier: str = ""
    replayed: bool = False
    replay_tokens: int = 0
    seconds: float = 0.0  # call to ready-to-decode state, decoding included
    replay_seconds: float = 0.0  # the server's rebuild of the window, part of seconds


async def resume_state(kv: AsyncClient, tenant: str, session_id: str, model: KVTierLM,
                       spec: LayoutSpec, replay_tokens: int = 0) -> Resumed:
    """The session's state, ready to decode (window held or replayed), or a new one."""
    started = time.perf_counter()
    try:
        got = await kv.resume(tenant, session_id, replay_tokens=replay_tokens, decode=False)
    except SessionNotFound:
        return Resumed(None, 0)
    if got.layout.layout_id != spec.layout_id:
        raise LayoutMismatch(f"session {tenant}/{session_id} is stored under "
                             f"{got.layout.layout_id}, this model writes {spec.layout_id}")
    state = await asyncio.to_thread(state_from_chunks, model.cfg, got.token_ids, got.chunks,
                                    got.tail, got.window_blob, spec=spec)
    return Resumed(state, got.generation, got.tier, got.replayed, got.replay_tokens,
                   time.perf_counter() - started, got.replay_seconds)


async def spill_state(kv: AsyncClient, tenant: str, session_id: str, spec: LayoutSpec,
                      state: KVState, generation: int, ack: str = "durable"):
    chunks, tail, window = await asyncio.to_thread(state_to_chunks, spec, state)
    return await kv.spill(tenant, session_id, spec.layout_id, state.token_ids,
                          chunks=[c for _, c in chunks], tail=tail, window=window,
                          generation=generation, ack=ack)


@torch.no_grad()
def continue_greedy(model: KVTierLM, state: KVState | None, prompt: bytes, new_tokens: int
                    ) -> tuple[KVState, list[int]]:
    """Run the prompt after ``state`` (None: a new session), then ``new_tokens`` greedy
    tokens; the state ends holding all of them. Returns (state, generated ids)."""
    state, logits = prefill(model, list(prompt), state)
    out = []
    for _ in range(new_tokens):
        token = int(torch.argmax(logits))
        out.append(token)
        logits = decode_step(model, state, token)
    return state, out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--session", required=True, help="session id")
    parser.add_argument("--prompt", required=True, help="text to append to the session")
    parser.add_argument("--tenant", default="default")
    parser.add_argument("--server", metavar="HOST:PORT", default=server_from_env(),
                        help="kvtier server address (default: $KVTIER_SERVER, else an "
                             "embedded server on --data-dir)")
    parser.add_argument("--data-dir", type=Path, default=Path("data"),
                        help="data directory of the embedded server (default ./data)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--replay-tokens", type=int, default=0,
                        help="R for a window rebuild (0: the server's default)")
    parser.add_argument("--weights", type=Path, help="model weights (default: bundled)")
    add_credential_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0 or args.replay_tokens < 0:
        print("kvtier generate: --max-new-tokens and --replay-tokens must be >= 0",
              file=sys.stderr)
        return 2
    try:
        model = load_model(args.weights)
        return asyncio.run(_generate(args, model))
    except (FileNotFoundError, ValueError, KVTierError) as exc:
        print(f"kvtier generate: {exc}", file=sys.stderr)
        return 1


async def _generate(args: argparse.Namespace, model: KVTierLM) -> int:
    async with contextlib.AsyncExitStack() as stack:
        address = args.server or await stack.enter_async_context(
            embedded_server(args.data_dir, model))
        kv = await stack.enter_async_context(
            AsyncClient(address, **client_options(args)) if args.server
            else AsyncClient(address))
        await _turn(args, model, kv)
    return 0


async def _turn(args: argparse.Namespace, model: KVTierLM, kv: AsyncClient) -> None:
    spec = model_layout(model.cfg)
    resumed = await resume_state(kv, args.tenant, args.session, model, spec,
                                 args.replay_tokens)
    if resumed.state is None:
        say(f"new session {args.tenant}/{args.session}")
    else:
        how = (f"window rebuilt by replaying {resumed.replay_tokens} tokens"
               if resumed.replayed else "window held")
        source = f" from {resumed.tier}" if resumed.tier else ""  # "": no full chunk yet
        say(f"resumed {args.tenant}/{args.session}: {resumed.state.n_tokens} tokens{source}, "
            f"{how}, ready in {resumed.seconds:.3f}s")
    started = time.perf_counter()
    state, generated = await asyncio.to_thread(continue_greedy, model, resumed.state,
                                               args.prompt.encode(), args.max_new_tokens)
    sys.stdout.write(bytes(generated).decode("utf-8", errors="replace") + "\n")
    sys.stdout.flush()
    result = await spill_state(kv, args.tenant, args.session, spec, state,
                               resumed.generation + 1)
    say(f"{len(generated)} tokens in {time.perf_counter() - started:.2f}s; spilled "
        f"{state.n_tokens} tokens as generation {result.generation} "
        f"({result.chunks_written} chunks written, {result.chunks_deduped} already held)")


def say(line: str) -> None:
    print(f"[kvtier] {line}", file=sys.stderr, flush=True)
