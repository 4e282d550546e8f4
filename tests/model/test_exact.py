"""Exactness of the bundled model's inference path: token-by-token decoding, chunked prefill
and the float training forward all compute the same logits (same quantization applied).

TINY (window 8, block 4, pool 6, top-k 3) reaches every boundary within a few dozen tokens;
one test runs the trained weights past W = 128 and the 64-entry pool.
"""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import BUNDLED_WEIGHTS, load_bundled
from model.config import TINY
from model.dense import forward_train
from model.infer import decode_step, prefill
from model.net import KVTierLM
from model.state import KVState

# Both paths quantize activations that come out of matmuls of different shapes (one row in
# a decode step, many in a prefill); BLAS rounds those differently in the last bit, so an
# element lying on a rounding boundary can land one int8/int4 step apart, and once in a
# while a near-tie in the indexer resolves the other way. Such events are rare and small;
# a real bug (a wrong position, mask or entry) moves every later logit by far more.


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    per_position = (a - b).abs().amax(-1)  # (T,)
    assert per_position.median().item() < 1e-2, per_position
    assert (a - b).abs().mean().item() < 2e-3, per_position
    assert per_position.max().item() < 0.5, per_position


@pytest.fixture(scope="module")
def tiny() -> KVTierLM:
    torch.manual_seed(0)
    return KVTierLM(TINY).eval()


def ids_of(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def decode_all(model: KVTierLM, ids: torch.Tensor, warm: int) -> tuple[KVState, torch.Tensor]:
    st, first = prefill(model, ids[:warm], logits="all")
    rows = [first] + [decode_step(model, st, int(t))[None] for t in ids[warm:]]
    return st, torch.cat(rows)


def test_decode_matches_one_forward(tiny):
    ids = ids_of(70)  # 17 entries > pool 6, window 8 crossed many times, tail of 2
    _, whole = prefill(tiny, ids, logits="all")
    st, stepped = decode_all(tiny, ids, warm=1)
    assert_same_logits(whole, stepped)
    assert st.n_tokens == 70 and st.n_entries == 17 and st.window_len == TINY.window
    assert st.enc_tail.shape == (len(TINY.full_layers), 2, TINY.width)


@pytest.mark.parametrize("chunk", [1, 3, 4, 9])
def test_chunked_prefill_matches_one_forward(tiny, chunk):
    ids = ids_of(45, seed=chunk)
    _, whole = prefill(tiny, ids, logits="all")
    _, pieces = prefill(tiny, ids, logits="all", chunk=chunk)
    assert_same_logits(whole, pieces)


def test_persistent_state_identical_across_paths(tiny):
    ids = ids_of(37)
    whole, _ = prefill(tiny, ids, logits="none")
    stepped, _ = decode_all(tiny, ids, warm=3)
    for name, (codes, scales) in whole.persistent_tensors().items():
        other_codes, other_scales = stepped.persistent_tensors()[name]
        # codes may differ by one step in rare elements (see ATOL); nowhere by more
        assert (codes.view(torch.int8).int() - other_codes.view(torch.int8).int()
                ).abs().float().mean() < 0.01, name
        assert torch.allclose(scales.float(), other_scales.float(), rtol=1e-2), name


def test_training_forward_matches_inference(tiny):
    ids = ids_of(48)  # a multiple of window and block, as training needs
    _, infer = prefill(tiny, ids, logits="all")
    with torch.no_grad():
        train, _ = forward_train(tiny, ids[None], sparse=True)
    assert_same_logits(train[0], infer)


def test_last_logits_equal_last_row_of_all(tiny):
    ids = ids_of(23)
    _, last = prefill(tiny, ids)
    _, every = prefill(tiny, ids, logits="all")
    assert last.shape == (256,)
    assert torch.allclose(last, every[-1], atol=1e-5)


def test_bad_input_is_rejected(tiny):
    with pytest.raises(ValueError, match="token ids"):
        prefill(tiny, [1, 2, 256])
    with pytest.raises(ValueError, match="at least one"):
        prefill(tiny, [])
    with pytest.raises(ValueError, match="logits"):
        prefill(tiny, [1], logits="first")
    st, _ = prefill(tiny, ids_of(10))
    with pytest.raises(ValueError, match="replay"):
        decode_step(tiny, st.without_window(), 5)


@pytest.mark.slow
@pytest.mark.skipif(not BUNDLED_WEIGHTS.exists(), reason="weights not trained yet")
def test_trained_weights_decode_matches_one_forward():
    model = load_bundled()
    ids = torch.tensor(list(b"def parse(self, text):\n    return [line.strip() for line in "
                            b"text.splitlines() if line]\n" * 4), dtype=torch.int64)[:300]
    _, whole = prefill(model, ids, logits="all")
    st, stepped = decode_all(model, ids, warm=250)
    assert st.n_entries == 75 > model.cfg.pool and st.window_len == 128
    assert_same_logits(whole, stepped)
