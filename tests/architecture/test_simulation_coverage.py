"""Every RPC of proto/kvtier.proto (every service) and every ``kvtier`` subcommand is driven
by the whole-service simulation (``bench.seams.coverage.COVERS``: an operation, a
maintenance event or the run's last step of ``bench.seams.engine``), or listed with its
reason in ``EXEMPT``: a new RPC or tool cannot skip the simulation unnoticed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from bench.seams import engine
from bench.seams.coverage import COVERS, EXEMPT

ROOT = Path(__file__).resolve().parents[2]


def proto_rpcs() -> set[str]:
    """``rpc:Service.Method`` of every service in proto/kvtier.proto."""
    text = re.sub(r"//[^\n]*", "", (ROOT / "proto" / "kvtier.proto").read_text())
    found = set()
    for service, body in re.findall(r"\bservice\s+(\w+)\s*\{(.*?)\n\}", text, re.S):
        found |= {f"rpc:{service}.{method}" for method in re.findall(r"\brpc\s+(\w+)\s*\(",
                                                                      body)}
    return found


def cli_commands() -> set[str]:
    """``cli:name`` of every key of ``COMMANDS`` in services/cli/main.py, read as source
    (a subcommand added there is seen without importing it)."""
    tree = ast.parse((ROOT / "services" / "cli" / "main.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "COMMANDS" for t in targets):
                return {f"cli:{key.value}" for key in node.value.keys}
    raise AssertionError("services/cli/main.py has no COMMANDS")


def test_the_parsers_find_what_is_there():
    rpcs, commands = proto_rpcs(), cli_commands()
    assert {"rpc:KVTier.Spill", "rpc:KVTier.WriteChunks", "rpc:Replay.Rebuild"} <= rpcs
    assert {"cli:serve", "cli:backup", "cli:restore-backup"} <= commands
    assert len(rpcs) >= 17 and len(commands) >= 19


def test_every_rpc_and_subcommand_is_in_the_simulation():
    every = proto_rpcs() | cli_commands()
    missing = sorted(every - set(COVERS) - set(EXEMPT))
    assert not missing, (f"not driven by bench.seams: {missing}; add an operation or an "
                         "event that calls it and map it in bench/seams/coverage.py COVERS")
    assert not set(COVERS) & set(EXEMPT), "covered and exempt at once"
    stale = sorted((set(COVERS) | set(EXEMPT)) - every)
    assert not stale, f"bench/seams/coverage.py names what no longer exists: {stale}"


def test_every_mapping_names_an_operation_the_engine_runs():
    runs = set(engine.WEIGHTS) | set(engine.EVENTS) | set(engine.FINAL)
    unknown = {k: v for k, v in COVERS.items() if v not in runs}
    assert not unknown, f"COVERS maps to operations the engine does not have: {unknown}"


def test_exemptions_say_why():
    for name, why in EXEMPT.items():
        assert len(why) > 40, f"{name}: say why the simulation cannot drive it"
