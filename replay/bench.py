"""Micro benchmark of bounded replay (not a test): R = 128 at several context lengths, and
whether running concurrent resumes together beats running them one after another.

    .venv/bin/python -m replay.bench [--contexts 512,2048,8192] [--batch 4]

States are synthetic (random global KV of the right shapes): replay's cost depends on the
shapes, not on the values, and this skips a prefill of every context.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from model.config import BUNDLED, ModelConfig
from model.infer import replay
from model.net import KVTierLM
from model.state import PERSISTENT, KVState, _q_shape


def synthetic_state(cfg: ModelConfig, n: int, seed: int) -> KVState:
    """A window-less state of n tokens with random codes and plausible scales."""
    gen = torch.Generator().manual_seed(seed)
    persistent = {}
    for name in PERSISTENT:
        codes_shape, scales_shape, dtype = _q_shape(cfg, name, n // cfg.block)
        codes = torch.randint(0, 256, codes_shape, generator=gen, dtype=torch.int32).to(dtype)
        scales = (torch.rand(scales_shape, generator=gen) * 0.05 + 0.01).half()
        persistent[name] = (codes, scales)
    ids = torch.randint(0, cfg.vocab, (n,), generator=gen)
    return KVState.from_tensors(cfg, ids, persistent)


def timed(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--replay-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = KVTierLM(BUNDLED).eval()
    r = args.replay_tokens
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'context':>8} {'replay R=' + str(r):>14}")
    for n in (int(x) for x in args.contexts.split(",")):
        state = synthetic_state(BUNDLED, n, seed=n)
        seconds = timed(lambda s=state: replay(model, s, r), args.repeat)
        print(f"{n:>8} {seconds * 1000:>12.1f}ms")
    n = int(args.contexts.split(",")[-1])
    states = [synthetic_state(BUNDLED, n, seed=i) for i in range(args.batch)]

    def one_after_another():
        for s in states:
            replay(model, s, r)

    def together():
        with ThreadPoolExecutor(len(states)) as pool:
            list(pool.map(lambda s: replay(model, s, r), states))

    serial = timed(one_after_another, args.repeat)
    threaded = timed(together, args.repeat)
    print(f"{args.batch} resumes at {n} tokens: one after another {serial * 1000:.0f}ms, "
          f"concurrent threads {threaded * 1000:.0f}ms, ratio {serial / threaded:.2f}x")


if __name__ == "__main__":
    main()
