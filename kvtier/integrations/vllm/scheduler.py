"""The connector's scheduler side (the engine core process): how much of a request's prefix
the store holds, and the per-step plans for the worker side.

Groups: every KV cache group of the model is kept as its kind needs (``layout.KINDS``),
each under its own layout. A full group is stored whole; a sliding-window group only as
the trailing window at its request's prompt end (``window_end``: the longest hit a repeat
of the prompt can have), which is what vLLM's ``SlidingWindowManager`` needs for a hit
there (the blocks below come as null blocks); a group the engine rebuilds
(``bounded_replay``, or no KV transfer) is never stored, and vLLM replays its window on a
hit (``window_replays``).

Matching: the store is asked (``Lookup``) for the longest held prefix of the request's
tokens of every full group, in whole blocks, never the whole sequence (the last token is
always computed, so vLLM has logits to sample from); with several tensor-parallel ranks,
the shortest of their layouts' prefixes. Each sliding group is then probed (one
``ReadChunks`` over the chunks below that prefix: only held windows come back) for the
longest end, at most that prefix and a multiple of every group's block, whose trailing
window it holds: the hit is the longest end every group holds. The lookup never blocks
a step for long: it runs on a background thread, waited for at most ``FIRST_ANSWER_S``
when asked, and until it answers the scheduler is told "ask again later" (None); one that
has not answered within ``lookup_timeout_ms``, or fails, is a miss, and counts against the
link's breaker.
While kvtier is down (``breaker.Link``) every lookup is a miss at once. The held blocks past
vLLM's own cache hit are loaded in the request's first step (``LoadPlan``).

Saving: each step, the blocks that will be full after it and that the store did not hold
are planned for saving (``SavePlan``), prompt and generated tokens alike; blocks the
worker could not save because they were computed over a prefix that failed to load are
planned again once recomputed.

Sessions: a request whose ``kv_transfer_params`` hold ``{"kvtier_session": id}`` loads like
any other (its session's chunks are chain chunks of the same keys), and when it finishes
its computed KV is spilled as the session's next generation (``SpillPlan``); the request's
output then carries ``{"kvtier_session": id, "kvtier_generation": n}``.

The worker copies a save's blocks out in the step that computes them, so saves never hold
a request's blocks; a finished session request keeps its blocks (``delay_free``) only until
the worker has copied them for its spill, in the next step (``get_finished``).

``kv_role``: a ``kv_consumer`` only loads (no save or spill is planned), a ``kv_producer``
only saves (every lookup is 0), ``kv_both`` does both.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence, Set
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

from vllm.logger import init_logger

from kvstore.format.errors import InvalidRequest, NotFound, shown
from kvstore.format.layout import LayoutSpec
from kvtier.integrations.breaker import Link
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.layout import FULL, SLIDING, CacheShape, rank_session
from kvtier.integrations.vllm.metadata import (
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadPlan,
    SavePlan,
    SpillPlan,
)
from kvtier.integrations.vllm.stats import KVTierStats, StatsCounter
from kvtier.sync import Client

logger = init_logger("vllm." + __name__)  # under vLLM's logger: its format and level

SESSION_PARAM = "kvtier_session"
# About a same-host lookup's time: most requests are scheduled in the step that asked,
# without the engine's steps polling meanwhile, which contend for the GIL the lookup's
# threads need (a loaded engine's lookups then missed their deadline).
FIRST_ANSWER_S = 0.002
GENERATION_PARAM = "kvtier_generation"

# What the scheduler side reads of vLLM's objects: vLLM is not installed where mypy runs,
# so these protocols type the hooks' arguments (vLLM's own classes satisfy them).
BlockIds = Sequence[Sequence[int]]  # per KV cache group (vLLM's order): its block ids


class EngineRequest(Protocol):
    """vLLM's ``Request``."""

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...
    @property
    def prompt_embeds(self) -> object: ...  # a tensor, or None
    @property
    def mm_features(self) -> Sequence[object]: ...
    @property
    def lora_request(self) -> object: ...
    @property
    def cache_salt(self) -> str | None: ...


class AllocatedBlocks(Protocol):
    """vLLM's ``KVCacheBlocks``: a request's blocks."""

    def get_block_ids(self) -> BlockIds: ...


class NewRequestData(Protocol):
    """vLLM's ``NewRequestData``: a request scheduled for the first time (or resumed)."""

    @property
    def req_id(self) -> str: ...
    @property
    def block_ids(self) -> BlockIds: ...
    @property
    def num_computed_tokens(self) -> int: ...


class CachedRequestData(Protocol):
    """vLLM's ``CachedRequestData``: the requests scheduled before, one index each."""

    @property
    def req_ids(self) -> Sequence[str]: ...
    @property
    def resumed_req_ids(self) -> Set[str]: ...
    @property
    def new_block_ids(self) -> Sequence[BlockIds | None]: ...
    @property
    def num_computed_tokens(self) -> Sequence[int]: ...


class SchedulerOutput(Protocol):
    """vLLM's ``SchedulerOutput``: one step's schedule."""

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestData]: ...
    @property
    def scheduled_cached_reqs(self) -> CachedRequestData: ...
    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...
    @property
    def scheduled_spec_decode_tokens(self) -> Mapping[str, Sequence[int]]: ...


class ConnectorOutput(Protocol):
    """vLLM's ``KVConnectorOutput``: what the workers reported of a step."""

    @property
    def kv_connector_worker_meta(self) -> object: ...  # the workers' aggregated, or None


@dataclass
class _Match:
    """A lookup's answer for one request at one length."""

    num_tokens: int
    local_tokens: int  # vLLM's own block-aligned hit it was asked beyond
    held_tokens: int
    session: str | None
    generation: int  # the session's stored generation; 0: none yet


@dataclass
class _Asked:
    """A lookup in flight for one request at one length."""

    num_tokens: int
    local_tokens: int
    session: str | None
    answer: Future[tuple[int, int]]  # (held tokens, session generation)
    deadline: float  # time.monotonic() past which it is a miss


@dataclass
class _Tracker:
    request: EngineRequest
    session: str | None
    generation: int
    # per stored group (vLLM's index): its blocks, one per chunk (null blocks below a
    # sliding window included), and the chunks from 0 the store holds or a save was
    # planned for (a sliding group's below its window count as done)
    block_ids: dict[int, list[int]] = field(default_factory=dict)
    saved: dict[int, int] = field(default_factory=dict)
    load: tuple[int, int] | None = None  # (first, end) tokens to load in the next step


def session_of(request: EngineRequest) -> str | None:
    """The session a request resumes and extends (``kv_transfer_params``), or None; a
    value that is no session id is ignored (logged): a request must not stop the engine."""
    params = getattr(request, "kv_transfer_params", None) or {}
    session = params.get(SESSION_PARAM)
    if session is None:
        return None
    if not isinstance(session, str) or not session:
        logger.warning("kvtier: request %s: %s must be a non-empty string, got %s; ignored",
                       request.request_id, SESSION_PARAM, shown(session))
        return None
    return session


def cacheable(request: EngineRequest) -> bool:
    """Whether a request's KV is a function of its token ids and the model alone: not with
    prompt embeddings, multimodal inputs (their placeholder tokens do not say what they
    stand for), a LoRA adapter or a cache salt (vLLM's own cache isolation). Others are
    neither loaded nor saved."""
    return (request.prompt_token_ids is not None and request.prompt_embeds is None
            and not request.mm_features and request.lora_request is None
            and request.cache_salt is None)


def held_limit(num_tokens: int, block_size: int) -> int:
    """The most tokens of a ``num_tokens`` sequence a load may cover: whole blocks that
    leave at least the last token to compute."""
    return max(num_tokens - 1, 0) // block_size * block_size


def window_end(request: EngineRequest, alignment: int) -> int:
    """Where a request's sliding windows are stored: the longest hit a repeat of its
    prompt can have (a longer prompt sharing it hits there too)."""
    return held_limit(request.num_prompt_tokens, alignment)


def window_hit(groups: list[CacheShape], held: dict[int, set[int]], most: int,
               alignment: int) -> int:
    """The longest end, at most ``most`` and a multiple of ``alignment``, at which every
    sliding group of ``groups`` holds its trailing window (``held``: group -> the chunks
    the store holds); 0 when none."""
    for end in range(most // alignment * alignment, 0, -alignment):
        if all(set(range(g.window_start(end), end // g.block_size)) <= held[g.group]
               for g in groups if g.kind == SLIDING):
            return end
    return 0


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, groups: list[CacheShape],
                 layouts: dict[int, list[LayoutSpec]], link: Link, *, alignment: int,
                 loads: bool = True, saves: bool = True) -> None:
        """``groups``: every KV cache group, in vLLM's order; ``layouts``: per stored
        group, one layout per rank, rank 0 first; ``alignment``: the tokens a hit is a
        multiple of (``layout.hit_alignment``); ``loads``/``saves``: what the engine's
        ``kv_role`` allows."""
        self.config = config
        self.groups = [g for g in groups if g.stored]
        self.rebuilt = [g for g in groups if not g.stored]
        self.shape = self.groups[0]  # a session's group (sessions: one full group only)
        self.sessions = len(self.groups) == 1 and self.shape.kind == FULL
        self.alignment = alignment
        self.layouts = layouts
        self.link = link
        self.loads = loads
        self.saves = saves
        self.stats = StatsCounter()
        self._lookups = ThreadPoolExecutor(4, thread_name_prefix="kvtier-lookup")
        self._asked: dict[str, _Asked] = {}
        self._matches: dict[str, _Match] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._spills: list[SpillPlan] = []
        self._delayed: list[str] = []

    @property
    def client(self) -> Client:
        return self.link.client

    # -- matching --

    def get_num_new_matched_tokens(self, request: EngineRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self.loads or not cacheable(request):
            return 0, False
        num_tokens = len(request.all_token_ids)
        match = self._matches.get(request.request_id)
        if match is None or match.num_tokens != num_tokens \
                or match.local_tokens != num_computed_tokens:
            match = self._match(request, num_tokens, num_computed_tokens)
            if match is None:
                return None, False  # asked: the answer comes in a later step
            self._matches[request.request_id] = match
        return max(0, match.held_tokens - num_computed_tokens), False

    def _match(self, request: EngineRequest, num_tokens: int, local_tokens: int) -> _Match | None:
        """The store's answer for ``request`` now, a miss, or None while it is asked."""
        session = session_of(request) if self.sessions else None
        limit = held_limit(num_tokens, self.alignment)
        if limit <= local_tokens and session is None:
            return _Match(num_tokens, local_tokens, 0, session, 0)  # nothing to ask
        asked = self._asked.get(request.request_id)
        if asked is not None and (asked.num_tokens, asked.local_tokens) \
                != (num_tokens, local_tokens):
            asked = None  # asked for another length: ask again
        if asked is None:
            if not self.link.up:
                self.stats.add(lookups=1, lookups_down=1)
                return _Match(num_tokens, local_tokens, 0, session, 0)
            # a session's generation is asked even when there is no prefix to look up
            tokens = list(request.all_token_ids[:limit]) if limit > local_tokens else []
            asked = _Asked(num_tokens, local_tokens, session,
                           self._lookups.submit(self._ask, tokens, session),
                           time.monotonic() + self.config.lookup_timeout_ms / 1000)
            self._asked[request.request_id] = asked
            wait((asked.answer,), timeout=min(FIRST_ANSWER_S,
                                              self.config.lookup_timeout_ms / 1000))
        if not asked.answer.done():
            if time.monotonic() < asked.deadline:
                return None
            del self._asked[request.request_id]
            self.stats.add(lookups=1, lookup_timeouts=1)
            self.link.failed("lookup", TimeoutError(
                f"no answer in {self.config.lookup_timeout_ms:g} ms"))
            return _Match(num_tokens, local_tokens, 0, session, 0)
        del self._asked[request.request_id]
        try:
            held, generation = asked.answer.result()
        except Exception as exc:  # down, refusing, a bug: a miss, never a stalled engine
            logger.warning("kvtier lookup failed, taken as a miss: %s", exc)
            self.stats.add(lookups=1, lookup_errors=1)
            self.link.failed("lookup", exc)
            return _Match(num_tokens, local_tokens, 0, session, 0)
        self.link.succeeded()
        self.stats.add(lookups=1)
        return _Match(num_tokens, local_tokens, held, session, generation)

    def _ask(self, tokens: list[int], session: str | None) -> tuple[int, int]:
        """On a lookup thread: (the tokens every rank of every group holds, the
        session's generation)."""
        held = len(tokens)
        for group in self.groups if tokens else ():
            for spec in self.layouts[group.group] if group.kind == FULL else ():
                held = min(held, self.client.lookup(
                    self.config.tenant, spec, tokens, model=self.config.model_fingerprint,
                    dedupe_domain=self.config.dedupe_domain))
        sliding = [g for g in self.groups if g.kind == SLIDING]
        end = held // self.alignment * self.alignment
        if end and sliding:
            # the common hit first (a repeat, or a prompt extending a stored one): each
            # window at that end alone; else every held window below it
            found = {g.group: self._held_chunks(g, tokens[:end], g.window_start(end))
                     for g in sliding}
            if window_hit(self.groups, found, end, self.alignment) != end:
                found = {g.group: self._held_chunks(g, tokens[:end], 0) for g in sliding}
            end = window_hit(self.groups, found, end, self.alignment)
        return end, self._generation(session) if session is not None else 0

    def _held_chunks(self, group: CacheShape, tokens: list[int], first: int) -> set[int]:
        """The chunks of ``tokens`` from ``first`` on a sliding group's layouts hold on
        every rank: one ``ReadChunks`` per rank, of which only held windows come back."""
        held: set[int] | None = None
        for spec in self.layouts[group.group]:
            with self.client.read_chunks(
                    self.config.tenant, spec, tokens, first_chunk=first,
                    model_fingerprint=self.config.model_fingerprint,
                    dedupe_domain=self.config.dedupe_domain, check_digests=False,
                    in_place=True) as result:
                got = set(result.chunks)
            held = got if held is None else held & got
        return held or set()

    def _generation(self, session: str) -> int:
        """The stored generation of ``session`` (rank 0's); 0 when there is none."""
        try:
            reply = self.client.stat(self.config.tenant, rank_session(session, self.shape, 0))
        except NotFound:
            return 0
        return reply.session.generation if reply.session is not None else 0

    def update_state_after_alloc(self, request: EngineRequest, blocks: AllocatedBlocks,
                                 num_external_tokens: int) -> None:
        if not cacheable(request):
            return
        match = self._matches.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        session = match.session if match is not None else (
            session_of(request) if self.sessions else None)
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            tracker = _Tracker(request, session, match.generation if match else 0)
            self._trackers[request.request_id] = tracker
        tracker.request = request
        ids = blocks.get_block_ids()
        tracker.block_ids = {g.group: list(ids[g.group]) for g in self.groups}
        # A request scheduled again (after a preemption) starts over from what is held now.
        held = match.held_tokens if match is not None else 0
        tracker.saved = {g.group: held // g.block_size for g in self.groups}
        tracker.load = None
        if num_external_tokens > 0:
            assert match is not None  # vLLM loads external tokens only of a hit it was told
            start = match.local_tokens
            end = start + num_external_tokens
            if start % self.alignment or end % self.alignment or end > match.held_tokens:
                raise InvalidRequest(f"kvtier connector: vLLM asked to load tokens "
                                     f"[{start}, {end}) of a {match.held_tokens}-token hit in "
                                     f"blocks of {self.alignment}")
            tracker.load = (start, end)
            windows = any(g.kind == SLIDING for g in self.groups)
            self.stats.add(hits=1, hit_tokens=num_external_tokens, window_loads=int(windows),
                           window_replays=int(bool(self.rebuilt)))
            logger.debug("kvtier hit of request %s: tokens [%d, %d) loaded%s%s",
                         request.request_id, start, end,
                         "; sliding windows loaded from kvtier" if windows else "",
                         "; the engine replays its rebuilt groups' window"
                         if self.rebuilt else "")

    # -- per-step plans --

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> KVTierConnectorMetadata:
        meta = KVTierConnectorMetadata()
        drafts = scheduler_output.scheduled_spec_decode_tokens
        # KV that will stand after the step: draft tokens' KV may be rejected
        scheduled = {req_id: n - len(drafts.get(req_id, ()))
                     for req_id, n in scheduler_output.num_scheduled_tokens.items()}
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new.req_id)
            if tracker is not None:
                tracker.block_ids = {g.group: list(new.block_ids[g.group])
                                     for g in self.groups}
                self._plan(meta, new.req_id, tracker,
                           new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            added = cached.new_block_ids[i]
            for g in self.groups:
                if req_id in cached.resumed_req_ids:
                    tracker.block_ids[g.group] = list(added[g.group]) if added is not None \
                        else []
                elif added is not None:
                    tracker.block_ids[g.group].extend(added[g.group])
            self._plan(meta, req_id, tracker, cached.num_computed_tokens[i] + scheduled[req_id])
        meta.spills, self._spills = self._spills, []
        meta.delayed, self._delayed = self._delayed, []
        return meta

    def _plan(self, meta: KVTierConnectorMetadata, req_id: str, tracker: _Tracker,
              computed_after: int) -> None:
        tokens = tracker.request.all_token_ids
        load, tracker.load = tracker.load, None
        for g in self.groups:
            self._plan_group(meta, req_id, tracker, g, tokens, load, computed_after)

    def _plan_group(self, meta: KVTierConnectorMetadata, req_id: str, tracker: _Tracker,
                    group: CacheShape, tokens: Sequence[int], load: tuple[int, int] | None,
                    computed_after: int) -> None:
        bs, index = group.block_size, group.group
        blocks = tracker.block_ids[index]
        if load is not None:
            # a sliding group's blocks below the window of the hit's end are null
            first = max(load[0] // bs, group.window_start(load[1]))
            end = load[1] // bs
            if end > first:
                meta.loads.append(LoadPlan(req_id, tuple(tokens[:end * bs]), first,
                                           tuple(blocks[first:end]), index))
            tracker.saved[index] = max(tracker.saved[index], end)
        full = min(computed_after, len(tokens), len(blocks) * bs) // bs
        saved = tracker.saved[index]
        first = saved
        if group.kind == SLIDING:
            # only the trailing window at the prompt's window end, never the history
            end_tokens = window_end(tracker.request, self.alignment)
            first = max(saved, group.window_start(end_tokens))
            full = min(full, end_tokens // bs)
        if self.saves and full > first:
            meta.saves.append(SavePlan(req_id, tuple(tokens[:full * bs]), first,
                                       tuple(blocks[first:full]), index))
        tracker.saved[index] = max(saved, full)

    def update_connector_output(self, connector_output: ConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KVTierWorkerMetadata):
            for req_id, token in worker_meta.unsaved.items():
                tracker = self._trackers.get(req_id)
                if tracker is not None:
                    for g in self.groups:
                        tracker.saved[g.group] = min(tracker.saved[g.group],
                                                     token // g.block_size)

    # -- the end of a request --

    def request_finished(self, request: EngineRequest, block_ids: BlockIds
                         ) -> tuple[bool, dict[str, str | int] | None]:
        """``block_ids``: per KV cache group (vLLM's order)."""
        self._matches.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        tracker = self._trackers.pop(request.request_id, None)
        if tracker is None:
            return False, None
        tokens = request.all_token_ids
        computed = min(request.num_computed_tokens, len(tokens))
        if not self.saves or tracker.session is None or computed == 0:
            return False, None  # its saves' blocks were copied as they were computed
        generation = tracker.generation + 1
        blocks = -(-computed // self.shape.block_size)
        self._spills.append(SpillPlan(request.request_id, tracker.session, generation,
                                      tuple(tokens[:computed]),
                                      tuple(block_ids[self.shape.group][:blocks])))
        self._delayed.append(request.request_id)
        return True, {SESSION_PARAM: tracker.session, GENERATION_PARAM: generation}

    def take_stats(self) -> KVTierStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self.link.close()
