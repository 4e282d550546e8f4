"""Training pieces: the data split, deterministic batches, where gradients flow, the weights
file format, and the shipped weights themselves."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from model import checkpoint
from model.config import BUNDLED, TINY
from model.data import HELD_OUT, BatchSampler, source_files, stdlib_root
from model.dense import forward_train
from model.infer import prefill
from model.net import KVTierLM


def test_held_out_packages_never_reach_training():
    root = stdlib_root()
    train = {p.relative_to(root).parts[0] for p in source_files(held_out=False)}
    held = {p.relative_to(root).parts[0] for p in source_files(held_out=True)}
    assert held == set(HELD_OUT)
    assert not train & held
    assert all("test" not in p.parts for p in source_files(held_out=False))


def test_batches_depend_only_on_the_seed():
    data = bytes(range(256)) * 40
    a, b = BatchSampler(data, 64, 4, seed=7), BatchSampler(data, 64, 4, seed=7)
    first, second = a.next(), a.next()
    assert torch.equal(first, b.next()) and torch.equal(second, b.next())
    assert not torch.equal(first, second)
    assert first.shape == (4, 65) and first.dtype == torch.int64
    # consecutive bytes: the windows really are contiguous slices of the data
    assert torch.equal((first[:, 1:] - first[:, :-1]) % 256, torch.ones(4, 64, dtype=torch.int64))


def test_indexer_learns_only_from_its_loss_and_the_rest_only_from_the_lm_loss():
    torch.manual_seed(0)
    model = KVTierLM(TINY)
    ids = torch.randint(0, 256, (2, 33))
    logits, aux = forward_train(model, ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward(retain_graph=True)
    layer = model.encoder[0]
    assert layer.indexer.q.weight.grad is None and layer.index_key.proj.weight.grad is None
    assert layer.latent.proj.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    aux.backward()
    assert layer.indexer.q.weight.grad.abs().sum() > 0
    assert layer.index_key.proj.weight.grad.abs().sum() > 0
    assert model.embed.weight.grad is None and layer.wq.weight.grad is None


def test_weights_round_trip_through_safetensors(tmp_path):
    torch.manual_seed(0)
    model = KVTierLM(TINY).eval()
    path = tmp_path / "w.safetensors"
    checkpoint.save(model, path)
    loaded = checkpoint.load(path)
    assert loaded.cfg == TINY and path.with_suffix(".json").exists()
    with torch.no_grad():  # stored as fp16: compare against the fp16-rounded original
        for p in model.parameters():
            p.copy_(p.half().float())
    ids = torch.randint(0, 256, (20,))
    assert torch.equal(prefill(model, ids)[1], prefill(loaded, ids)[1])


def test_loading_a_missing_file_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.train"):
        checkpoint.load(tmp_path / "none.safetensors")


@pytest.mark.skipif(not checkpoint.BUNDLED_WEIGHTS.exists(), reason="weights not trained yet")
def test_shipped_weights_fit_the_budget_and_predict_python():
    assert checkpoint.BUNDLED_WEIGHTS.stat().st_size <= 16 * 2**20
    model = checkpoint.load_bundled()
    assert model.cfg == BUNDLED
    text = b"import os\nimport sys\n\n\ndef main():\n    for name in sorted(os.listdir(path)):\n"
    ids = torch.tensor(list(text), dtype=torch.int64)
    _, logits = prefill(model, ids, logits="all")
    bits = F.cross_entropy(logits[:-1], ids[1:]) / torch.log(torch.tensor(2.0))
    assert bits.item() < 4.0  # uniform guessing is 8 bits/byte


@pytest.mark.slow
def test_training_script_is_deterministic_and_writes_its_outputs(tmp_path):
    from model.train import TrainConfig, train

    tc = TrainConfig(preset="tiny", steps=2, batch=2, long_steps=1, long_batch=1,
                     long_seq_len=1024)
    weights = [tmp_path / run / "bundled.safetensors" for run in ("a", "b")]
    threads = torch.get_num_threads()
    try:
        logs = [train(tc, path) for path in weights]
    finally:  # train() sets process-wide torch flags
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    assert logs[0]["bits_per_byte"] == logs[1]["bits_per_byte"]
    assert len(logs[0]["bits_per_byte"]) == 3 and logs[0]["stage_starts"] == [0, 2]
    assert weights[0].read_bytes() == weights[1].read_bytes()
    for name in ("bundled.json", "loss_curve.png", "train_log.json"):
        assert (weights[0].parent / name).stat().st_size > 0
