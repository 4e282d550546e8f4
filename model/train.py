"""Train the bundled model: `python -m model.train` (deterministic, CPU, one thread).

Writes model/weights/bundled.safetensors (+ bundled.json), loss_curve.png and
train_log.json. Same interpreter, same torch, same flags -> the same weights: fixed seeds,
a data order that depends only on the seed, deterministic algorithms.

Stage 1 trains on 512-byte sequences: its first `dense_frac` of the steps attend to every
visible compressed entry while the indexers learn (by distillation) which entries that
attention uses; the rest train exactly the sparse top-k path that inference runs. Stage 2
fine-tunes on 2,048-byte sequences, where 512 entries compete for the pool and the top-k:
trained on 512 bytes only, the model let far-away entries distract it at 8k contexts.
`--stage1 FILE` resumes from stage 1's saved weights (stage 2 starts from fp16-rounded
weights either way, so the result is the same).
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
    steps: int = 300  # stage 1: short sequences
    batch: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    dense_frac: float = 0.2
    long_steps: int = 100  # stage 2: long sequences, so hundreds of entries compete
    long_batch: int = 2
    long_seq_len: int = 2048
    long_lr: float = 1e-3
    long_warmup: int = 10
    aux_weight: float = 1.0
    weight_decay: float = 0.05
    clip: float = 1.0
    seed: int = 1234
    # One thread: on shared cores two OpenMP threads spin-wait on each other and ran 3x
    # slower than one (measured); the result also depends on it, so it is fixed here.
    threads: int = 1


def lr_at(peak: float, warmup: int, steps: int, min_frac: float, step: int) -> float:
    """Linear warm-up, then cosine decay to min_frac of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak * (min_frac + (1 - min_frac) * cosine)


def run_stage(model: KVTierLM, tc: TrainConfig, stage: int, log: dict) -> None:
    """One training stage with a fresh optimizer; appends per-step figures to `log`."""
    steps, batch, seq_len, peak, warmup, dense_steps = (
        (tc.steps, tc.batch, tc.seq_len, tc.lr, tc.warmup, int(tc.steps * tc.dense_frac))
        if stage == 1 else
        (tc.long_steps, tc.long_batch, tc.long_seq_len, tc.long_lr, tc.long_warmup, 0))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak, betas=(0.9, 0.95))
    sampler = BatchSampler(corpus(held_out=False), seq_len, batch, tc.seed + stage - 1)
    first = len(log["step"])
    for step in (bar := tqdm(range(steps), desc=f"stage {stage}", unit="step")):
        for group in opt.param_groups:
            group["lr"] = lr_at(peak, warmup, steps, tc.min_lr_frac, step)
        ids = sampler.next()
        sparse = step >= dense_steps
        logits, aux = forward_train(model, ids[:, :-1], sparse=sparse)
        ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        (ce + tc.aux_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bpb = ce.item() / LN2
        for key, val in (("step", first + step), ("bits_per_byte", bpb), ("aux", aux.item()),
                         ("sparse", sparse)):
            log[key].append(val)
        bar.set_postfix(bpb=f"{bpb:.3f}", aux=f"{aux.item():.3f}", sparse=sparse)
    log["stage_starts"].append(first)
    log["dense_steps"].append(dense_steps)


def round_to_fp16(model: KVTierLM) -> None:
    """What saving and loading the stage-1 weights does: resuming from a stage-1 file
    gives the same stage 2 as running straight through."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())


def train(tc: TrainConfig, out: Path, stage1: Path | None = None) -> dict:
    """Stage 1 (or its saved result `stage1`, with its train_log.json beside it), then
    stage 2; writes the weights, the log and the loss curve next to `out`."""
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    torch.use_deterministic_algorithms(True)
    start = time.time()
    if stage1 is None:
        model = KVTierLM(PRESETS[tc.preset])
        log = {"step": [], "bits_per_byte": [], "aux": [], "sparse": [], "stage_starts": [],
               "dense_steps": []}
        run_stage(model, tc, 1, log)
        log["stage1_wall_s"] = time.time() - start
    else:
        model = checkpoint.load(stage1).train()
        log = json.loads(stage1.with_name("train_log.json").read_text())
        log.setdefault("stage_starts", [0])
        log.setdefault("dense_steps", [int(tc.steps * tc.dense_frac)])
        log.setdefault("stage1_wall_s", log.get("wall_s", 0.0))
        start -= log["stage1_wall_s"]
    round_to_fp16(model)
    run_stage(model, tc, 2, log)
    log["wall_s"] = time.time() - start
    log["train_config"] = asdict(tc)
    log["params"] = model.num_params()
    checkpoint.save(model, out)
    out.with_name("train_log.json").write_text(json.dumps(log) + "\n")
    plot(log, out.with_name("loss_curve.png"))
    return log


def plot(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log["step"], log["bits_per_byte"], lw=0.8, label="train bits/byte")
    window = 25
    if len(log["bits_per_byte"]) > window:
        smooth = torch.tensor(log["bits_per_byte"]).unfold(0, window, 1).mean(1)
        ax.plot(log["step"][window - 1:], smooth.tolist(), lw=1.5, label=f"mean of {window}")
    ax.axvline(log["dense_steps"][0], color="grey", ls="--", lw=0.8, label="dense -> sparse top-k")
    for begin in log["stage_starts"][1:]:
        ax.axvline(begin, color="black", ls=":", lw=0.8, label="stage 2: 2,048-byte sequences")
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
    parser.add_argument("--stage1", type=Path,
                        help="weights stage 1 wrote (train_log.json beside them): run stage 2 only")
    args = parser.parse_args(argv)
    tc = TrainConfig(preset=args.preset)
    if args.steps is not None:
        tc = replace(tc, steps=args.steps, long_steps=args.steps // 3)
    log = train(tc, args.out, args.stage1)
    print(json.dumps({"params": log["params"], "wall_s": round(log["wall_s"], 1),
                      "final_bits_per_byte": round(sum(log["bits_per_byte"][-25:]) / 25, 4)}))


if __name__ == "__main__":
    main()
