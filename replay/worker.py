"""The bounded-replay worker: rebuild a session's discarded window KV from its global KV.

    worker = ReplayWorker(model)                       # model.net.KVTierLM, eval mode
    result = await worker.rebuild(layout_id, token_ids, chunks, tail, replay_tokens=None)
    result.window                                      # window blob (replay.state_codec)

It decodes the session's persistent chunks into a ``KVState`` without window, reruns
the last R tokens through ``model.infer.replay`` (R = ``default_tokens`` unless the request
names one) and encodes the rebuilt window K/V and pending rows.

Model compute runs on one dedicated thread, never on the event loop, so a server
hosting the worker keeps answering while a replay runs. Concurrent rebuilds queue on
that thread one after another rather than being stacked into one model call: the
model's kernels take one position vector per call (``q_pos``/``n_visible`` are (T,),
shared by the batch), so sessions at different positions cannot share a call, and
running single-session replays in parallel threads measured no faster than one after
another on CPU (``python -m replay.bench``).
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstore.errors import InvalidRequest, UnknownLayout
from kvstore.layout import LayoutSpec, get_layout
from model.config import layout_spec
from model.infer import replay
from model.net import KVTierLM
from replay.state_codec import (
    Buffer,
    as_token_array,
    check_spec,
    encode_window,
    state_from_chunks,
)

DEFAULT_REPLAY_TOKENS = 128
MAX_REPLAY_TOKENS = 8192  # far past any useful R: a bound on what one request may cost


@dataclass(frozen=True)
class ReplayResult:
    window: bytes  # window K/V chunk + pending rows chunk (replay.state_codec)
    replayed_tokens: int
    seconds: float  # decode + replay + encode, not the wait in the queue


class ReplayWorker:
    def __init__(self, model: KVTierLM, *, default_tokens: int = DEFAULT_REPLAY_TOKENS,
                 max_tokens: int = MAX_REPLAY_TOKENS) -> None:
        if not 1 <= default_tokens <= max_tokens:
            raise InvalidRequest(f"default_tokens must lie in [1, {max_tokens}], "
                                 f"got {default_tokens}")
        self.model = model
        self.default_tokens = default_tokens
        self.max_tokens = max_tokens
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="kvtier-replay")
        self.rebuilds = 0

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
                      tail: Buffer, replay_tokens: int | None = None) -> ReplayResult:
        """``layout``: layout id or name (or the spec); ``token_ids``: every token of the
        session; ``chunks``: its full persistent chunks in order; ``tail``: the partial
        last chunk (b"" if none). Raises InvalidRequest / CodecError on bad input."""
        spec = self.layout_for(layout)
        ids = as_token_array(token_ids)
        if not len(ids):
            raise InvalidRequest("a session without tokens has no window to rebuild")
        r = self.replay_tokens(replay_tokens, len(ids))
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._compute, self._rebuild, spec, ids,
                                            list(chunks), tail, r)
        self.rebuilds += 1
        return result

    def _rebuild(self, spec: LayoutSpec, ids, chunks: list[Buffer], tail: Buffer, r: int
                 ) -> ReplayResult:
        started = time.perf_counter()
        cold = state_from_chunks(self.model.cfg, ids, chunks, tail, None, spec=spec)
        warm = replay(self.model, cold, r)
        window = encode_window(spec, warm)
        return ReplayResult(window, r, time.perf_counter() - started)

    async def close(self) -> None:
        """Finish the queued rebuilds, then release the compute thread."""
        await asyncio.get_running_loop().run_in_executor(None, self._compute.shutdown, True)
