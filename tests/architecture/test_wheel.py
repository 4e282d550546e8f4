"""What the wheel ships: the product packages, every one of their sub-packages, and none
of bench, stress, testing or tests (read from pyproject.toml's package finder; the slow
test builds the wheel itself); the image copies the same packages, and the shipped
code imports none of what is left out."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from setuptools import find_namespace_packages, find_packages

from services.cli.init import DEPLOY_FILES, deploy_file

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = {"kvtier", "kvstore", "services", "replay", "model", "kernels", "proto"}
NOT_SHIPPED = ("bench", "stress", "testing", "tests")


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def shipped_packages() -> set[str]:
    found = setuptools_config()["packages"]["find"]
    return set(find_packages(str(ROOT), include=found.get("include", ("*",)),
                             exclude=found.get("exclude", ())))


def test_the_wheel_ships_every_product_package_and_nothing_else():
    shipped = shipped_packages()
    assert {name.split(".")[0] for name in shipped} == PRODUCT
    # a directory of modules without __init__.py would be left out of the wheel unseen
    with_modules = {name for name in find_namespace_packages(str(ROOT), include=[
        f"{top}*" for top in PRODUCT]) if any((ROOT / name.replace(".", "/")).glob("*.py"))}
    assert with_modules <= shipped, sorted(with_modules - shipped)


IMPORT = re.compile(r"^\s*(?:from|import)\s+(\w+)", re.MULTILINE)


def imported_tops(top: str) -> set[str]:
    """The top-level names the modules under ``top`` import (absolute imports)."""
    return {name for path in (ROOT / top).rglob("*.py")
            for name in IMPORT.findall(path.read_text())}


def test_shipped_code_imports_nothing_the_wheel_leaves_out():
    for top in PRODUCT:
        assert not imported_tops(top) & set(NOT_SHIPPED), top
    # stress and testing sit below bench: bench may import them, never the other way
    assert "bench" not in imported_tops("stress") | imported_tops("testing")


def test_package_data_names_only_product_packages():
    assert set(setuptools_config().get("package-data", {})) <= PRODUCT
    assert not (ROOT / "MANIFEST.in").exists()  # sdist extras could pull bench in


def test_the_image_copies_the_product_packages_alone():
    """deploy/Dockerfile installs the wheel from what it copies: the product and the deploy
    files it ships, no more (not deploy/dev-certs)."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = {line.split()[1] for line in dockerfile.splitlines()
              if line.startswith("COPY ") and (ROOT / line.split()[1]).is_dir()}
    assert copied == PRODUCT | {"deploy/grafana"}
    copies = [line.split()[1:-1] for line in dockerfile.replace("\\\n", " ").splitlines()
              if line.startswith("COPY ")]
    sources = {source for line in copies for source in line}
    for name in DEPLOY_FILES:
        assert f"deploy/{name}" in sources or name.startswith("grafana/"), name
    assert not {s for s in sources if s in ("deploy", "deploy/") or "dev-certs" in s}


def test_the_deploy_files_ship_as_package_data():
    """``kvtier init`` writes the deploy files from the installed package: each is package
    data of ``services`` (services/deploy links to deploy/, one copy of each) and reads
    back through importlib.resources as the repository's file."""
    patterns = setuptools_config()["package-data"]["services"]
    assert (ROOT / "services" / "deploy").resolve() == (ROOT / "deploy").resolve()
    for name in DEPLOY_FILES:
        assert any(fnmatch.fnmatch(f"deploy/{name}", pattern) for pattern in patterns), name
        assert deploy_file(name) == (ROOT / "deploy" / name).read_bytes(), name
    shipped = {str(path.relative_to(ROOT / "services" / "deploy")) for pattern in patterns
               for path in (ROOT / "services").glob(pattern)}
    assert shipped == set(DEPLOY_FILES)  # nothing more: never deploy/dev-certs


@pytest.mark.slow
def test_the_built_wheel_holds_no_bench_stress_or_testing_code(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "node_modules", "build", "*.egg-info", "__pycache__", "data"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(tree)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("kvtier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == PRODUCT
    assert {f"services/deploy/{name}" for name in DEPLOY_FILES} <= set(names)
    assert not any(top.startswith(NOT_SHIPPED) for top in tops)
