"""Layouts at run time (issue 16): the canonical layout encoding and id, the
deepseek-v4.1-flash preset against the report's 890 B/token, and (over real servers)
RegisterLayout / ListLayouts, their refusals and persistence, and Resume on a layout
nothing here can replay."""

from __future__ import annotations

import json

import pytest
import xxhash

from kvstore.errors import InvalidRequest
from kvstore.layout import (
    BaselineKV,
    LayoutSpec,
    Stream,
    all_layouts,
    get_layout,
    layout_from_json,
    layout_to_json,
)
from kvstore.presets import V41_FLASH_CONFIG, deepseek_v41_layout

# deepseek-v3's canonical encoding, written out: sorted keys, no spaces, every stream
# field, no notes, no baseline (it has none).
V3_JSON = ('{"chunk_tokens":16,"name":"deepseek-v3","replayer":"none",'
           '"requires_model_fingerprint":false,"streams":[{"bits":16,"entry_shape":[576],'
           '"group_size":0,"layers":61,"name":"latent","pending":false,"persistent":true,'
           '"tokens_per_entry":1}],"vocab_size":129280,"window_tokens":0}')


def test_canonical_encoding_of_a_preset_is_pinned_and_hashed_without_replayer():
    spec = get_layout("deepseek-v3")
    assert layout_to_json(spec) == V3_JSON
    hashed = V3_JSON.replace(',"replayer":"none"', "").encode()
    assert spec.layout_hash == xxhash.xxh3_64_intdigest(hashed, seed=0)
    assert spec.layout_id == "deepseek-v3@b623b41edf7f24f0"  # pinned: ids must not drift
    assert get_layout("kvtier-bundled").layout_id == "kvtier-bundled@02d2b71436373009"


@pytest.mark.parametrize("spec", all_layouts(), ids=lambda s: s.name)
def test_every_preset_round_trips_through_its_canonical_json(spec):
    text = layout_to_json(spec)
    assert text.isascii() and " " not in text
    obj = json.loads(text)
    assert "notes" not in obj and obj["replayer"] == spec.replayer
    back = layout_from_json(text)
    assert back == spec and back.layout_id == spec.layout_id
    assert layout_to_json(back) == text
    # Any other encoding of the same object canonicalises to the same text.
    spaced = json.dumps(dict(reversed(obj.items())), indent=3)
    assert layout_to_json(layout_from_json(spaced)) == text


def test_the_replayer_does_not_change_the_id_and_optional_keys_take_defaults():
    window = Stream("w", (8,), bits=8, group_size=8, persistent=False)
    base = LayoutSpec("rt", (Stream("a", (8,), bits=16), window), chunk_tokens=4,
                      window_tokens=16)
    bundled = LayoutSpec("rt", base.streams, chunk_tokens=4, window_tokens=16,
                         replayer="bundled")
    assert base.layout_id == bundled.layout_id and base != bundled
    short = layout_from_json('{"name":"rt","chunk_tokens":4,"window_tokens":16,"streams":'
                             '[{"name":"a","entry_shape":[8],"bits":16},{"name":"w",'
                             '"entry_shape":[8],"bits":8,"group_size":8,"persistent":false}]}')
    assert short == base
    with_baseline = LayoutSpec("rt2", base.streams, chunk_tokens=4, window_tokens=16,
                               baseline=BaselineKV(2, 1, 8), layer_modes=("full", "reuse"))
    assert layout_from_json(layout_to_json(with_baseline)) == with_baseline


@pytest.mark.parametrize("text, why", [
    ("{", "does not parse"),
    ('{"name":"x","chunk_tokens":4.0,"streams":[]}', "only integers"),
    ('{"name":"x","chunk_tokens":true,"streams":[]}', "chunk_tokens must be a JSON int"),
    ('{"name":"x","chunk_tokens":4,"streams":[],"color":"red"}', "unknown keys"),
    ('{"name":"x","chunk_tokens":4}', "missing keys"),
    ('{"name":"x","name":"y","chunk_tokens":4,"streams":[]}', "repeats a key"),
    ('{"name":"a@b","chunk_tokens":4,"streams":[]}', "layout name"),
    ('{"name":"x","chunk_tokens":4,"streams":[{"name":"s","entry_shape":[8.5],"bits":16}]}',
     "only integers"),
    ('{"name":"x","chunk_tokens":4,"streams":[{"name":"s","entry_shape":[true],"bits":16}]}',
     "must list integers"),
    ('{"name":"x","chunk_tokens":4,"streams":[{"name":"s","entry_shape":[8],"bits":16}],'
     '"replayer":"bundled"}', "nothing to replay"),
    ('{"name":"x","chunk_tokens":4,"streams":[{"name":"s","entry_shape":[8],"bits":16}],'
     '"replayer":"vllm"}', "replayer must be one of"),
    ('{"name":"x","chunk_tokens":4,"streams":[],"vocab_size":NaN}', "only integers"),
    ("[" * 100_000, "does not parse"),
])
def test_bad_layout_json_is_refused_by_name(text, why):
    with pytest.raises(InvalidRequest, match=why):
        layout_from_json(text)


def test_v41_flash_preset_reaches_890_bytes_per_token_with_one_byte_scales():
    spec = get_layout("deepseek-v4.1-flash")
    assert spec == deepseek_v41_layout(V41_FLASH_CONFIG)
    streams = {s.name: s for s in spec.persistent_streams}
    # KV sources 2, 8, 14 pool m = 2 tokens; source 20 (the decoder's) m = 1.
    assert {n: (s.entry_shape, s.bits, s.group_size, s.tokens_per_entry, s.layers)
            for n, s in streams.items()} == {
        "enc.kv": ((512,), 4, 16, 2, 3), "enc.index_keys": ((128,), 4, 32, 2, 3),
        "dec.kv": ((512,), 4, 16, 1, 1), "dec.index_keys": ((128,), 4, 32, 1, 1)}
    # kvtier's fp16 scales: (256 + 32*2) x 3/2 + (64 + 4*2) x 3/2 + 320 + 72 = 980.
    assert spec.persistent_bytes_per_token == 980
    # The reference's 1-byte scales (e4m3 for the KV, ue8m0 for the indexer keys):
    # (256 + 32) x 3/2 + (64 + 4) x 3/2 + 288 + 68 = 890, the report's figure.
    one_byte = sum(s.layers * (s.values_per_entry * s.bits // 8 + s.scales_per_entry)
                   / s.tokens_per_entry for s in streams.values())
    assert one_byte == 890
    assert 389_120 // 890 == 437  # the report's 437x from deepseek-llm-67b
    # Window: 40 layers of one 512-dim K=V latent, int8 per 32 values; the pending rows
    # of an unclosed ratio-2 group: kv + gate, at most m - 1 = 1 token of 3 layers.
    assert spec.ephemeral_bytes_per_token == 40 * (512 + 16 * 2)
    assert spec.pending_bytes_max == 3 * 1024 * 2
    assert spec.window_tokens == 128 and spec.vocab_size == 129_280
    assert spec.layer_modes.count("full") == 4 and spec.layer_modes.count("reindex") == 4
    assert spec.replayer == "none"
