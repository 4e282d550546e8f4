"""Train the bundled model: `python -m model.train` (deterministic, CPU, one thread).

Writes model/weights/bundled.safetensors (+ bundled.json), loss_curve.png and
train_log.json. Same interpreter, same torch, same flags -> the same weights: fixed seeds,
a data order that depends only on the seed, deterministic algorithms.

A plan is a list of stages, each with a fresh optimizer, its own schedule and its own
sequence length (a curriculum: longer sequences later, so hundreds or thousands of
entries compete for the pool and the top-k). A stage's first `dense_steps` attend to
every visible compressed entry while the indexers learn (by distillation) which entries
that attention uses; the rest train exactly the sparse top-k path that inference runs.
Each stage after the first starts from fp16-rounded weights (what its start file holds).

Training checkpoints itself (`--checkpoint-dir`, every `checkpoint_every` steps and at
each stage boundary: weights, optimizer, data order, log); `--resume` continues from the
latest and ends with the same bytes as an uninterrupted run; `--until N` stops after N
steps in all, so a long plan can run in pieces.
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
STATE_FILE = "train_state.pt"


@dataclass(frozen=True)
class Stage:
    steps: int
    batch: int
    seq_len: int  # a multiple of the window (128) and of m
    lr: float  # peak
    warmup: int
    dense_steps: int = 0  # first steps attend to every visible entry (indexer warm-up)


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "bundled"
    stages: tuple[Stage, ...] = (Stage(300, 8, 512, 2e-3, 30, 60),
                                 Stage(100, 2, 2048, 1e-3, 10))
    min_lr_frac: float = 0.1
    aux_weight: float = 1.0
    # The indexers' ReLU gradient below zero (model.dense.leaky_relu_grad); 0: plain ReLU.
    index_leak: float = 0.0
    index_target_power: float = 1.0  # model.dense.indexer_loss; 1: the attention as it is
    # "bfloat16": the linear layers under autocast (model.dense.forward_train).
    linear_dtype: str = "float32"
    weight_decay: float = 0.05
    clip: float = 1.0
    # Clip the indexers' and index keys' gradients apart from the rest: live indexers'
    # distillation gradients (norm ~10 against the LM's ~0.4, measured) otherwise set the
    # one global clip factor for the LM too.
    clip_indexers_apart: bool = False
    index_lr_scale: float = 1.0  # the indexers' and index keys' learning rate, x the stage's
    seed: int = 1234
    # One thread: on shared cores two OpenMP threads spin-wait on each other and ran 3x
    # slower than one (measured); the result also depends on it, so it is fixed here.
    threads: int = 1
    checkpoint_every: int = 50  # steps; the state is also saved at every stage boundary

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)


# "v1" is what produced the first shipped weights (2 stages, float32, plain ReLU).
# "curriculum" is the retrain plan: 512 -> 2,048 -> 8,192-byte sequences (about one pass
# over the training split), bf16 linear layers, leaky indexer gradients, a sharpened
# target, their own clip and a tenth of the learning rate, a longer dense warm-up
# (model/README.md has its results and timings).
PLANS = {
    "v1": TrainConfig(),
    "curriculum": TrainConfig(
        stages=(Stage(1800, 8, 512, 2e-3, 100, 300), Stage(450, 4, 2048, 1e-3, 30, 50),
                Stage(30, 1, 8192, 3e-4, 5)),
        index_leak=0.1, index_target_power=4.0, clip_indexers_apart=True,
        index_lr_scale=0.1, linear_dtype="bfloat16"),
}


def lr_at(peak: float, warmup: int, steps: int, min_frac: float, step: int) -> float:
    """Linear warm-up, then cosine decay to min_frac of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak * (min_frac + (1 - min_frac) * cosine)


def new_log() -> dict:
    return {"step": [], "bits_per_byte": [], "aux": [], "sparse": [], "stage_starts": [],
            "dense_steps": [], "stage_wall_s": []}


def is_indexer(name: str) -> bool:
    """Parameters only the indexer loss trains: indexers and index keys."""
    return ".indexer." in name or ".index_key." in name


def optimizer(model: KVTierLM, tc: TrainConfig, peak: float) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    apart = tc.index_lr_scale != 1.0
    groups = [{"params": [p for n, p in named if p.dim() >= 2 and not (apart and is_indexer(n))],
               "weight_decay": tc.weight_decay},
              {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    if apart:
        groups.append({"params": [p for n, p in named if is_indexer(n)],
                       "weight_decay": tc.weight_decay, "lr_scale": tc.index_lr_scale})
    return torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.95))


class Run:
    """The whole training state: what a checkpoint holds and a resume restores."""

    def __init__(self, tc: TrainConfig):
        self.tc = tc
        self.model = KVTierLM(PRESETS[tc.preset])
        self.log = new_log()
        self.stage = self.step = 0  # next step to run: stage index, step within it
        self.elapsed = 0.0  # seconds of training before this process
        self.opt: torch.optim.AdamW | None = None
        self.sampler: BatchSampler | None = None

    def start_stage(self) -> None:
        st = self.tc.stages[self.stage]
        self.opt = optimizer(self.model, self.tc, st.lr)
        self.sampler = BatchSampler(corpus(held_out=False), st.seq_len, st.batch,
                                    self.tc.seed + self.stage)
        self.log["stage_starts"].append(len(self.log["step"]))
        self.log["dense_steps"].append(st.dense_steps)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = {"train_config": json.dumps(asdict(self.tc)), "stage": self.stage,
                 "step": self.step, "elapsed": self.elapsed, "log": self.log,
                 "model": self.model.state_dict(),
                 "opt": self.opt.state_dict() if self.opt else None,
                 "sampler": self.sampler.state() if self.sampler else None}
        tmp = directory / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(directory / STATE_FILE)  # a crash mid-save keeps the previous state

    @classmethod
    def load(cls, tc: TrainConfig, directory: Path) -> Run:
        state = torch.load(directory / STATE_FILE, weights_only=False)
        if state["train_config"] != json.dumps(asdict(tc)):
            raise ValueError(f"{directory / STATE_FILE} was written by another TrainConfig: "
                             f"{state['train_config']}")
        run = cls(tc)
        run.model.load_state_dict(state["model"])
        run.stage, run.step, run.elapsed, run.log = (state["stage"], state["step"],
                                                     state["elapsed"], state["log"])
        if state["opt"] is not None:
            st = tc.stages[run.stage]
            run.opt = optimizer(run.model, tc, st.lr)
            run.opt.load_state_dict(state["opt"])
            run.sampler = BatchSampler(corpus(held_out=False), st.seq_len, st.batch, 0)
            run.sampler.restore(state["sampler"])
        return run


def train_steps(run: Run, until: int | None, directory: Path | None) -> None:  # noqa: C901 - the training loop, its schedule and checkpoints
    """Run the plan from where `run` stands, to its end or to `until` steps in all."""
    tc = run.tc
    linear_dtype = getattr(torch, tc.linear_dtype)
    start = time.time()
    while run.stage < len(tc.stages):
        st = tc.stages[run.stage]
        if run.opt is None:
            if run.stage:  # later stages start from what their start file holds
                round_to_fp16(run.model)
            run.start_stage()
        opt, sampler = run.opt, run.sampler
        assert opt is not None and sampler is not None  # start_stage made them
        bar = tqdm(range(run.step, st.steps), desc=f"stage {run.stage + 1}", unit="step",
                   initial=run.step, total=st.steps)
        for step in bar:
            if until is not None and len(run.log["step"]) >= until:
                bar.close()
                run.elapsed += time.time() - start
                if directory is not None:
                    run.save(directory)
                return
            for group in opt.param_groups:
                group["lr"] = (lr_at(st.lr, st.warmup, st.steps, tc.min_lr_frac, step)
                               * group.get("lr_scale", 1.0))
            ids = sampler.next()
            sparse = step >= st.dense_steps
            logits, aux = forward_train(run.model, ids[:, :-1], sparse=sparse,
                                        linear_dtype=linear_dtype, index_leak=tc.index_leak,
                                        target_power=tc.index_target_power)
            ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            (ce + tc.aux_weight * aux).backward()
            for params in clip_groups(run.model, tc.clip_indexers_apart):
                torch.nn.utils.clip_grad_norm_(params, tc.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            bpb = ce.item() / LN2
            for key, val in (("step", len(run.log["step"])), ("bits_per_byte", bpb),
                             ("aux", aux.item()), ("sparse", sparse)):
                run.log[key].append(val)
            bar.set_postfix(bpb=f"{bpb:.3f}", aux=f"{aux.item():.3f}", sparse=sparse)
            run.step = step + 1
            if directory is not None and run.step % tc.checkpoint_every == 0:
                run.elapsed += time.time() - start
                start = time.time()
                run.save(directory)
        run.elapsed += time.time() - start
        start = time.time()
        run.log["stage_wall_s"].append(run.elapsed)
        run.stage, run.step, run.opt, run.sampler = run.stage + 1, 0, None, None
        if directory is not None:
            run.save(directory)
            if run.stage < len(tc.stages):  # the next stage's start: its fp16 weights
                checkpoint.save(run.model, directory / f"stage{run.stage}.safetensors")


def clip_groups(model: KVTierLM, apart: bool) -> list[list[torch.nn.Parameter]]:
    """The parameter sets clipped each on its own: all together, or (apart) the ones only
    the indexer loss trains (indexers, index keys) and the rest."""
    if not apart:
        return [list(model.parameters())]
    named = list(model.named_parameters())
    return [[p for n, p in named if is_indexer(n)], [p for n, p in named if not is_indexer(n)]]


def round_to_fp16(model: KVTierLM) -> None:
    """What saving and loading a stage's weights does: a stage started from its saved
    start file runs the same as one reached straight through."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())


def train(tc: TrainConfig, out: Path, checkpoints: Path | None = None, resume: bool = False,
          until: int | None = None) -> dict | None:
    """Run the plan (from the checkpoint in `checkpoints` if `resume`); at its end write
    the weights, the log and the loss curve next to `out` and return the log. With
    `until`, stop after that many steps in all (checkpointed) and return None."""
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    torch.use_deterministic_algorithms(True)
    if resume:
        if checkpoints is None or not (checkpoints / STATE_FILE).exists():
            raise FileNotFoundError(f"no {STATE_FILE} to resume from in {checkpoints}")
        run = Run.load(tc, checkpoints)
    else:
        run = Run(tc)
    train_steps(run, until, checkpoints)
    if run.stage < len(tc.stages):
        return None
    log = run.log
    log["wall_s"] = run.elapsed
    log["train_config"] = asdict(tc)
    log["params"] = run.model.num_params()
    checkpoint.save(run.model, out)
    out.with_name("train_log.json").write_text(json.dumps(log) + "\n")
    plot(log, tc, out.with_name("loss_curve.png"))
    return log


def plot(log: dict, tc: TrainConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log["step"], log["bits_per_byte"], lw=0.8, label="train bits/byte")
    window = 25
    if len(log["bits_per_byte"]) > window:
        smooth = torch.tensor(log["bits_per_byte"]).unfold(0, window, 1).mean(1)
        ax.plot(log["step"][window - 1:], smooth.tolist(), lw=1.5, label=f"mean of {window}")
    for begin, dense, st in zip(log["stage_starts"], log["dense_steps"], tc.stages,
                                strict=True):
        if begin:
            ax.axvline(begin, color="black", ls=":", lw=0.8)
        ax.text(begin, 0.02, f" {st.seq_len:,} B", transform=ax.get_xaxis_transform(),
                fontsize=7)
        if dense:
            ax.axvline(begin + dense, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("step (dotted: next stage, its sequence length below; dashed: dense -> "
                  "sparse top-k)", fontsize=8)
    ax.set_ylabel("bits per byte")
    ax.set_ylim(top=min(8.0, max(log["bits_per_byte"])))
    ax.set_title(f"bundled model training ({log['params']:,} params, {log['wall_s'] / 60:.1f} min)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaled(tc: TrainConfig, steps: int) -> TrainConfig:
    """The plan with `steps` optimizer steps in all, split across stages in proportion."""
    f = steps / tc.total_steps
    return replace(tc, stages=tuple(
        replace(s, steps=max(1, round(s.steps * f)), warmup=max(1, round(s.warmup * f)),
                dense_steps=round(s.dense_steps * f)) for s in tc.stages))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=sorted(PLANS), default="curriculum")
    parser.add_argument("--steps", type=int, help="steps in all, split across the stages "
                        "in proportion (default: the plan's)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bundled")
    parser.add_argument("--out", type=Path, default=checkpoint.BUNDLED_WEIGHTS)
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="where the training state goes (default: checkpoints/ beside --out)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    parser.add_argument("--until", type=int, help="stop after this many steps in all")
    args = parser.parse_args(argv)
    tc = replace(PLANS[args.plan], preset=args.preset)
    if args.steps is not None:
        tc = scaled(tc, args.steps)
    ckpt = args.checkpoint_dir or args.out.with_name("checkpoints")
    log = train(tc, args.out, ckpt, args.resume, args.until)
    if log is None:
        print(json.dumps({"stopped_at_step": args.until, "checkpoint_dir": str(ckpt)}))
        return
    last = log["bits_per_byte"][-25:]
    print(json.dumps({"params": log["params"], "wall_s": round(log["wall_s"], 1),
                      "final_bits_per_byte": round(sum(last) / len(last), 4)}))


if __name__ == "__main__":
    main()
