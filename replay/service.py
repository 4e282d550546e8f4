"""The in-process replay backend the server builds (``services.server.replay_backend``):
``ReplayService()`` serves the bundled model, loading its weights on the first rebuild so
a server that never needs replay never pays for them, unless it warms it up first
(``warm_up``: ``replay_warmup`` in the server's config)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import LayoutSpec
from model.checkpoint import BUNDLED_WEIGHTS, load, load_config
from model.config import layout_spec
from replay.state_codec import Buffer
from replay.worker import DEFAULT_MAX_BATCH, DEFAULT_REPLAY_TOKENS, ReplayResult, ReplayWorker

log = logging.getLogger(__name__)


class LazyReplay:
    """A replay backend whose model is loaded and worker made (in a thread: the worker
    fingerprints every weight) on the first rebuild, so a server that never replays never
    pays for the weights."""

    def __init__(self, load: Callable[[], Any], make_worker: Callable[[Any], Any]) -> None:
        self._load, self._make_worker = load, make_worker
        self._worker = None
        self._loading = asyncio.Lock()

    async def worker(self):
        async with self._loading:
            if self._worker is None:
                self._worker = await asyncio.to_thread(
                    lambda: self._make_worker(self._load()))
        return self._worker

    @property
    def loaded(self) -> bool:
        """Whether the model is loaded (by a rebuild or ``warm_up``)."""
        return self._worker is not None

    async def warm_up(self) -> None:
        """Load the model now and run it once (the worker's ``warm_up``, where it has
        one), so the first rebuild pays for neither."""
        worker = await self.worker()
        exercise = getattr(worker, "warm_up", None)
        if exercise is not None:
            await exercise()

    async def rebuild(self, layout: str | LayoutSpec, token_ids, chunks: Sequence[Buffer],
                      tail: Buffer, replay_tokens: int | None = None, *,
                      model_fingerprint: str = "") -> ReplayResult:
        worker = await self.worker()
        return await worker.rebuild(layout, token_ids, chunks, tail, replay_tokens,
                                    model_fingerprint=model_fingerprint)

    async def close(self) -> None:
        if self._worker is not None:
            await self._worker.close()


class ReplayService(LazyReplay):
    def __init__(self, weights: Path = BUNDLED_WEIGHTS, *,
                 default_tokens: int = DEFAULT_REPLAY_TOKENS,
                 max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if not weights.exists():
            raise InvalidRequest(f"no model weights at {weights}: run `python -m model.train`")
        super().__init__(lambda: load(weights), lambda model: ReplayWorker(
            model, default_tokens=default_tokens, max_batch=max_batch))
        self._weights = weights
        self._layout: LayoutSpec | None = None

    def model_layouts(self, replayer: str) -> tuple[LayoutSpec, ...] | None:
        """The cache of the model it replays ``replayer``'s layouts with (from the config
        stored with its weights, which stay unloaded); None for another replayer."""
        if replayer != ReplayWorker.replayer:
            return None
        if self._layout is None:
            try:
                self._layout = layout_spec(load_config(self._weights))
            except (OSError, ValueError) as exc:  # the first rebuild reports it
                log.warning("no model config with the weights at %s: %s", self._weights, exc)
                return None
        return (self._layout,)
