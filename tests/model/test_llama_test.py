"""The committed Llama test model (model/weights/llama_test) has learned: on held-out
text it beats gzip -9 on the same bytes clearly, at positions past its first stage's 512
as well (the second stage's 2,048-byte sequences)."""

import pytest

pytest.importorskip("transformers")

from model.train_llama import evaluate  # noqa: E402


def test_the_llama_test_model_beats_gzip_on_held_out_text():
    figures = evaluate(stretches=2, length=2048)
    assert figures["bits_per_byte"] < 0.85 * figures["gzip_bits_per_byte"], figures
