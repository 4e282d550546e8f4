"""``python -m bench.seams --json [--steps N] [--seed S] [--combinations all|LIST]``: the
whole-service simulation (``bench.seams.engine``) over every switch combination; prints
the failure counts, the per-combination figures and the first findings. Each step is
logged (``--log``, default a file in the scratch directory) as ``step=N op=...`` so a
finding's seed and step replay it. Exit status: with ``--json`` 0 once the run completed
(the counts are in the JSON), without it 1 when any failure key is not 0."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.seams.run import simulate
from bench.seams.switches import parse_combinations
from bench.seams.verdict import KEYS

DEFAULT_STEPS = 20_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.seams")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--combinations", default="all",
                        help="all, or names joined by commas (plain, enc+tls, ...)")
    parser.add_argument("--workdir", type=Path, help="keep the run's files here")
    parser.add_argument("--log", type=Path, help="the step log (default: in the workdir)")
    args = parser.parse_args(argv)
    try:
        combinations = parse_combinations(args.combinations)
    except ValueError as exc:
        parser.error(str(exc))
    result = simulate(args.steps, args.seed, combinations, workdir=args.workdir,
                      log_path=args.log)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(", ".join(f"{k} {result[k]}" for k in ("steps", "switch_combinations", *KEYS)))
        for finding in result["findings"]:
            print(f"  {finding['kind']} {finding['combination']} step {finding['step']} "
                  f"{finding['op']} {finding['session']}: expected {finding['expected']}, "
                  f"got {finding['got']}")
    # With --json the findings are the output (bench.all collects them): 0 once the run
    # completed; without it, 1 when any failure key is not 0.
    return 0 if args.json or not any(result[k] for k in KEYS) else 1


if __name__ == "__main__":
    sys.exit(main())
