"""Every benchmark at sizes that finish in about 15 minutes on 2 cores, collected into
bench/results.json, then bench/REPORT.md and its plots (``bench.report``).

``python -m bench.all`` (``make bench``) [--only resume,fidelity] [--sizes full]

Stages, in order: codec, tiers and trace (run as ``python -m bench.<name> --json`` child
processes, their printed JSON collected: for trace, the result of
``bench.trace.run.run_trace_benchmark``), then resume, fidelity and bytes (called in this
process, sharing one loaded model), then replay_batch (a child process again). ``--sizes
quick`` is the default budget (resume at the issue's 4096, 16384 and 65536 tokens,
fidelity at 1k, 4k and 16k on 2 stretches each); ``--sizes tiny`` a smoke run of every
stage; ``--sizes full`` 4 stretches per fidelity context and the codec and tiers
benchmarks' own default sizes.
fuzz and adversarial (child processes) follow replay_batch: ``stress.fuzz`` sends hostile
requests to every RPC of a live server and replay worker, ``stress.adversarial`` runs
named attacks from outside (each must hold). faults (a child process) comes last:
``stress.faults``, power loss at every point, ENOSPC and EIO at every call site, index
repair. fleet (a child process) after it: ``bench.fleet``, resume paths across replicas
sharing one Redis and one S3 bucket, manifest CAS latency, resumes per second.
hf (a child process): ``bench.hf``, the transformers integration on a tiny
DeepseekV4 with seeded random weights (bytes, time to ready, replay fidelity).
seams (a child process): ``bench.seams``, the whole-service simulation over every
switch combination (its own default budget: 20,000 steps, about 25 minutes).
vllm (a child process in .venv-vllm, ``make vllm``) last: ``bench.vllm``, kvtier's vLLM
connector beside ExampleConnector and vLLM's own prefix cache, in vLLM's CPU build: what
a user pays (misses with and without it, hits from host RAM and disk, a hung server, an
engine started with kvtier down); the tiny size skips the disk and down cases, an engine
start each.
sglang (a child process in .venv-sglang, ``make sglang``) after it: ``bench.sglang``,
kvtier as SGLang's HiCache storage beside SGLang's own HiCacheFile, through SGLang's host
pool (pages/s and GB/s of set and get).
A stage that fails is recorded with its error and the others still run; the exit status
is 1 if any failed. ``--merge`` reruns only the ``--only`` stages into the existing results
(new weights, say, rerun resume and fidelity): the other stages keep their figures, and
each rerun stage records the machine, commit and date it ran at under
``recorded_separately``. The machine the figures came from (CPU model, cores, memory, torch
and triton versions, date, load) is recorded beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import bytes as bytes_bench
from bench import fidelity, resume
from model import checkpoint

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.json"
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"

SIZES = {
    # A smoke run of every stage in a minute or two (tests, development); not for figures.
    "tiny": {
        "codec": ["--mb", "1", "--repeats", "1"],
        "tiers": ["--size-mib", "0.25", "--count", "4", "--repeats", "1"],
        "resume": {"contexts": [600, 1100], "repeats": 1},
        "fidelity": {"contexts": [600], "segments": 1, "follow": 32},
        "trace": ["--limit", "200", "--fractions", "0.05,0.2", "--validate", "0",
                  "--lookup-tokens", "1024", "--shapes", "forks", "--shape-scale", "0.1"],
        "bytes": {"lengths": [300, 1100]},
        "replay_batch": ["--contexts", "512", "--batches", "2", "--repeat", "1"],
        "fuzz": ["--requests", "300"],
        "adversarial": ["--sizes", "tiny"],
        "faults": ["--workload", "small", "--per-kind", "1"],
        "fleet": ["--tokens", "1100", "--sessions", "3", "--resumes", "12", "--clients", "2",
                  "--manifests", "5"],
        "hf": ["--contexts", "300", "--follow", "16"],
        "seams": ["--steps", "200", "--combinations", "plain,enc+quota+tls"],
        "vllm": ["--models", "tiny", "--lengths", "1024", "--repeats", "1",
                 "--cases", "connector_miss,hung"],
        "sglang": ["--pages", "16", "--batch", "8", "--repeats", "1", "--small-pages", "32"],
    },
    "quick": {
        "codec": ["--mb", "16", "--repeats", "3"],
        "tiers": ["--size-mib", "1", "--count", "16", "--repeats", "3"],
        # the contexts; re-prefilling 65k tokens alone takes minutes on one core
        "resume": {"contexts": [4096, 16384, 65536], "repeats": 2},
        "fidelity": {"contexts": [1024, 4096, 16384], "segments": 2},
        "trace": [],  # every shape; validation of 300 requests
        "bytes": {"lengths": [1000, 3000, 8192]},
        "replay_batch": ["--contexts", "512,2048,8192,32768", "--batches", "2,4,8"],
        "fuzz": ["--requests", "10000"],
        "adversarial": [],
        "faults": ["--workload", "large"],
        "fleet": [],
        "hf": [],
        "seams": [],
        "vllm": [],
        "sglang": [],
    },
    "full": {
        "codec": [],
        "tiers": [],
        "resume": {"contexts": [4096, 16384, 65536], "repeats": 3},
        "fidelity": {"contexts": [1024, 4096, 16384], "segments": 4},  # ~25 s a 16k prefill
        "trace": [],  # every shape; validation of 300 requests
        "bytes": {"lengths": [1000, 3000, 8192, 20000]},
        "replay_batch": ["--contexts", "512,2048,8192,32768", "--batches", "2,4,8",
                         "--repeat", "5"],
        "fuzz": ["--requests", "10000"],
        "adversarial": [],
        "faults": ["--workload", "large"],
        "fleet": ["--tokens", "16384", "--resumes", "300"],
        "hf": [],
        "seams": [],
        "vllm": [],
        "sglang": ["--pages", "256", "--batch", "128"],
    },
}
CAMPAIGNS = ("fuzz", "adversarial", "faults")  # stages whose runner is in stress/
STAGES = ("codec", "tiers", "trace", "resume", "fidelity", "bytes", "replay_batch",
          "fuzz", "adversarial", "faults", "fleet", "hf", "seams", "vllm", "sglang")


def machine() -> dict:
    """Where the figures come from."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)
        with open("/proc/meminfo") as info:
            mem_kib = int(next(line.split()[1] for line in info if line.startswith("MemTotal")))
    except OSError:
        mem_kib = 0
    import triton

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    return {
        "cpu_model": cpu, "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(mem_kib / 2**20, 1), "python": platform.python_version(),
        "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.cuda.is_available(), "platform": platform.platform(),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "weights_commit": git("log", "-1", "--format=%h %ad", "--date=iso",
                              "--", "model/weights/bundled.safetensors"),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_at_start": os.getloadavg(),
    }


def child_json(name: str, args: list[str], python: str = sys.executable) -> dict:
    """``python -m bench.<name> --json *args`` (``stress.<name>`` for a campaign of
    ``CAMPAIGNS``) in a child process; its printed JSON. Its progress lines (stderr) pass
    through as they come, indented under the stage's line."""
    module = f"stress.{name}" if name in CAMPAIGNS else f"bench.{name}"
    with subprocess.Popen([python, "-m", module, "--json", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        stdout = [""]
        reader = threading.Thread(target=lambda: stdout.__setitem__(0, proc.stdout.read()))
        reader.start()  # a full stdout pipe must not stall the child while we read stderr
        tail: collections.deque[str] = collections.deque(maxlen=40)
        for line in proc.stderr:
            tail.append(line)
            print(f"    {name}: {line.rstrip()}", file=sys.stderr, flush=True)
        reader.join()
    if proc.returncode:
        raise RuntimeError(f"{module} exited {proc.returncode}: "
                           f"{''.join(tail)[-2000:]}")
    return json.loads(stdout[0])


def stage_runners(sizes: dict, trace: Path, weights: Path) -> dict[str, Callable[[], dict]]:
    loaded: list = []

    def model() -> tuple:
        """The model, loaded once for the stages that need it."""
        if not loaded:
            loaded.extend(resume.load_model(weights))
        return tuple(loaded)

    def trace_stage() -> dict:
        if not trace.exists():
            return {"skipped": f"no trace at {trace} (pass --trace)"}
        # A child process: run_trace_benchmark forks a worker pool, and a fork of a
        # process with gRPC or OpenMP threads running can deadlock (seen here).
        return child_json("trace", ["--trace", str(trace), "--jobs", "2", *sizes["trace"]])

    return {
        "codec": lambda: child_json("codec", sizes["codec"]),
        "tiers": lambda: child_json("tiers", sizes["tiers"]),
        "resume": lambda: asyncio.run(resume.run(*model(), **sizes["resume"])),
        "fidelity": lambda: asyncio.run(fidelity.run(*model(), **sizes["fidelity"])),
        "trace": trace_stage,
        "bytes": lambda: _bytes_stage(model(), sizes["bytes"]["lengths"]),
        "replay_batch": lambda: child_json("replay_batch", sizes["replay_batch"]),
        # the same campaign, then against TLS and tokens with credential attacks
        "fuzz": lambda: {**child_json("fuzz", sizes["fuzz"]),
                         "authenticated": child_json("fuzz", [*sizes["fuzz"], "--auth"])},
        "adversarial": lambda: child_json("adversarial", sizes["adversarial"]),
        "faults": lambda: child_json("faults", sizes["faults"]),
        "fleet": lambda: child_json("fleet", sizes["fleet"]),
        "hf": lambda: child_json("hf", sizes["hf"]),
        "seams": lambda: child_json("seams", sizes["seams"]),
        "vllm": lambda: child_json("vllm", sizes["vllm"], _engine_python("vllm")),
        "sglang": lambda: child_json("sglang", sizes["sglang"], _engine_python("sglang")),
    }


def _engine_python(engine: str) -> str:
    """vLLM's CPU build and SGLang live in venvs of their own (their transformers and
    torch pins differ from ours)."""
    python = ROOT / f".venv-{engine}" / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"the {engine} stage runs in .venv-{engine}: `make {engine}` "
                           "builds it")
    return str(python)


def _bytes_stage(model: tuple, lengths: list[int]) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtier-bytes-") as tmp:
        return asyncio.run(bytes_bench.measure(*model, lengths, Path(tmp)))


def run_all(stages: list[str], sizes_name: str, trace: Path, weights: Path,
            out: Path | None = None, merge_into: dict | None = None) -> dict:
    """Run the stages in order; after each, the results so far are written to ``out``.
    With ``merge_into`` (earlier results), only these stages are replaced in it."""
    runners = stage_runners(SIZES[sizes_name], trace, weights)
    here = machine()
    if merge_into is None:
        results: dict = {"machine": here, "sizes": sizes_name,
                         "torch_threads": torch.get_num_threads(), "stages": {}}
    else:
        results = merge_into
    first = time.perf_counter()
    for index, name in enumerate(stages, 1):
        started = time.perf_counter()
        print(f"bench.all: [{index}/{len(stages)}] {name} ... ({started - first:.0f} s "
              "elapsed)", file=sys.stderr, flush=True)
        try:
            stage = runners[name]()
        except Exception as exc:  # one failed stage must not lose the others' figures
            stage = {"error": f"{type(exc).__name__}: {exc}"}
        stage["wall_s"] = round(time.perf_counter() - started, 1)
        if merge_into is not None:
            stage["recorded_separately"] = {
                **{k: here[k] for k in ("git_commit", "weights_commit", "date_utc")},
                "sizes": sizes_name, "torch_threads": torch.get_num_threads(),
                "load_average_at_start": here["load_average_at_start"],
                "load_average_at_end": os.getloadavg()}
        results["stages"][name] = stage
        print(f"bench.all: [{index}/{len(stages)}] {name} done in {stage['wall_s']} s"
              + (f" ERROR {stage['error']}" if "error" in stage else ""), file=sys.stderr,
              flush=True)
        if merge_into is None:
            results["load_average_at_end"] = os.getloadavg()
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(STAGES), help="comma-separated stages")
    parser.add_argument("--sizes", choices=sorted(SIZES), default="quick")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--weights", type=Path, default=checkpoint.BUNDLED_WEIGHTS)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    parser.add_argument("--no-report", action="store_true", help="skip bench/REPORT.md")
    parser.add_argument("--merge", action="store_true",
                        help="replace only the --only stages in the existing --out results")
    args = parser.parse_args(argv)
    stages = [s for s in args.only.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; known: {', '.join(STAGES)}")
    torch.set_num_threads(args.threads)
    if args.merge and not args.out.exists():
        parser.error(f"--merge needs earlier results in {args.out}")
    previous = json.loads(args.out.read_text()) if args.merge else None
    results = run_all(stages, args.sizes, args.trace, args.weights, args.out, previous)
    print(f"bench.all: results in {args.out}", file=sys.stderr)
    if not args.no_report:
        from bench.report import write_report

        print(f"bench.all: report in {write_report(results, args.out.parent)}", file=sys.stderr)
    return 1 if any("error" in s for s in results["stages"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
