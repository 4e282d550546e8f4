"""The connector's scheduler side (the engine core process): how much of a request's prefix
the store holds, and the per-step plans for the worker side.

Matching: the store is asked (``Lookup``) for the longest held prefix of the request's
tokens in whole blocks, never the whole sequence (the last token is always computed, so
vLLM has logits to sample from); with several tensor-parallel ranks, the shortest of their
layouts' prefixes. The lookup never blocks a step: it runs on a background thread, and
until it answers the scheduler is told "ask again later" (None); one that has not answered
within ``lookup_timeout_ms``, or fails, is a miss, and counts against the link's breaker.
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm.logger import init_logger

from kvstore.format.errors import InvalidRequest, NotFound, shown
from kvstore.format.layout import LayoutSpec
from kvtier.integrations.vllm.breaker import Link
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.layout import CacheShape, rank_session
from kvtier.integrations.vllm.metadata import (
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadPlan,
    SavePlan,
    SpillPlan,
)
from kvtier.integrations.vllm.stats import KVTierStats, StatsCounter

logger = init_logger("vllm." + __name__)  # under vLLM's logger: its format and level

SESSION_PARAM = "kvtier_session"
GENERATION_PARAM = "kvtier_generation"


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
    answer: Future  # (held tokens, session generation)
    deadline: float  # time.monotonic() past which it is a miss


@dataclass
class _Tracker:
    request: object  # vllm.v1.request.Request
    session: str | None
    generation: int
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # chunks from 0 the store holds or a save was planned for
    load: tuple[int, int] | None = None  # (first, end) chunks to load in the next step


def session_of(request) -> str | None:
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


def cacheable(request) -> bool:
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


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, shape: CacheShape,
                 layouts: list[LayoutSpec], link: Link, *, loads: bool = True,
                 saves: bool = True) -> None:
        """``loads``/``saves``: what the engine's ``kv_role`` allows."""
        self.config = config
        self.shape = shape
        self.layouts = layouts  # one per rank, rank 0 first
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
    def client(self):
        return self.link.client

    # -- matching --

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
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

    def _match(self, request, num_tokens: int, local_tokens: int) -> _Match | None:
        """The store's answer for ``request`` now, a miss, or None while it is asked."""
        session = session_of(request)
        limit = held_limit(num_tokens, self.shape.block_size)
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
        """On a lookup thread: (the tokens every rank holds, the session's generation)."""
        held = len(tokens)
        for spec in self.layouts if tokens else ():
            held = min(held, self.client.lookup(
                self.config.tenant, spec, tokens, model=self.config.model_fingerprint,
                dedupe_domain=self.config.dedupe_domain))
        return held, self._generation(session) if session is not None else 0

    def _generation(self, session: str) -> int:
        """The stored generation of ``session`` (rank 0's); 0 when there is none."""
        try:
            reply = self.client.stat(self.config.tenant, rank_session(session, self.shape, 0))
        except NotFound:
            return 0
        return reply.session.generation if reply.session is not None else 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if not cacheable(request):
            return
        match = self._matches.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        bs = self.shape.block_size
        session = match.session if match is not None else session_of(request)
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            tracker = _Tracker(request, session, match.generation if match else 0)
            self._trackers[request.request_id] = tracker
        tracker.request = request
        tracker.block_ids = list(blocks.get_block_ids()[0])
        # A request scheduled again (after a preemption) starts over from what is held now.
        tracker.saved = (match.held_tokens // bs) if match is not None else 0
        tracker.load = None
        if num_external_tokens > 0:
            start = match.local_tokens
            end = start + num_external_tokens
            if start % bs or end % bs or end > match.held_tokens:
                raise InvalidRequest(f"kvtier connector: vLLM asked to load tokens "
                                     f"[{start}, {end}) of a {match.held_tokens}-token hit in "
                                     f"blocks of {bs}")
            tracker.load = (start // bs, end // bs)
            self.stats.add(hits=1, hit_tokens=num_external_tokens)

    # -- per-step plans --

    def build_connector_meta(self, scheduler_output) -> KVTierConnectorMetadata:
        meta = KVTierConnectorMetadata()
        drafts = scheduler_output.scheduled_spec_decode_tokens
        # KV that will stand after the step: draft tokens' KV may be rejected
        scheduled = {req_id: n - len(drafts.get(req_id, ()))
                     for req_id, n in scheduler_output.num_scheduled_tokens.items()}
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new.req_id)
            if tracker is not None:
                tracker.block_ids = list(new.block_ids[0])
                self._plan(meta, new.req_id, tracker,
                           new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracker.block_ids = list(added[0]) if added is not None else []
            elif added is not None:
                tracker.block_ids.extend(added[0])
            self._plan(meta, req_id, tracker, cached.num_computed_tokens[i] + scheduled[req_id])
        meta.spills, self._spills = self._spills, []
        meta.delayed, self._delayed = self._delayed, []
        return meta

    def _plan(self, meta: KVTierConnectorMetadata, req_id: str, tracker: _Tracker,
              computed_after: int) -> None:
        bs = self.shape.block_size
        tokens = tracker.request.all_token_ids
        if tracker.load is not None:
            first, end = tracker.load
            meta.loads.append(LoadPlan(req_id, tuple(tokens[:end * bs]), first,
                                       tuple(tracker.block_ids[first:end])))
            tracker.load = None
            tracker.saved = max(tracker.saved, end)
        full = min(computed_after, len(tokens), len(tracker.block_ids) * bs) // bs
        if self.saves and full > tracker.saved:
            meta.saves.append(SavePlan(req_id, tuple(tokens[:full * bs]), tracker.saved,
                                       tuple(tracker.block_ids[tracker.saved:full])))
            tracker.saved = full

    def update_connector_output(self, connector_output) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KVTierWorkerMetadata):
            for req_id, chunk in worker_meta.unsaved.items():
                tracker = self._trackers.get(req_id)
                if tracker is not None:
                    tracker.saved = min(tracker.saved, chunk)

    # -- the end of a request --

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
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
                                      tuple(tokens[:computed]), tuple(block_ids[:blocks])))
        self._delayed.append(request.request_id)
        return True, {SESSION_PARAM: tracker.session, GENERATION_PARAM: generation}

    def take_stats(self) -> KVTierStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self.link.close()
