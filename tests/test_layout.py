import json
import subprocess
import sys

import pytest

from kvstore.errors import InvalidRequest, UnknownLayout
from kvstore.layout import BaselineKV, LayoutSpec, Stream, get_layout


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
    assert spec.ephemeral_bytes_per_token > 0
    assert spec.persistent_bytes_per_token == sum(
        s.bytes_per_token for s in spec.streams if s.persistent
    )


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
