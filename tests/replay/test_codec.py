"""replay.state_codec: a model state survives kvstore bytes exactly, keys chain like the
store's, and bytes that do not fit the session are refused, never decoded into a state."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvstore.format.checks import check_spill
from kvstore.format.chunk import split_chunks
from kvstore.format.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch
from kvstore.format.keys import block_keys, dedupe_scope
from model.config import TINY, layout_spec
from model.infer import prefill, replay
from model.net import KVTierLM
from replay.state_codec import as_token_array, state_from_chunks, state_to_chunks

SPEC = layout_spec(TINY, name="tiny-codec")  # chunk_tokens 16, m 4, W 8


@pytest.fixture(scope="module")
def model() -> KVTierLM:
    torch.manual_seed(0)
    return KVTierLM(TINY).eval()


def make_state(model: KVTierLM, n: int, seed: int = 1):
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
    return prefill(model, ids, logits="none")[0]


def tensors(state) -> list[torch.Tensor]:
    out = [state.token_ids]
    for pair in (*state.persistent_tensors().values(), *state.ephemeral_tensors().values()):
        out.extend(t for t in pair if t is not None)
    return out


def assert_same(a, b) -> None:
    ta, tb = tensors(a), tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.uint8) if y.dtype == torch.bfloat16 else y)


@pytest.mark.parametrize("n", [3, 16, 45, 48])
def test_round_trip_is_exact(model, n):
    state = make_state(model, n)
    chunks, tail, window = state_to_chunks(SPEC, state)
    assert len(chunks) == n // 16
    assert bool(tail) == (n % 16 > 0)
    check_spill(SPEC, as_token_array(state.token_ids), chunks, tail, window,
                scope="")  # the store agrees
    back = state_from_chunks(TINY, state.token_ids, [c for _, c in chunks], tail, window,
                             spec=SPEC)
    assert back.window_len == state.window_len
    assert_same(back, state)


def test_keys_chain_like_the_store_and_dedupe_shared_prefixes(model):
    a, b = make_state(model, 40, seed=2), make_state(model, 40, seed=2)
    b_ids = torch.cat((a.token_ids[:32], torch.tensor([7, 7, 7, 7])))
    b = prefill(model, b_ids, logits="none")[0]
    scope = dedupe_scope("acme")
    chunks_a = state_to_chunks(SPEC, a, scope=scope)[0]
    keys_a = [k for k, _ in chunks_a]
    keys_b = [k for k, _ in state_to_chunks(SPEC, b, scope=scope)[0]]
    assert keys_a == block_keys(SPEC.layout_id, as_token_array(a.token_ids), 16,
                                [c for _, c in chunks_a], scope=scope)
    assert keys_a == keys_b  # 32 shared tokens: both full chunks are the same, byte for byte
    c = make_state(model, 40, seed=3)
    assert [k for k, _ in state_to_chunks(SPEC, c, scope=scope)[0]][0] != keys_a[0]
    # another domain or model fingerprint: other keys for the same chunks
    assert state_to_chunks(SPEC, a, scope=dedupe_scope("beta"))[0][0][0] != keys_a[0]
    assert state_to_chunks(SPEC, a, scope=scope, model_fingerprint="ft")[0][0][0] != keys_a[0]


def test_without_window_decodes_to_a_state_replay_can_rebuild(model):
    state = make_state(model, 45)
    chunks, tail, _ = state_to_chunks(SPEC, state)
    cold = state_from_chunks(TINY, state.token_ids, [c for _, c in chunks], tail, None,
                             spec=SPEC)
    assert not cold.has_window
    assert_same(replay(model, cold, 8), replay(model, state.without_window(), 8))
    assert state_to_chunks(SPEC, cold)[2] is None


def test_bytes_that_do_not_fit_are_refused(model):
    state = make_state(model, 45)
    chunks, tail, window = state_to_chunks(SPEC, state)
    raw = [c for _, c in chunks]
    ids = state.token_ids

    def decode(**changes):
        args = dict(token_ids=ids, chunks=raw, tail=tail, window=window)
        args.update(changes)
        return state_from_chunks(TINY, args["token_ids"], args["chunks"], args["tail"],
                                 args["window"], spec=SPEC)

    other = ids.clone()
    other[3] = (other[3] + 1) % 256
    with pytest.raises(LayoutMismatch, match="other token ids"):
        decode(token_ids=other)
    with pytest.raises(InvalidRequest, match="full chunks"):
        decode(chunks=raw[:1])
    with pytest.raises(InvalidRequest, match="tail"):
        decode(tail=b"")
    with pytest.raises(InvalidRequest, match="chunk of tokens 0..15, got one of 16 tokens from 16"):
        decode(chunks=[raw[1], raw[0]])
    flipped = bytearray(raw[1])
    flipped[-5] ^= 0x40
    with pytest.raises(ChunkCorrupt):
        decode(chunks=[raw[0], bytes(flipped)])
    with pytest.raises(LayoutMismatch, match="does not describe this model"):
        state_from_chunks(TINY, ids, raw, tail, window, spec=layout_spec(
            replace(TINY, kv_heads=2), name="tiny-codec"))


def test_a_window_without_its_pending_rows_is_refused(model):
    state = make_state(model, 45)  # 45 % 4 = 1 pending row
    chunks, tail, window = state_to_chunks(SPEC, state)
    parts = split_chunks(window)
    assert len(parts) == 2
    with pytest.raises(InvalidRequest, match="pending rows"):
        state_from_chunks(TINY, state.token_ids, [c for _, c in chunks], tail,
                          bytes(parts[0]), spec=SPEC)
    # the pending rows alone are no window either
    with pytest.raises(InvalidRequest, match="lacks streams"):
        state_from_chunks(TINY, state.token_ids, [c for _, c in chunks], tail,
                          bytes(parts[1]), spec=SPEC)
