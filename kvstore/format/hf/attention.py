"""Which cache layer a transformers config gets, as transformers itself decides it.

kvtier does not read ``sliding_window``, ``layer_types``, ``attention_chunk_size`` or any
other pattern attribute itself: it builds the (empty) ``DynamicCache(config=config)`` that
``generate`` and every model's forward build, and reads its layer classes, so its view of a
model and transformers' cannot disagree. Per layer:

- ``DynamicLayer``: full attention, it keeps every token; window 0.
- ``DynamicSlidingWindowLayer`` (sliding or chunked attention): it keeps the last W - 1
  tokens and counts every token it has seen (``cumulative_length``); window W.
- anything else (linear attention, KV-sharing consumers, indexed attention, model-specific
  classes): ``UnsupportedModel``, as are encoder-decoder configs.
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from kvstore.format.errors import UnsupportedModel

# A transformers config or model: their fields are the model's own, untyped there.
HFConfig = Any
HFModel = Any


def text_config(config: HFConfig) -> HFConfig:
    """The decoder's config of ``config`` (itself for a plain causal LM), as transformers
    builds the cache from it."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{config.model_type}: encoder-decoder caches are not "
                               "supported (decoder-only models only)")
    try:
        return config.get_text_config(decoder=True)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise UnsupportedModel(f"{config.model_type}: transformers finds no decoder config "
                               f"in it ({exc})") from None


def layer_windows(config: HFConfig) -> tuple[int, ...]:
    """Per cache layer of ``config``: 0 for full attention, else its window W (the layer
    keeps the last W - 1 tokens). ``UnsupportedModel`` for any other kind of layer."""
    text = text_config(config)
    try:
        layers = DynamicCache(config=config).layers
        kinds = get_layer_types_and_kwargs(text)[0]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        # transformers itself cannot build this config's cache (not a generative model,
        # a layer type it has no cache class for, an inconsistent KV-sharing pattern)
        raise UnsupportedModel(f"{text.model_type}: transformers builds no DynamicCache for "
                               f"this config ({type(exc).__name__}: {exc})") from None
    windows, other = [], set()
    for layer, kind in zip(layers, kinds, strict=True):
        if type(layer) is DynamicLayer:
            windows.append(0)
        elif type(layer) is DynamicSlidingWindowLayer:
            # at W = 1 transformers' slice [-W + 1:] keeps every token, not the window
            if layer.sliding_window < 2:
                raise UnsupportedModel(f"{text.model_type}: a sliding window of "
                                       f"{layer.sliding_window} is not supported (at least 2)")
            windows.append(layer.sliding_window)
        else:
            other.add(f"{kind} ({type(layer).__name__})")
    if other:
        sliding = sorted({w for w in windows if w})
        raise UnsupportedModel(f"{text.model_type}: only full-attention and sliding-window "
                               f"cache layers are supported, this config has "
                               f"{', '.join(sorted(other))}"
                               + (f" (and sliding windows {sliding})" if sliding else ""))
    return tuple(windows)
