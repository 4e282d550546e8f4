"""model.eval on the tiny model: the --json keys the issue names, figures computed as
stated (gzip against an independent zlib run, the random top-k against uniform attention)."""

from __future__ import annotations

import json
import math
import zlib

import torch

from model import checkpoint
from model.config import TINY
from model.data import corpus
from model.eval import CONTEXTS, context_key, indexer_quality, main, segments
from model.net import KVTierLM


def tiny_weights(path):
    torch.manual_seed(0)
    checkpoint.save(KVTierLM(TINY).eval(), path)
    return path


def test_default_contexts_give_the_issues_key_names():
    assert [context_key(c) for c in CONTEXTS] == [
        "bits_per_byte_1k", "bits_per_byte_8k", "bits_per_byte_32k"]
    assert context_key(1000) == "bits_per_byte_1000"


def test_json_reports_every_figure(tmp_path, capsys):
    weights = tiny_weights(tmp_path / "tiny.safetensors")
    threads = torch.get_num_threads()
    try:
        main(["--json", "--quick", "--weights", str(weights), "--contexts", "256,1024,2048",
              "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    out = json.loads(capsys.readouterr().out)
    bpb = [out[k] for k in ("bits_per_byte_256", "bits_per_byte_1k", "bits_per_byte_2k")]
    # an untrained byte model guesses close to uniform (8 bits), never below 0
    assert all(6.0 < b < 12.0 for b in bpb)
    assert out["segments"] == 1 and out["segment_bytes"] == 2048
    # only bytes predicted in every cut: a piece's first byte is never scored
    assert out["bytes_scored"] == 2048 - 2048 // 256
    # gzip -9 of exactly the scored stretch, recomputed with zlib's gzip container
    sample = segments(corpus(held_out=True), 1, 2048)[0]
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    expect = 8 * len(packer.compress(sample) + packer.flush()) / len(sample)
    assert out["gzip_bits_per_byte"] == round(expect, 4)
    assert 0 < out["gzip_bits_per_byte_all_held_out"] < 8
    indexers = sum(m in ("full", "reindex") for m in TINY.enc_modes + TINY.dec_modes)
    assert len(out["indexer_mass"]) == indexers == len(out["indexer_mass_captured"])
    assert all(0 < m <= 1 for m in out["indexer_mass"])
    assert 0 < out["random_mass"] < 1
    assert out["indexer_mass_ratio"] == [round(m / out["random_mass"], 3)
                                         for m in out["indexer_mass"]]
    # a selection is a top-k of its candidates: it holds at most the best one does
    assert len(out["indexer_best_mass"]) == indexers
    assert all(m <= b + 1e-4 <= 1 + 1e-4
               for m, b in zip(out["indexer_mass"], out["indexer_best_mass"], strict=True))


def test_under_uniform_attention_any_top_k_holds_the_random_share():
    torch.manual_seed(0)
    model = KVTierLM(TINY).eval()
    with torch.no_grad():  # zero compressed queries: every visible entry gets equal attention
        for layer in (*model.encoder, *model.decoder):
            layer.wqc.weight.zero_()
    data = corpus(held_out=True)
    mass, random, best = indexer_quality(model, data, seqs=2, length=256)
    k, seen = TINY.topk, (torch.arange(256) + 1) // TINY.block  # entries visible per query
    seen = seen[seen > k].float()
    assert math.isclose(random, (k / seen).mean().item(), abs_tol=1e-4)
    assert all(math.isclose(m, random, abs_tol=1e-4) for m in mass)
    assert all(math.isclose(b, random, abs_tol=1e-4) for b in best)  # no top-k does better
