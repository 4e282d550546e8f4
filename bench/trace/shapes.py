"""Workload generators: request traces of the shapes agent and chat serving makes.

Each generator returns ``TraceRequest``s exactly as ``bench.trace.reader`` reads a
Mooncake trace: arrival order, ``hash_ids`` naming 512-token prefix blocks (an id stands
for its whole prefix, so two contexts share an id only where they share the prefix up
to it), the last id the partial tail block. Every shape is a function of its parameters
(the dataclass below it, with the defaults the benchmark runs) and one seed; ``scale``
multiplies the session count, so a smaller run keeps the shape.

- ``chat``: multi-turn chat; each conversation opens with one of a few shared system
  prompts (Zipf popularity); think times between turns, and some users come back after
  the session's TTL.
- ``agent``: tool loops; a shared tool schema, then steps that append tool results; most
  pauses are a model call (seconds), some a long tool wait (minutes to half an hour);
  contexts grow up to 128k tokens.
- ``forks``: tree search and speculative agents; a root prompt, then each node forks
  into several children that extend it, explored breadth-first.
- ``mix``: many short sessions (one to three turns, a few blocks) and a few long ones
  (dozens of turns, contexts of tens of thousands of tokens).
- ``bursts``: idle hours, then bursts in which many earlier users come back at once.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from bench.trace.reader import BLOCK_TOKENS, TraceRequest
from kvstore.format.errors import InvalidRequest


class _Ids:
    """Block ids: a fresh one for every new prefix."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def new(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


class _Context:
    """One growing context: its complete blocks' ids (stable) and its token count."""

    def __init__(self, ids: _Ids, prefix: list[int], prefix_tokens: int) -> None:
        self.ids, self.blocks, self.tokens = ids, list(prefix), prefix_tokens

    def grow(self, tokens: int) -> None:
        self.tokens += tokens
        complete = self.tokens // BLOCK_TOKENS
        if complete > len(self.blocks):
            self.blocks += self.ids.new(complete - len(self.blocks))

    def fork(self) -> _Context:
        return _Context(self.ids, self.blocks, self.tokens)

    def request(self, t_s: float, output: int) -> TraceRequest:
        tail = self.ids.new(1) if self.tokens % BLOCK_TOKENS else []
        return TraceRequest(round(t_s * 1000.0, 3), self.tokens, output,
                            tuple(self.blocks + tail))


def _prompt(ids: _Ids, blocks: int) -> tuple[list[int], int]:
    """A shared prompt of ``blocks`` complete blocks: its ids and tokens."""
    return ids.new(blocks), blocks * BLOCK_TOKENS


def _sorted(requests: list[tuple[float, int, TraceRequest]]) -> list[TraceRequest]:
    """Arrival order (ties: generation order, so a parent precedes its child)."""
    return [r for _, _, r in sorted(requests, key=lambda x: (x[0], x[1]))]


def _zipf(rng: random.Random, n: int, s: float) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


@dataclass(frozen=True)
class Chat:
    sessions: int = 600
    span_s: float = 4 * 3600.0  # conversations start uniformly over this
    system_prompts: int = 6
    prompt_blocks: tuple[int, int] = (2, 12)  # 1k-6k tokens each
    zipf_s: float = 1.0
    mean_turns: float = 6.0  # geometric
    turn_tokens: tuple[int, int] = (80, 900)  # user message + the previous answer
    output_tokens: tuple[int, int] = (50, 600)
    think_s: float = 40.0  # median pause between turns (lognormal, sigma 1)
    return_p: float = 0.15  # a turn comes after a long break (10 min - 2 h)


def chat(p: Chat, rng: random.Random) -> list[TraceRequest]:
    ids = _Ids()
    prompts = [_prompt(ids, rng.randint(*p.prompt_blocks)) for _ in range(p.system_prompts)]
    out, order = [], itertools.count()
    for _ in range(p.sessions):
        ctx = _Context(ids, *prompts[_zipf(rng, p.system_prompts, p.zipf_s)])
        t = rng.uniform(0, p.span_s)
        turns = 1 + int(rng.expovariate(1 / (p.mean_turns - 1)))
        for _ in range(turns):
            ctx.grow(rng.randint(*p.turn_tokens))
            output = rng.randint(*p.output_tokens)
            out.append((t, next(order), ctx.request(t, output)))
            ctx.grow(output)
            t += (rng.uniform(600, 7200) if rng.random() < p.return_p
                  else rng.lognormvariate(math.log(p.think_s), 1.0))
    return _sorted(out)


@dataclass(frozen=True)
class Agent:
    sessions: int = 24
    span_s: float = 2 * 3600.0
    tool_schema_blocks: int = 8  # shared by every agent: 4k tokens
    task_tokens: tuple[int, int] = (2000, 16000)
    steps: tuple[int, int] = (10, 40)
    result_tokens: tuple[int, int] = (200, 8000)  # a tool result appended per step
    output_tokens: tuple[int, int] = (50, 400)
    max_context: int = 128 * 1024
    model_pause_s: float = 3.0  # median pause of a step that only calls the model
    tool_wait_p: float = 0.25  # a step waits on a slow tool
    tool_wait_s: tuple[float, float] = (60.0, 1800.0)  # log-uniform


def agent(p: Agent, rng: random.Random) -> list[TraceRequest]:
    ids = _Ids()
    schema = _prompt(ids, p.tool_schema_blocks)
    out, order = [], itertools.count()
    low, high = (math.log(x) for x in p.tool_wait_s)
    for _ in range(p.sessions):
        ctx = _Context(ids, *schema)
        ctx.grow(rng.randint(*p.task_tokens))
        t = rng.uniform(0, p.span_s)
        for _ in range(rng.randint(*p.steps)):
            output = rng.randint(*p.output_tokens)
            out.append((t, next(order), ctx.request(t, output)))
            ctx.grow(output + rng.randint(*p.result_tokens))
            if ctx.tokens >= p.max_context:
                break
            t += (math.exp(rng.uniform(low, high)) if rng.random() < p.tool_wait_p
                  else rng.lognormvariate(math.log(p.model_pause_s), 0.5))
    return _sorted(out)


@dataclass(frozen=True)
class Forks:
    trees: int = 60
    span_s: float = 3600.0
    root_tokens: tuple[int, int] = (2000, 12000)
    branching: tuple[int, int] = (2, 4)
    depth: int = 4
    step_tokens: tuple[int, int] = (100, 1500)  # what a child adds to its parent
    output_tokens: tuple[int, int] = (50, 500)
    node_s: float = 2.0  # median time to expand one node (lognormal, sigma 0.7)


def forks(p: Forks, rng: random.Random) -> list[TraceRequest]:
    ids = _Ids()
    out, order = [], itertools.count()
    for _ in range(p.trees):
        root = _Context(ids, [], 0)
        root.grow(rng.randint(*p.root_tokens))
        t = rng.uniform(0, p.span_s)
        level = [root]
        for depth in range(p.depth):
            children = []
            for node in level:
                output = rng.randint(*p.output_tokens)
                out.append((t, next(order), node.request(t, output)))
                t += rng.lognormvariate(math.log(p.node_s), 0.7)
                if depth + 1 < p.depth:
                    for _ in range(rng.randint(*p.branching)):
                        child = node.fork()
                        child.grow(output + rng.randint(*p.step_tokens))
                        children.append(child)
            # a search keeps its best few nodes per level (beam), not the whole frontier
            level = rng.sample(children, min(len(children), 2 * p.branching[1]))
    return _sorted(out)


@dataclass(frozen=True)
class Mix:
    short_sessions: int = 1500
    long_sessions: int = 12
    span_s: float = 2 * 3600.0
    system_prompt_blocks: int = 4
    short_turns: tuple[int, int] = (1, 3)
    short_tokens: tuple[int, int] = (200, 2500)
    long_turns: tuple[int, int] = (30, 60)
    long_turn_tokens: tuple[int, int] = (300, 2500)
    output_tokens: tuple[int, int] = (50, 500)
    pause_s: float = 30.0  # median (lognormal, sigma 1)


def mix(p: Mix, rng: random.Random) -> list[TraceRequest]:
    ids = _Ids()
    system = _prompt(ids, p.system_prompt_blocks)
    out, order = [], itertools.count()
    kinds = [(p.short_turns, p.short_tokens)] * p.short_sessions + [
        (p.long_turns, p.long_turn_tokens)] * p.long_sessions
    for turns, tokens in kinds:
        ctx = _Context(ids, *system)
        t = rng.uniform(0, p.span_s)
        for _ in range(rng.randint(*turns)):
            ctx.grow(rng.randint(*tokens))
            output = rng.randint(*p.output_tokens)
            out.append((t, next(order), ctx.request(t, output)))
            ctx.grow(output)
            t += rng.lognormvariate(math.log(p.pause_s), 1.0)
    return _sorted(out)


@dataclass(frozen=True)
class Bursts:
    users: int = 300
    bursts: int = 6
    idle_s: tuple[float, float] = (3600.0, 3 * 3600.0)  # between bursts
    burst_s: float = 300.0  # a burst's requests arrive within this
    active_p: float = 0.5  # a user takes part in a given burst
    system_prompt_blocks: int = 6
    turns: tuple[int, int] = (1, 4)  # per user per burst
    turn_tokens: tuple[int, int] = (100, 1200)
    output_tokens: tuple[int, int] = (50, 500)
    pause_s: float = 20.0  # median within a burst (lognormal, sigma 0.7)


def bursts(p: Bursts, rng: random.Random) -> list[TraceRequest]:
    ids = _Ids()
    system = _prompt(ids, p.system_prompt_blocks)
    users = [_Context(ids, *system) for _ in range(p.users)]
    out, order = [], itertools.count()
    start = 0.0
    for _ in range(p.bursts):
        for ctx in users:
            if rng.random() >= p.active_p:
                continue
            t = start + rng.uniform(0, p.burst_s)
            for _ in range(rng.randint(*p.turns)):
                ctx.grow(rng.randint(*p.turn_tokens))
                output = rng.randint(*p.output_tokens)
                out.append((t, next(order), ctx.request(t, output)))
                ctx.grow(output)
                t += rng.lognormvariate(math.log(p.pause_s), 0.7)
        start += p.burst_s + rng.uniform(*p.idle_s)
    return _sorted(out)


_Shape = tuple[Callable[..., list[TraceRequest]], type, str]
SHAPES: dict[str, _Shape] = {
    "chat": (chat, Chat, "sessions"),
    "agent": (agent, Agent, "sessions"),
    "forks": (forks, Forks, "trees"),
    "mix": (mix, Mix, "short_sessions"),
    "bursts": (bursts, Bursts, "users"),
}


def parameters(name: str, scale: float = 1.0) -> dict:
    """The stated parameters of shape ``name`` at ``scale`` (the count it multiplies)."""
    if name not in SHAPES:
        raise InvalidRequest(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    if not scale > 0:
        raise InvalidRequest(f"shape scale must be > 0, got {scale}")
    _, params, counted = SHAPES[name]
    values = asdict(params())
    values[counted] = max(1, round(values[counted] * scale))
    return values


def generate(name: str, *, scale: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """Shape ``name``'s requests, in arrival order (``parameters`` says what they are)."""
    values = parameters(name, scale)
    make, params, _ = SHAPES[name]
    return make(params(**values), random.Random(f"{name}/{seed}"))


def names() -> Iterator[str]:
    return iter(SHAPES)
