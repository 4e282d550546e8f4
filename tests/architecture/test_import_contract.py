"""The import contract of pyproject.toml holds, and the client stands alone: importing
``kvtier`` loads no torch and nothing of kvstore outside ``kvstore.format``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_the_import_contract_holds():
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def loaded_by(statement: str) -> list[str]:
    """Every module ``statement`` loads, run in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_import_kvtier_loads_no_torch_and_only_the_format_of_the_store():
    loaded = loaded_by("import kvtier\nkvtier.StreamData, kvtier.Client")
    assert "kvtier.client" in loaded and "kvstore.format.chunk" in loaded
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.")]
    store = [m for m in loaded if m.startswith("kvstore.")]
    assert store and all(m.startswith("kvstore.format.") or m == "kvstore.format"
                         for m in store), store
    assert not [m for m in loaded if m.split(".")[0] in ("replay", "model", "services")]


def test_request_validation_loads_no_replay_worker_and_no_torch():
    loaded = loaded_by("import services.server.validate")
    assert "services.server.validate" in loaded
    assert not [m for m in loaded if m == "torch" or m.split(".")[0] in ("replay", "model")]
