"""The bundled model's cache layout: derived from its config, matching kvstore's preset,
at most 1/100 of the plain bf16 cache, and matching the bytes a real state holds."""

from __future__ import annotations

import torch

from kvstore.format.registry import get_layout
from model.config import BUNDLED, TINY, layout_spec
from model.infer import prefill
from model.net import KVTierLM


def state_bytes(tensors: dict) -> int:
    return sum(t.nbytes for pair in tensors.values() for t in pair if t is not None)


def test_persistent_bytes_at_most_one_hundredth_of_bf16():
    spec = layout_spec(BUNDLED)
    # 8 layers x (K, V) x width 256 x 2 bytes
    assert spec.bf16_baseline_bytes_per_token == 8 * 2 * 256 * 2
    assert spec.persistent_bytes_per_token <= spec.bf16_baseline_bytes_per_token / 100
    assert spec.persistent_bytes_per_token == 36.0  # enc 2 x 9 + index 2 x 4.5 + dec 9


def test_derived_spec_is_kvstores_bundled_preset():
    derived, preset = layout_spec(BUNDLED), get_layout("kvtier-bundled")
    assert derived.streams == preset.streams
    assert derived.chunk_tokens == preset.chunk_tokens
    assert derived.baseline == preset.baseline
    assert derived.layout_hash == preset.layout_hash


def test_state_holds_exactly_the_bytes_the_spec_computes():
    torch.manual_seed(0)
    model = KVTierLM(TINY).eval()
    n = 40  # a multiple of m: no partial entry
    st, _ = prefill(model, torch.randint(0, 256, (n,)), logits="none")
    spec = layout_spec(TINY, name="tiny")
    assert state_bytes(st.persistent_tensors()) == spec.persistent_bytes_per_token * n
    window = {k: v for k, v in st.ephemeral_tensors().items() if k.startswith("enc.window")}
    per_token = sum(spec.stream(k).bytes_per_token for k in window)
    assert state_bytes(window) == per_token * TINY.window
    for name, (codes, scales) in st.persistent_tensors().items():
        stream = spec.stream(name)
        assert codes.shape == (stream.layers, n // stream.tokens_per_entry,
                               *stream.codes_shape), name
        assert scales.shape[-1] == stream.scales_per_entry, name
