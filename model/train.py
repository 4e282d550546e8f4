"""Train the bundled model: `python -m model.train` (deterministic, CPU, ~20 min on 2 cores).

Writes model/weights/bundled.safetensors (+ bundled.json), loss_curve.png and
train_log.json. Same interpreter, same torch, same flags -> the same weights: fixed seeds,
a data order that depends only on the seed, deterministic algorithms.

Schedule: the first `dense_frac` of the steps attend to every visible compressed entry
while the indexers learn (by distillation) which entries that attention uses; the rest
train exactly the sparse top-k path that inference runs.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm import tqdm

from model import checkpoint
from model.config import PRESETS
from model.data import BatchSampler, corpus
from model.dense import forward_train
from model.net import KVTierLM

LN2 = math.log(2.0)


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "bundled"
    steps: int = 300
    batch: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    dense_frac: float = 0.2
    aux_weight: float = 1.0
    weight_decay: float = 0.05
    clip: float = 1.0
    seed: int = 1234
    # One thread: on shared cores two OpenMP threads spin-wait on each other and ran 3x
    # slower than one (measured); the result also depends on it, so it is fixed here.
    threads: int = 1


def lr_at(tc: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_frac of the peak."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * cosine)


def train(tc: TrainConfig, out: Path) -> dict:
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    torch.use_deterministic_algorithms(True)
    model = KVTierLM(PRESETS[tc.preset])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95))
    sampler = BatchSampler(corpus(held_out=False), tc.seq_len, tc.batch, tc.seed)
    dense_steps = int(tc.steps * tc.dense_frac)
    log = {"step": [], "bits_per_byte": [], "aux": [], "sparse": []}
    start = time.time()
    bar = tqdm(range(tc.steps), desc="train", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(tc, step)
        batch = sampler.next()
        sparse = step >= dense_steps
        logits, aux = forward_train(model, batch[:, :-1], sparse=sparse)
        ce = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        (ce + tc.aux_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bpb = ce.item() / LN2
        for key, val in (("step", step), ("bits_per_byte", bpb), ("aux", aux.item()),
                         ("sparse", sparse)):
            log[key].append(val)
        bar.set_postfix(bpb=f"{bpb:.3f}", aux=f"{aux.item():.3f}", sparse=sparse)
    log["wall_s"] = time.time() - start
    log["train_config"] = asdict(tc)
    log["params"] = model.num_params()
    checkpoint.save(model, out)
    out.with_name("train_log.json").write_text(json.dumps(log) + "\n")
    plot(log, out.with_name("loss_curve.png"), dense_steps)
    return log


def plot(log: dict, path: Path, dense_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log["step"], log["bits_per_byte"], lw=0.8, label="train bits/byte")
    window = 25
    if len(log["bits_per_byte"]) > window:
        smooth = torch.tensor(log["bits_per_byte"]).unfold(0, window, 1).mean(1)
        ax.plot(log["step"][window - 1:], smooth.tolist(), lw=1.5, label=f"mean of {window}")
    ax.axvline(dense_steps, color="grey", ls="--", lw=0.8, label="dense -> sparse top-k")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(top=min(8.0, max(log["bits_per_byte"])))
    ax.set_title(f"bundled model training ({log['params']:,} params, {log['wall_s'] / 60:.1f} min)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="optimizer steps (default: TrainConfig)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bundled")
    parser.add_argument("--out", type=Path, default=checkpoint.BUNDLED_WEIGHTS)
    args = parser.parse_args(argv)
    tc = TrainConfig(preset=args.preset)
    if args.steps is not None:
        tc = replace(tc, steps=args.steps)
    log = train(tc, args.out)
    print(json.dumps({"params": log["params"], "wall_s": round(log["wall_s"], 1),
                      "final_bits_per_byte": round(sum(log["bits_per_byte"][-25:]) / 25, 4)}))


if __name__ == "__main__":
    main()
