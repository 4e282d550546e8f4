"""Micro benchmark of bounded replay (not a test): R = 128 at several context lengths, and
whether replaying concurrent resumes in one batched model call (``replay_batch``, what the
worker does with a queue) beats replaying them one after another.

    .venv/bin/python -m bench.replay_batch [--contexts 512,2048,8192] [--batches 2,4,8] [--json]

States are synthetic (random global KV of the right shapes): replay's cost depends on the
shapes, not on the values, and this skips a prefill of every context.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.codec import best_seconds
from model.config import BUNDLED, ModelConfig
from model.infer import replay, replay_batch
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
    return best_seconds(fn, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--replay-tokens", type=int, default=128)
    parser.add_argument("--batches", default="2,4,8", help="concurrent resumes to compare")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = KVTierLM(BUNDLED).eval()
    r = args.replay_tokens
    rows = []
    for n in (int(x) for x in args.contexts.split(",")):
        state = synthetic_state(BUNDLED, n, seed=n)
        row = {"context": n, "replay_ms": 1000 * timed(lambda s=state: replay(model, s, r),
                                                       args.repeat)}
        for b in (int(x) for x in args.batches.split(",")):
            states = [synthetic_state(BUNDLED, n, seed=n + i) for i in range(b)]
            serial = timed(lambda s=states: [replay(model, x, r) for x in s], args.repeat)
            batched = timed(lambda s=states: replay_batch(model, s, r), args.repeat)
            row[f"batched_speedup_{b}"] = serial / batched
        rows.append(row)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "replay_tokens": r,
                          "rows": rows}))
        return
    print(f"torch threads: {torch.get_num_threads()}; R = {r}; batched speedup = "
          "one-after-another time / one batched call")
    batches = [k for k in rows[0] if k.startswith("batched")]
    print(f"{'context':>8} {'replay':>10} " + " ".join(f"{'x' + k.rsplit('_', 1)[1]:>8}"
                                                      for k in batches))
    for row in rows:
        print(f"{row['context']:>8} {row['replay_ms']:>8.1f}ms "
              + " ".join(f"{row[k]:>7.2f}x" for k in batches))


if __name__ == "__main__":
    main()
