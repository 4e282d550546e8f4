"""The bounded-replay worker: rebuild a session's discarded window KV from its global KV.

    worker = ReplayWorker(model)                       # model.net.KVTierLM, eval mode
    result = await worker.rebuild(layout_id, token_ids, chunks, tail, replay_tokens=None)
    result.window                                      # window blob (replay.state_codec)

It decodes the session's persistent chunks into a ``KVState`` without window, reruns
the last R tokens through the model (R = ``default_tokens`` unless the request names
one) and encodes the rebuilt window K/V and pending rows.

Model compute runs on one dedicated thread, never on the event loop, so a server
hosting the worker keeps answering while a replay runs. Rebuilds that arrive while the
thread is busy wait in a queue, and the next model call takes up to ``max_batch`` of them
at once (``model.infer.replay_batch``): those of the oldest job's layout and R whose
lengths are within 2x of its own, since every session in a batch pays for the longest
one's global KV, and no more than ``BATCH_TOKENS`` tokens of context in all. A lone
rebuild never waits for company.

Batching pays where fixed per-call costs dominate, i.e. short contexts; the indexer's
per-session work over the global KV grows with context and does not batch, so a call
holds at most ``BATCH_TOKENS`` of context. Measured (``python -m bench.replay_batch``,
1 CPU thread, one batched call against the same replays one after another;
bench/REPORT.md "Batched replay"): 2-8 sessions of 512-2,048 tokens 1.00-1.34x faster;
sessions of 8,192 tokens 0.67-0.97x and of 32,768 0.44-0.65x, i.e. slower.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvstore.format.checks import check_token_ids
from kvstore.format.errors import InvalidRequest, UnknownLayout
from kvstore.format.layout import MAX_REPLAY_TOKENS, LayoutSpec
from kvstore.format.model_identity import check_replayer, module_fingerprint
from kvstore.format.registry import get_layout
from model.config import layout_spec
from model.infer import prefill, replay_batch
from model.net import KVTierLM
from replay.state_codec import (
    Buffer,
    as_token_array,
    check_spec,
    encode_window,
    state_from_chunks,
)

DEFAULT_REPLAY_TOKENS = 128
DEFAULT_MAX_BATCH = 8  # batching gains flatten out past a few sessions (bench.replay_batch)
BATCH_TOKENS = 1 << 13  # context per batched call; past it batching can be slower


@dataclass(frozen=True)
class ReplayResult:
    window: bytes  # window K/V chunk + pending rows chunk (replay.state_codec)
    replayed_tokens: int
    seconds: float  # decode + replay + encode of its batch, not the wait in the queue
    batch_size: int = 1  # sessions rebuilt by the same model call


@dataclass
class _Job:
    spec: LayoutSpec
    ids: np.ndarray
    chunks: list[Buffer]
    tail: Buffer
    r: int
    done: asyncio.Future


class ReplayWorker:
    replayer = "bundled"  # kvstore.format.layout.REPLAYERS: the layouts it rebuilds

    def __init__(self, model: KVTierLM, *, default_tokens: int = DEFAULT_REPLAY_TOKENS,
                 max_tokens: int = MAX_REPLAY_TOKENS,
                 max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if not 1 <= default_tokens <= max_tokens:
            raise InvalidRequest(f"default_tokens must lie in [1, {max_tokens}], "
                                 f"got {default_tokens}")
        if max_batch < 1:
            raise InvalidRequest(f"max_batch must be at least 1, got {max_batch}")
        self.model = model
        # of the model it loaded (weights, buffers, config): a session spilled by
        # another model is refused
        self.model_fingerprint = module_fingerprint(model, model.cfg)
        self.default_tokens = default_tokens
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="kvtier-replay")
        self._queue: list[_Job] = []
        self._drainer: asyncio.Task | None = None
        self.rebuilds = 0
        self.model_calls = 0  # those that rebuilt sessions (not warm_up's)
        self.warmed_up = False

    def layout_for(self, layout: str | LayoutSpec) -> LayoutSpec:
        """The spec (by name or id), checked to be this model's cache. A layout id not
        registered in this process is accepted when it is the one derived from the
        model's own config under that name (a worker knows the layout of its model)."""
        if isinstance(layout, LayoutSpec):
            spec = layout
        else:
            try:
                spec = get_layout(layout)
            except UnknownLayout:
                spec = layout_spec(self.model.cfg, name=layout.partition("@")[0])
                if spec.layout_id != layout:
                    raise
        check_spec(self.model.cfg, spec)
        return spec

    def model_layouts(self, replayer: str) -> tuple[LayoutSpec, ...] | None:
        """The cache of its model, for layouts of its replayer (None for another)."""
        return (layout_spec(self.model.cfg),) if replayer == self.replayer else None

    def replay_tokens(self, requested: int | None, num_tokens: int) -> int:
        """R for a request: None or 0 -> the default; capped at the session's length."""
        try:
            r = operator.index(requested or self.default_tokens)  # numpy ints too, not 2.5
        except TypeError:
            r = -1
        if not 1 <= r <= self.max_tokens:
            raise InvalidRequest(f"replay_tokens must be an integer in [1, {self.max_tokens}], "
                                 f"got {requested!r}")
        pending = num_tokens % self.model.cfg.block
        if r < pending:
            raise InvalidRequest(f"replay_tokens={r} is shorter than the {pending} tokens of "
                                 f"the unfinished block, which replay must rebuild")
        return min(r, num_tokens)

    async def rebuild(self, layout: str | LayoutSpec, token_ids, chunks: Sequence[Buffer],
                      tail: Buffer, replay_tokens: int | None = None, *,
                      model_fingerprint: str = "") -> ReplayResult:
        """``layout``: layout id or name (or the spec); ``token_ids``: every token of the
        session; ``chunks``: its full persistent chunks in order; ``tail``: the partial
        last chunk (b"" if none); ``model_fingerprint``: the session's (ModelMismatch
        unless "" or this worker's ``model_fingerprint``). Raises InvalidRequest /
        CodecError on bad input."""
        check_replayer(model_fingerprint, self.model_fingerprint, "the session")
        spec = self.layout_for(layout)
        ids = as_token_array(token_ids)
        if not len(ids):
            raise InvalidRequest("a session without tokens has no window to rebuild")
        check_token_ids(spec, ids)  # an id past the embedding fails deep in the model
        r = self.replay_tokens(replay_tokens, len(ids))
        job = _Job(spec, ids, list(chunks), tail, r, asyncio.get_running_loop().create_future())
        self._queue.append(job)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        result = await job.done
        self.rebuilds += 1
        return result

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while batch := self._take_batch():
            try:
                outcomes = await loop.run_in_executor(self._compute, self._rebuild_batch, batch)
            except BaseException as exc:  # the compute thread is gone: no job may hang
                for job in batch:
                    if not job.done.done():
                        job.done.set_exception(exc)
                raise
            self.model_calls += 1
            for job, outcome in zip(batch, outcomes, strict=True):
                if job.done.done():  # its caller was cancelled
                    continue
                if isinstance(outcome, BaseException):
                    job.done.set_exception(outcome)
                else:
                    job.done.set_result(outcome)

    def _take_batch(self) -> list[_Job]:
        """The oldest job and the queued jobs that can share its model call ([] when none
        is left); jobs whose callers were cancelled are dropped."""
        self._queue = [job for job in self._queue if not job.done.cancelled()]
        if not self._queue:
            return []
        first = self._queue[0]
        n = len(first.ids)
        fits = [job for job in self._queue
                if job.spec.layout_id == first.spec.layout_id and job.r == first.r
                and n <= 2 * len(job.ids) and len(job.ids) <= 2 * n]
        batch: list[_Job] = []
        longest = 0
        for job in fits[: self.max_batch]:
            longest = max(longest, len(job.ids))
            if batch and longest * (len(batch) + 1) > BATCH_TOKENS:
                break
            batch.append(job)
        taken = {id(job) for job in batch}
        self._queue = [job for job in self._queue if id(job) not in taken]
        return batch

    def _rebuild_batch(self, batch: list[_Job]) -> list[ReplayResult | Exception]:
        """On the compute thread: one result or error per job; a job whose chunks do not
        decode fails alone."""
        started = time.perf_counter()
        outcomes: list[ReplayResult | Exception | None] = [None] * len(batch)
        cold = []
        for i, job in enumerate(batch):
            try:
                cold.append((i, state_from_chunks(self.model.cfg, job.ids, job.chunks,
                                                  job.tail, None, spec=job.spec)))
            except Exception as exc:  # handed to that job's caller
                outcomes[i] = exc
        if cold:
            r = batch[0].r  # one R per batch (_take_batch)
            try:
                warm = replay_batch(self.model, [state for _, state in cold], r)
                windows: list[bytes | Exception] = [
                    encode_window(batch[i].spec, state)
                    for (i, _), state in zip(cold, warm, strict=True)]
            except Exception as exc:  # handed to the batch's callers
                windows = [exc] * len(cold)
            seconds = time.perf_counter() - started
            for (i, _), window in zip(cold, windows, strict=True):
                outcomes[i] = window if isinstance(window, Exception) else ReplayResult(
                    window, r, seconds, len(cold))
        done: list[ReplayResult | Exception] = []
        for outcome in outcomes:
            assert outcome is not None  # every job has its outcome
            done.append(outcome)
        return done

    async def warm_up(self) -> None:
        """Run the model once on the compute thread: a prefill of two blocks of token 0
        and a replay of the second, so the first rebuild pays none of the model's
        first-call costs."""
        block = self.model.cfg.block

        def run() -> None:
            state, _ = prefill(self.model, [0] * (2 * block), logits="none")
            replay_batch(self.model, [state], block)

        await asyncio.get_running_loop().run_in_executor(self._compute, run)
        self.warmed_up = True

    async def close(self) -> None:
        """Finish the queued rebuilds, then release the compute thread."""
        if self._drainer is not None:
            await asyncio.gather(self._drainer, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._compute.shutdown, True)
