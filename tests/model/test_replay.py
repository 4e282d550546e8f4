"""The replay primitive: rebuild window KV and tails from the global KV and the last R
tokens, never appending a global entry twice; plus the state's save/restore round trip."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import BUNDLED_WEIGHTS, load_bundled
from model.config import TINY
from model.infer import decode_step, prefill, replay, replay_batch
from model.net import KVTierLM
from model.state import KVState


@pytest.fixture(scope="module")
def tiny() -> KVTierLM:
    torch.manual_seed(0)
    return KVTierLM(TINY).eval()


def ids_of(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def continue_with(model, st, ids) -> torch.Tensor:
    return torch.stack([decode_step(model, st, int(t)) for t in ids])


def test_replay_of_every_token_reproduces_the_state(tiny):
    ids = ids_of(42)  # tail of 2
    st, _ = prefill(tiny, ids, logits="none")
    rebuilt = replay(tiny, st.without_window(), r=42)
    for name, (codes, scales) in st.ephemeral_tensors().items():
        other_codes, other_scales = rebuilt.ephemeral_tensors()[name]
        assert torch.equal(codes, other_codes), name
        assert scales is None or torch.equal(scales, other_scales), name
    more = ids_of(9, seed=4)
    assert torch.allclose(continue_with(tiny, st, more), continue_with(tiny, rebuilt, more),
                          atol=1e-4)


def test_replay_in_chunks_equals_replay_in_one_go(tiny):
    st, _ = prefill(tiny, ids_of(43), logits="none")  # tail of 3 straddles chunk edges
    whole = replay(tiny, st.without_window(), r=21)
    pieces = replay(tiny, st.without_window(), r=21, chunk=5)
    for name, (codes, _) in whole.ephemeral_tensors().items():
        other = pieces.ephemeral_tensors()[name][0]
        assert codes.shape == other.shape, name
        assert (codes.float() - other.float()).abs().max() <= 1, name


def test_batched_replay_equals_one_session_at_a_time(tiny):
    # Different lengths (so different entry counts, padded in the batch), tails of 0-3,
    # one session shorter than R (its own group), a replay longer than the chunk.
    lengths, r = (61, 130, 45, 7, 98), 40
    states = [prefill(tiny, ids_of(n, seed=n), logits="none")[0].without_window()
              for n in lengths]
    for chunk in (512, 16):
        batched = replay_batch(tiny, states, r=r, chunk=chunk)
        for state, got in zip(states, batched, strict=True):
            want = replay(tiny, state, r=r, chunk=chunk)
            assert got.n_tokens == state.n_tokens
            for name, (codes, scales) in want.ephemeral_tensors().items():
                other_codes, other_scales = got.ephemeral_tensors()[name]
                assert codes.shape == other_codes.shape, name
                # the same maths in a larger matmul: equal up to a rounding flip of a code
                assert (codes.float() - other_codes.float()).abs().max() <= 1, name
                assert scales is None or torch.allclose(scales.float(), other_scales.float(),
                                                        rtol=1e-2), name
            more = ids_of(5, seed=state.n_tokens + 1)
            assert torch.allclose(continue_with(tiny, want, more),
                                  continue_with(tiny, got, more), atol=1e-3)


def test_batched_replay_checks_every_session(tiny):
    short_r = prefill(tiny, ids_of(43), logits="none")[0].without_window()  # tail of 3
    fine = prefill(tiny, ids_of(40), logits="none")[0].without_window()
    with pytest.raises(ValueError, match="unmerged tail"):
        replay_batch(tiny, [fine, short_r], r=2)
    with pytest.raises(ValueError, match="at least one state"):
        replay_batch(tiny, [], r=8)


def test_replay_appends_no_global_entry(tiny):
    ids = ids_of(51)
    st, _ = prefill(tiny, ids, logits="none")
    evicted = st.without_window()
    assert not evicted.has_window and evicted.ephemeral_tensors() == {}
    rebuilt = replay(tiny, evicted, r=TINY.window)
    assert rebuilt.n_tokens == 51 and torch.equal(rebuilt.token_ids, ids)
    for name, (codes, scales) in st.persistent_tensors().items():
        assert torch.equal(codes, rebuilt.persistent_tensors()[name][0]), name
        assert torch.equal(scales, rebuilt.persistent_tensors()[name][1]), name
    assert rebuilt.window_len == TINY.window and rebuilt.enc_tail.shape[1] == 51 % 4
    assert not evicted.has_window  # the input state is left as it was
    continue_with(tiny, rebuilt, ids_of(6, seed=5))
    assert rebuilt.n_entries == 57 // 4  # entries resume from the stored ones


def test_replay_needs_the_tail(tiny):
    st, _ = prefill(tiny, ids_of(23), logits="none")  # tail of 3
    with pytest.raises(ValueError, match="tail"):
        replay(tiny, st.without_window(), r=2)
    with pytest.raises(ValueError):
        replay(tiny, KVState.empty(TINY))


def test_state_round_trip_through_tensor_dicts(tiny):
    ids = ids_of(30)
    st, _ = prefill(tiny, ids, logits="none")
    copy = KVState.from_tensors(TINY, st.token_ids.tolist(), st.persistent_tensors(),
                                st.ephemeral_tensors())
    cold = KVState.from_tensors(TINY, ids, copy.without_window().persistent_tensors())
    assert not cold.has_window and cold.n_entries == 7
    more = ids_of(5, seed=6)
    assert torch.equal(continue_with(tiny, st, more), continue_with(tiny, copy, more))
    assert cold.n_tokens == 30  # continuing the copy left the tensors it shares untouched


def test_from_tensors_rejects_mismatched_layouts(tiny):
    st, _ = prefill(tiny, ids_of(20), logits="none")
    persistent = st.persistent_tensors()
    with pytest.raises(ValueError, match="enc.latent"):
        KVState.from_tensors(TINY, ids_of(24), persistent)  # 6 entries expected, 5 given
    codes, scales = persistent["dec.latent"]
    with pytest.raises(ValueError, match="dec.latent"):
        KVState.from_tensors(TINY, ids_of(20), {**persistent, "dec.latent": (codes.int(), scales)})
    with pytest.raises(ValueError, match="missing"):
        KVState.from_tensors(TINY, ids_of(20), {"enc.latent": persistent["enc.latent"]})


@pytest.mark.slow
@pytest.mark.skipif(not BUNDLED_WEIGHTS.exists(), reason="weights not trained yet")
def test_trained_replay_of_one_window_is_close():
    """R = W: the first replayed tokens see a truncated window, the accepted approximation;
    the next-token distributions must stay close to the never-evicted state's."""
    model = load_bundled()
    text = (b"class Reader:\n    def __init__(self, path):\n        self.path = path\n"
            b"        self.lines = []\n\n    def read(self):\n        with open(self.path) as f:\n"
            b"            for line in f:\n                self.lines.append(line.rstrip())\n")
    ids = torch.tensor(list(text * 2), dtype=torch.int64)
    cut = 330
    st, _ = prefill(model, ids[:cut], logits="none")
    rebuilt = replay(model, st.without_window(), r=model.cfg.window)
    more = ids[cut:cut + 40]
    exact = torch.softmax(continue_with(model, st, more), -1)
    approx = torch.softmax(continue_with(model, rebuilt, more), -1)
    total_variation = 0.5 * (exact - approx).abs().sum(-1)
    assert total_variation.mean().item() < 0.05, total_variation
    assert (exact.argmax(-1) == approx.argmax(-1)).float().mean().item() > 0.9
