"""`python -m kernels.gpucheck --tiny`: every kernel runs under the Triton interpreter against
its reference, and the script reports it (a subprocess, because the interpreter has to be on
before triton is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import ops

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a fresh Python process: about 5-10 s on 2 cores
def test_gpucheck_tiny_checks_every_kernel_and_exits_zero():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "kernels.gpucheck", "--tiny"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Triton interpreter" in run.stdout
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["mode"] == "interpreter" and report["ok"] is True
    checked = {row["case"].split()[0] for row in report["results"]}
    public = {name for name, fn in vars(ops).items() if callable(fn)
              and getattr(fn, "__module__", "") == ops.__name__ and name[0] != "_"}
    wanted = {name.replace("sparse_compressed_attention", "sparse_attention") for name in public}
    assert checked == wanted
    assert all(row["ok"] and row["max_abs_err"] < 1e-4 for row in report["results"])
