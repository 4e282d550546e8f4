"""`python -m kernels.compilecheck`: every Triton kernel compiles for sm_90 (H100/H200) with
the wrappers' launch configurations, no GPU needed. A subprocess, because this test session
runs the kernels interpreted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # compiles 14 kernels: about half a minute on 2 cores (cached afterwards)
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "kernels.compilecheck", "--arch", "90"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in run.stdout
    assert run.stdout.count(" ok ") >= 14
