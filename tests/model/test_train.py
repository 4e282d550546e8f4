"""Training pieces: the data split, deterministic batches, where gradients flow, the weights
file format, and the shipped weights themselves."""

from __future__ import annotations

from dataclasses import replace

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


def tiny_plan(**changes):
    from model.train import Stage, TrainConfig

    stages = (Stage(3, 2, 64, 1e-3, 1, dense_steps=1), Stage(2, 1, 128, 5e-4, 1))
    return TrainConfig(preset="tiny", stages=stages, checkpoint_every=2, index_leak=0.1,
                       linear_dtype="bfloat16", **changes)


def restore_torch_flags(threads):
    torch.use_deterministic_algorithms(False)  # train() sets process-wide torch flags
    torch.set_num_threads(threads)


def test_a_resumed_run_ends_with_the_same_bytes_as_a_straight_one(tmp_path, monkeypatch):
    from model import train as train_mod

    monkeypatch.setattr(train_mod, "plot", lambda *a: None)  # matplotlib: seconds, not needed
    tc, threads = tiny_plan(), torch.get_num_threads()
    straight, pieces = tmp_path / "a" / "w.safetensors", tmp_path / "b" / "w.safetensors"
    try:
        log = train_mod.train(tc, straight, tmp_path / "a" / "ckpt")
        # stop inside stage 1 (past a checkpoint), then at the stage boundary, then finish
        assert train_mod.train(tc, pieces, tmp_path / "b" / "ckpt", until=3) is None
        assert not pieces.exists()
        assert train_mod.train(tc, pieces, tmp_path / "b" / "ckpt", resume=True,
                               until=4) is None
        resumed = train_mod.train(tc, pieces, tmp_path / "b" / "ckpt", resume=True)
        with pytest.raises(ValueError, match="another TrainConfig"):
            train_mod.train(replace(tc, seed=1), pieces, tmp_path / "b" / "ckpt", resume=True)
    finally:
        restore_torch_flags(threads)
    assert straight.read_bytes() == pieces.read_bytes()
    assert resumed["bits_per_byte"] == log["bits_per_byte"] and len(log["step"]) == 5
    assert log["stage_starts"] == [0, 3] and log["sparse"] == [False, True, True, True, True]
    assert (tmp_path / "a" / "ckpt" / "stage1.safetensors").exists()


def test_plans_scale_in_proportion():
    from model.train import PLANS, scaled

    plan = PLANS["curriculum"]
    small = scaled(plan, plan.total_steps // 10)
    assert [s.seq_len for s in small.stages] == [s.seq_len for s in plan.stages]
    assert [s.steps for s in small.stages] == [round(s.steps / 10) for s in plan.stages]
    seq = [s.seq_len for s in plan.stages]
    assert seq == sorted(seq) and seq[-1] > seq[0]  # a curriculum: longer sequences later


def test_leaky_gradient_changes_no_forward_value_and_revives_a_dead_indexer():
    from model.dense import index_scores, leaky_relu_grad

    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0], requires_grad=True)
    y = leaky_relu_grad(x, 0.1)
    assert torch.equal(y, torch.relu(x))
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.1, 0.1, 0.0, 1.0, 1.0]))
    # every q.k negative: plain ReLU scores are all 0 and give the query no gradient
    qi = (-torch.ones(1, 4, 2, 3)).requires_grad_()
    ki = torch.ones(1, 2, 3)
    visible = torch.ones(4, 2, dtype=torch.bool)
    w = torch.ones(1, 4, 2)
    for leak, moves in ((0.0, False), (0.2, True)):
        scores = index_scores(qi, ki, w, visible, leak)
        assert torch.equal(scores, torch.zeros(1, 4, 2))
        grad, = torch.autograd.grad(scores[..., 0].sum(), qi)
        assert bool(grad.abs().sum() > 0) == moves


def test_bf16_linear_layers_keep_the_training_forward_close_and_its_maths_float32():
    torch.manual_seed(0)
    model = KVTierLM(TINY)
    ids = torch.randint(0, 256, (2, 32))
    ref, aux_ref = forward_train(model, ids)
    got, aux = forward_train(model, ids, linear_dtype=torch.bfloat16)
    assert got.dtype == torch.float32 and aux.dtype == torch.float32
    assert not torch.equal(got, ref)  # the linear layers really ran in bf16
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert abs(aux.item() - aux_ref.item()) < 0.05 * aux_ref.item()


@pytest.mark.slow
def test_training_script_is_deterministic_and_writes_its_outputs(tmp_path):
    from model.train import train

    tc = tiny_plan()
    weights = [tmp_path / run / "bundled.safetensors" for run in ("a", "b")]
    threads = torch.get_num_threads()
    try:
        logs = [train(tc, path) for path in weights]
    finally:
        restore_torch_flags(threads)
    assert logs[0]["bits_per_byte"] == logs[1]["bits_per_byte"]
    assert len(logs[0]["bits_per_byte"]) == 5 and logs[0]["stage_starts"] == [0, 3]
    assert weights[0].read_bytes() == weights[1].read_bytes()
    for name in ("bundled.json", "loss_curve.png", "train_log.json"):
        assert (weights[0].parent / name).stat().st_size > 0


def test_indexer_target_power_sharpens_the_distillation_target():
    from model.dense import indexer_loss

    visible = torch.ones(2, 3, dtype=torch.bool)
    scores = torch.tensor([[[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]]])
    target = torch.tensor([[[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]])
    groups = [{"scores": scores, "targets": [target]}]
    logp = torch.log_softmax(scores, -1)
    sharp = target ** 3 / (target ** 3).sum(-1, keepdim=True)
    for power, expect in ((1.0, target), (3.0, sharp)):
        want = -(expect * logp).sum(-1).mean()
        assert torch.allclose(indexer_loss(groups, visible, power), want)
    assert not torch.allclose(indexer_loss(groups, visible, 3.0), indexer_loss(groups, visible))


def test_clipping_indexers_apart_leaves_the_lm_gradients_alone():
    from model.train import clip_groups

    model = KVTierLM(TINY)
    for name, p in model.named_parameters():  # indexers' norm far above the clip, LM's below
        big = ".indexer." in name or ".index_key." in name
        p.grad = torch.full_like(p, 10.0 if big else 1e-4)
    lm = model.embed.weight
    before = lm.grad.clone()
    mine, rest = clip_groups(model, apart=True)
    assert len(mine) + len(rest) == len(list(model.parameters()))
    assert {id(p) for p in mine} == {id(p) for n, p in model.named_parameters()
                                     if "indexer" in n or "index_key" in n}
    for params in (mine, rest):
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert torch.equal(lm.grad, before)
    assert torch.cat([p.grad.flatten() for p in mine]).norm() <= 1.0 + 1e-5
    together, = clip_groups(model, apart=False)
    torch.nn.utils.clip_grad_norm_(together, 1.0 / 4)
    assert lm.grad.abs().max() < before.abs().max()


def test_index_lr_scale_zero_freezes_only_the_indexers(tmp_path, monkeypatch):
    from model import train as train_mod

    monkeypatch.setattr(train_mod, "plot", lambda *a: None)
    tc, threads = tiny_plan(index_lr_scale=0.0), torch.get_num_threads()
    try:
        train_mod.train(tc, tmp_path / "w.safetensors")
    finally:
        restore_torch_flags(threads)
    torch.manual_seed(tc.seed)
    start = {n: p.half().float() for n, p in KVTierLM(TINY).named_parameters()}  # the init
    trained = dict(checkpoint.load(tmp_path / "w.safetensors").named_parameters())
    for name, p in trained.items():
        assert torch.equal(p, start[name]) == train_mod.is_indexer(name), name
