import dataclasses
import json
import math
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvstore.format.errors import InvalidRequest, UnknownLayout
from kvstore.format.layout import (
    BaselineKV,
    LayoutSpec,
    Stream,
    layout_from_json,
    layout_to_json,
)
from kvstore.format.registry import get_layout, register_layout
from tests.support.chunks import layouts, streams


def test_first_generation_gqa_computes_389120():
    assert get_layout("deepseek-llm-67b").persistent_bytes_per_token == 389_120


def test_mla_generation_computes_70272():
    assert get_layout("deepseek-v3").persistent_bytes_per_token == 70_272


def test_quantized_stream_counts_scales_and_merging():
    # 128 int4 values = 64 bytes + 4 fp16 scales = 72 bytes per entry, 2 layers, m = 4.
    s = Stream("x", (128,), bits=4, group_size=32, tokens_per_entry=4, layers=2)
    assert s.bytes_per_entry == 72
    assert s.bytes_per_token == 36
    assert s.codes_shape == (64,)


def test_window_streams_are_not_persistent_bytes():
    spec = get_layout("kvtier-bundled")
    # Persisted, per token (int4 codes + one fp16 scale per 32 values, m = 4):
    #   enc.latent      (32 + 2*2) B x 2 layers / 4 = 18
    #   enc.index_keys  (16 + 1*2) B x 2 layers / 4 =  9
    #   dec.latent      (32 + 2*2) B x 1 layer  / 4 =  9
    assert spec.persistent_bytes_per_token == 36
    # Window, per token (int8 codes + one fp16 scale per 64 values), k and v:
    #   2 x (4*64 + 4*2) B x 4 layers = 2,112
    assert spec.ephemeral_bytes_per_token == 2_112
    # Pending rows: bf16 256 values x (2 + 1) layers = 1,536 B, at most m - 1 = 3 of them.
    assert spec.pending_bytes_max == 4_608
    # Plain cache: K and V, 8 layers x 4 heads x 64 dims x 2 B.
    assert spec.bf16_baseline_bytes_per_token == 8_192


def test_flash_like_layout_computes_432():
    spec = get_layout("flash-4.1-like")
    # (256 + 16*2) B x 4 / 4 + (64 + 4*2) B x 4 / 4 + (256 + 16*2) B x 1 / 4 = 288 + 72 + 72
    assert spec.persistent_bytes_per_token == 432
    # Window: (512 + 8*2) B x 20 encoder layers.
    assert spec.ephemeral_bytes_per_token == 10_560
    assert spec.bf16_baseline_bytes_per_token == 2 * 40 * 8 * 128 * 2


def test_bundled_layout_is_at_most_a_hundredth_of_bf16():
    spec = get_layout("kvtier-bundled")
    assert spec.persistent_bytes_per_token * 100 <= spec.bf16_baseline_bytes_per_token


def test_layout_id_changes_with_streams_and_lookup_by_id():
    spec = get_layout("deepseek-v3")
    assert get_layout(spec.layout_id) is spec
    with pytest.raises(UnknownLayout):
        get_layout("deepseek-v3@0000000000000000")
    other = LayoutSpec("tmp", (Stream("latent", (576,), bits=16, layers=60),), chunk_tokens=16)
    assert (
        other.layout_hash
        != LayoutSpec(
            "tmp", (Stream("latent", (576,), bits=16, layers=61),), chunk_tokens=16
        ).layout_hash
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bits=3, group_size=0),
        dict(bits=4, group_size=0),
        dict(bits=4, group_size=48),  # does not divide 128
        dict(bits=16, group_size=32),
    ],
)
def test_invalid_streams_are_refused(kwargs):
    with pytest.raises(InvalidRequest):
        Stream("bad", (128,), **kwargs)


def test_chunk_must_hold_whole_entries():
    with pytest.raises(InvalidRequest, match="multiple"):
        LayoutSpec("odd", (Stream("a", (8,), 4, 8, tokens_per_entry=4),), chunk_tokens=6)


def test_unknown_layout_names_the_known_ones():
    with pytest.raises(UnknownLayout, match="deepseek-v3"):
        get_layout("nope")


def test_baseline_is_plain_bf16_k_and_v():
    assert BaselineKV(layers=95, kv_heads=8, head_dim=128).bytes_per_token == 389_120


def test_cli_json_reproduces_reference_figures():
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "layouts", "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["deepseek-llm-67b"]["persistent_bytes_per_token"] == 389_120
    assert rows["deepseek-v3"]["persistent_bytes_per_token"] == 70_272
    assert {"flash-4.1-like", "kvtier-bundled"} <= set(rows)
    for row in rows.values():
        for key in ("ephemeral_bytes_per_token", "bf16_baseline_bytes_per_token"):
            assert key in row


def by_hand_bytes_per_token(s: Stream, chunk_tokens: int) -> Fraction:
    values = 1
    for d in s.entry_shape:
        values *= d
    codes = Fraction(values * s.bits, 8)  # int4 packs two values per byte
    # one fp16 per group (int4, int8); fp8: one float32 per layer per chunk
    scales = 2 * values // s.group_size if s.format in ("int4", "int8") else 0
    per_chunk = Fraction(4 * s.layers, chunk_tokens) if s.format == "fp8_e4m3" else 0
    return (codes + scales) * s.layers / s.tokens_per_entry + per_chunk


@settings(max_examples=80, deadline=None)
@given(layouts())
def test_bytes_per_token_match_an_independent_count(spec):
    want = sum(by_hand_bytes_per_token(s, spec.chunk_tokens) for s in spec.streams)
    assert spec.persistent_bytes_per_token == pytest.approx(float(want), rel=1e-12)
    assert spec.ephemeral_bytes_per_token == 0
    plain = spec.baseline.bytes_per_token if spec.baseline else sum(
        2 * s.layers * math.prod(s.entry_shape) for s in spec.streams)
    assert spec.bf16_baseline_bytes_per_token == plain


@settings(max_examples=80, deadline=None)
@given(layouts(), st.data())
def test_layout_hash_is_stable_for_equal_specs_and_changes_with_any_field(spec, data):
    # An equal spec built from fresh parts (other notes) has the same hash and id.
    fresh = LayoutSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                          if f.name not in ("streams", "notes")},
                       streams=tuple(Stream(**dataclasses.asdict(s)) for s in spec.streams),
                       notes="other notes")
    assert fresh.layout_hash == spec.layout_hash and fresh.layout_id == spec.layout_id
    # Changing any one field changes the hash.
    i = data.draw(st.integers(0, len(spec.streams) - 1))
    others = {s.name for j, s in enumerate(spec.streams) if j != i}
    changes = {
        "name": lambda: {"name": spec.name + "x"},
        "chunk_tokens": lambda: {"chunk_tokens": spec.chunk_tokens + 12},
        "layer_modes": lambda: {"layer_modes": (*spec.layer_modes, "reindex")},
        "baseline": lambda: {"baseline": None if spec.baseline else BaselineKV(1, 1, 1)},
        "stream": lambda: {"streams": tuple(
            data.draw(streams(data.draw(st.sampled_from(sorted(set("abcdefg") - others)))))
            if j == i else s for j, s in enumerate(spec.streams))},
        "stream order": lambda: {"streams": spec.streams[::-1]},
    }
    changed = dataclasses.replace(spec, **changes[data.draw(st.sampled_from(sorted(changes)))]())
    assume(changed != spec)
    assert changed.layout_hash != spec.layout_hash


def test_an_unknown_layout_error_names_the_presets_but_no_registered_layout():
    register_layout(LayoutSpec("tenant-private-layout", (Stream("k", (8,), bits=16),),
                               chunk_tokens=16))
    with pytest.raises(UnknownLayout) as err:
        get_layout("no-such-layout")
    message = str(err.value)
    assert "kvtier-bundled" in message and "registered" in message
    assert "tenant-private-layout" not in message


def test_a_page_entry_is_bounded_by_bytes_not_values():
    """A page stream's entry is one engine block of one layer: up to 4 MiB of opaque bytes
    may register, where other entries stop at 2^20 values; past that it is refused."""
    from kvstore.format.layout import LayoutSpec, Stream
    from kvstore.format.layout_bounds import check_bounds

    def spec(entry: tuple[int, ...], fmt: str, bits: int) -> LayoutSpec:
        return LayoutSpec("bounded", (Stream("s", entry, bits=bits, format=fmt,
                                             tokens_per_entry=64),), chunk_tokens=64)

    room = 64 << 20
    check_bounds(spec((2, 1 << 20), "page", 8), room)  # 2 MiB of page bytes
    with pytest.raises(InvalidRequest, match="at most 4 dimensions and 1048576 values"):
        check_bounds(spec((2, 1 << 20), "bf16", 16), room)
    with pytest.raises(InvalidRequest, match="4194304 values"):
        check_bounds(spec((8, 1 << 20), "page", 8), room)


def test_replay_tokens_is_stated_in_json_only_when_set_and_not_hashed():
    bundled = get_layout("kvtier-bundled")
    assert bundled.replay_tokens == 256  # the R its replay is faithful from
    unstated = dataclasses.replace(bundled, replay_tokens=0)
    assert unstated.layout_id == bundled.layout_id  # it shapes no byte
    assert '"replay_tokens":256' in layout_to_json(bundled)
    assert "replay_tokens" not in layout_to_json(unstated)
    assert layout_from_json(layout_to_json(bundled)) == bundled
    for bad in (-1, 8193):
        with pytest.raises(InvalidRequest, match="replay_tokens"):
            dataclasses.replace(bundled, replay_tokens=bad)
    with pytest.raises(InvalidRequest, match="replay_tokens"):  # nothing replays it
        dataclasses.replace(bundled, replayer="none", replay_tokens=128)
    # a second registration stating another R is refused, as one of another replayer
    with pytest.raises(InvalidRequest, match="replay_tokens 256, not 0"):
        register_layout(unstated)


def test_a_layout_of_window_streams_alone_has_chunks_of_token_ids():
    # an all-sliding model keeps nothing per token but its ids; a layout with neither
    # persistent nor window streams is still refused
    from kvstore.format.chunk import decode_chunk, encode_chunk
    from kvstore.format.layout_bounds import check_bounds

    window = Stream("window.k", (2, 8), bits=16, layers=3, persistent=False)
    spec = LayoutSpec(name="all-sliding", streams=(window,), chunk_tokens=16, window_tokens=15)
    check_bounds(spec, 4 << 20)
    chunk = encode_chunk(spec, 0, np.arange(16), {})
    assert decode_chunk(chunk, spec, token_ids=np.arange(16)).streams == {}
    pending = Stream("buf", (4,), bits=16, persistent=False, pending=True)
    with pytest.raises(InvalidRequest, match="one persistent at least or window"):
        check_bounds(LayoutSpec(name="none", streams=(pending,), chunk_tokens=16), 4 << 20)
