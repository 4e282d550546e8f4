"""Bounded replay of a standard transformers model's sliding layers: the truncated-window
approximation.

The full-attention layers' rows are kept (every token, exact); the sliding layers' rows
are dropped and rebuilt by running the caller's model over the last R tokens from a
cache whose full layers hold every token before them and whose sliding layers hold
nothing. A replayed token's sliding layers attend only to the replayed tokens before it,
so its rows differ from the uninterrupted run's; the full layers then get their stored
rows of the replayed tokens back. An all-sliding model keeps nothing but the tokens: the
replay rebuilds every layer from the last R tokens alone. R must cover the window
(R >= min(n, W - 1)): a sliding layer holds exactly the last W - 1 rows.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from kvstore.format.errors import InvalidRequest
from kvstore.format.hf.attention import HFModel


class _ReplayedSlidingLayer(DynamicSlidingWindowLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__ is untyped
    """A sliding layer that holds fewer rows than it has seen tokens: its mask starts at
    its first held row (the stock class assumes it holds min(seen, W - 1))."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        assert self.keys is not None  # initialized before the model asks for masks
        held = self.keys.shape[2]
        return held + query_length, self.cumulative_length - held


def _layers(cache: DynamicCache) -> list[Any]:
    """``cache``'s layers: transformers types them as the union of its layer mixins, and
    the caches replayed here hold dynamic (or sliding) layers, with keys and values."""
    return list(cache.layers)


def check_replay_tokens(window: int, num_tokens: int, r: int) -> int:
    """The tokens a replay of ``r`` runs (capped at ``num_tokens``); ``InvalidRequest``
    when it would leave a sliding layer of ``window`` short of its rows."""
    r = min(r, num_tokens)
    if r < min(num_tokens, window - 1):
        raise InvalidRequest(f"a replay of {r} tokens cannot rebuild a window of {window} "
                             f"(its layers hold the last {window - 1} rows): replay at least "
                             f"{min(num_tokens, window - 1)}")
    return r


@torch.no_grad()
def replay_sliding_layers(model: HFModel, cache: DynamicCache, ids: torch.Tensor, r: int
                          ) -> DynamicCache:
    """Rebuild the sliding layers of ``cache`` (full layers: every one of the n = len(ids)
    tokens; sliding layers: ignored) by replaying the last ``r`` tokens; returns the
    model's own cache classes, full layers unchanged."""
    n = len(ids)
    start = n - r
    stored = {}
    for i, layer in enumerate(_layers(cache)):
        if isinstance(layer, DynamicSlidingWindowLayer):
            assert layer.keys is not None and layer.values is not None  # a filled cache
            # (1, heads, 0, head_dim): nothing held, every token before the replay seen
            empty = layer.keys[:, :, :0], layer.values[:, :, :0]
            replayed = _ReplayedSlidingLayer(layer.sliding_window)
            replayed.lazy_initialization(*empty)
            replayed.keys, replayed.values = empty
            replayed.cumulative_length = start
            cache.layers[i] = replayed
        else:
            stored[i] = (layer.keys, layer.values)
            layer.keys, layer.values = layer.keys[:, :, :start], layer.values[:, :, :start]
    model(ids[start:][None], past_key_values=cache, use_cache=True,
          position_ids=torch.arange(start, n)[None])
    for i, layer in enumerate(_layers(cache)):
        if i in stored:  # the stored rows, not the replay's approximation of them
            layer.keys, layer.values = stored[i]
        else:
            rebuilt = DynamicSlidingWindowLayer(layer.sliding_window)
            rebuilt.lazy_initialization(layer.keys, layer.values)
            rebuilt.keys, rebuilt.values = layer.keys, layer.values
            rebuilt.cumulative_length = n
            cache.layers[i] = rebuilt
    return cache
