"""The bounded-replay worker for transformers DeepseekV4 (layouts whose replayer is
``transformers-deepseek-v4``), on the same call as ``replay.worker.ReplayWorker``:

    worker = TransformersReplayWorker(load_model("path/to/save_pretrained-dir"))
    result = await worker.rebuild(layout_id, token_ids, chunks, tail, replay_tokens)
    result.window     # window blob: window K=V + compressor partial-block state

It decodes the session's persisted compressor and indexer entries, reruns the last R
tokens (aligned, ``kvstore.format.hf.deepseek_v4.replay_start``) through the model with
its compressors frozen, and encodes what that rebuilt as ephemeral chunks. ``load_model``
takes a ``save_pretrained`` directory, or a config JSON whose weights are drawn at random
from ``seed`` (for tests and benchmarks: no download ever happens). Model compute runs on
one dedicated thread, one rebuild at a time.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvstore.format.checks import check_token_ids
from kvstore.format.errors import InvalidRequest, LayoutMismatch, UnknownLayout
from kvstore.format.hf import deepseek_v4
from kvstore.format.hf.model_layouts import DEEPSEEK_V4_BITS, deepseek_v4_layout, is_deepseek_v4
from kvstore.format.layout import MAX_REPLAY_TOKENS, LayoutSpec
from kvstore.format.model_identity import check_replayer, module_fingerprint
from kvstore.format.registry import get_layout
from kvstore.format.window import encode_window
from replay.service import LazyReplay
from replay.state_codec import Buffer, as_token_array, decode_persistent
from replay.worker import DEFAULT_REPLAY_TOKENS, ReplayResult

log = logging.getLogger(__name__)


def load_model(path: str | Path, seed: int = 0):
    """A DeepseekV4ForCausalLM in eval mode from a save_pretrained directory, or from a
    config JSON with weights seeded at random."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path)
    elif path.is_file():
        config = AutoConfig.from_pretrained(path)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    else:
        raise InvalidRequest(f"no transformers model at {path} (a save_pretrained directory "
                             "or a config JSON)")
    if not is_deepseek_v4(model.config):
        raise InvalidRequest(f"{path}: model type {model.config.model_type!r}; the "
                             "transformers replayer serves deepseek_v4")
    return model.eval()


class TransformersReplayWorker:
    replayer = "transformers-deepseek-v4"
    max_batch = 1  # one rebuild at a time: a Streams consumer takes one job at once

    def __init__(self, model, *, default_tokens: int = DEFAULT_REPLAY_TOKENS,
                 max_tokens: int = MAX_REPLAY_TOKENS) -> None:
        if not is_deepseek_v4(model.config):
            raise InvalidRequest("the transformers replayer serves deepseek_v4 models")
        self.model = model
        # of the model it loaded (weights, buffers, config): a session spilled by
        # another model is refused
        self.model_fingerprint = module_fingerprint(model, model.config)
        self.default_tokens = default_tokens
        self.max_tokens = max_tokens
        self.layouts = {spec.layout_id: spec for spec in
                        (deepseek_v4_layout(model.config, bits) for bits in DEEPSEEK_V4_BITS)}
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="kvtier-hf-replay")
        self.rebuilds = 0

    def layout_for(self, layout: str | LayoutSpec) -> LayoutSpec:
        """The spec, checked to be one of this model's layouts: one derived from its
        config, or a spec (a request's layout JSON) of the same streams, chunk size,
        window and vocabulary under another name. A layout id need not be registered in
        this process: the worker knows its model's."""
        if isinstance(layout, LayoutSpec):
            if layout.layout_id in self.layouts or any(
                    _same_cache(layout, own) for own in self.layouts.values()):
                return layout
            raise LayoutMismatch(f"layout {layout.layout_id} does not describe this worker's "
                                 f"model (it serves {sorted(self.layouts)})")
        spec = self.layouts.get(layout)
        if spec is None:
            try:
                get_layout(layout)
            except UnknownLayout:
                raise UnknownLayout(f"layout {layout} is not this replay worker's model "
                                    f"(it serves {sorted(self.layouts)})") from None
            raise LayoutMismatch(f"layout {layout} does not describe this worker's "
                                 f"model (it serves {sorted(self.layouts)})")
        return spec

    def replay_tokens(self, requested: int | None) -> int:
        try:
            r = operator.index(requested or self.default_tokens)
        except TypeError:
            r = -1
        if not 1 <= r <= self.max_tokens:
            raise InvalidRequest(f"replay_tokens must be an integer in [1, {self.max_tokens}], "
                                 f"got {requested!r}")
        return r

    async def rebuild(self, layout: str | LayoutSpec, token_ids, chunks: Sequence[Buffer],
                      tail: Buffer, replay_tokens: int | None = None, *,
                      model_fingerprint: str = "") -> ReplayResult:
        """Same call as ``ReplayWorker.rebuild``."""
        check_replayer(model_fingerprint, self.model_fingerprint, "the session")
        spec = self.layout_for(layout)
        ids = as_token_array(token_ids)
        if not len(ids):
            raise InvalidRequest("a session without tokens has no window to rebuild")
        check_token_ids(spec, ids)
        r = self.replay_tokens(replay_tokens)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._compute, self._rebuild, spec, ids,
                                            list(chunks), tail, r)
        self.rebuilds += 1
        return result

    def _rebuild(self, spec: LayoutSpec, ids: np.ndarray, chunks: list[Buffer], tail: Buffer,
                 r: int) -> ReplayResult:
        started = time.perf_counter()
        persistent = decode_persistent(spec, ids, chunks, tail)
        tokens = torch.from_numpy(ids.astype(np.int64))
        window, replayed = deepseek_v4.replay_window(spec, self.model, tokens, persistent, r)
        blob = encode_window(spec, ids, window)
        return ReplayResult(blob, replayed, time.perf_counter() - started)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._compute.shutdown, True)


def _same_cache(a: LayoutSpec, b: LayoutSpec) -> bool:
    """Whether ``a`` lays out the cache ``b`` describes: the replay decodes, rebuilds and
    encodes by these fields alone (the names, baseline and notes shape none of it)."""
    def cache(spec: LayoutSpec) -> tuple:
        return (spec.streams, spec.chunk_tokens, spec.window_tokens, spec.vocab_size,
                spec.layer_modes)

    return cache(a) == cache(b)


class TransformersReplayService(LazyReplay):
    """The in-process backend the server builds for ``replay_hf_model``: the model is
    loaded on the first rebuild, so a server that never replays one never pays for it."""

    def __init__(self, path: str | Path, *, seed: int = 0,
                 default_tokens: int = DEFAULT_REPLAY_TOKENS) -> None:
        path = Path(path)
        if not path.exists():
            raise InvalidRequest(f"no transformers model at {path}")
        super().__init__(lambda: load_model(path, seed), lambda model: TransformersReplayWorker(
            model, default_tokens=default_tokens))
        self._path = path
        self._layouts: tuple[LayoutSpec, ...] | None = None

    def model_layouts(self, replayer: str) -> tuple[LayoutSpec, ...] | None:
        """The layouts of its model's cache (from its config; the weights stay unloaded),
        for ``replayer`` this one; None for another, or a config that does not load."""
        if replayer != TransformersReplayWorker.replayer:
            return None
        if self._layouts is None:
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(self._path)
            except (OSError, ValueError) as exc:  # the first rebuild reports it
                log.warning("no transformers config at %s: %s", self._path, exc)
                return None
            if not is_deepseek_v4(config):
                return None
            self._layouts = tuple(deepseek_v4_layout(config, bits) for bits in DEEPSEEK_V4_BITS)
        return self._layouts
