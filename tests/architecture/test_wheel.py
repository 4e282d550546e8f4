"""What the wheel ships: the product packages, every one of their sub-packages, and none
of bench, stress, testing or tests (read from pyproject.toml's package finder; the slow
test builds the wheel itself); the image copies the same packages, and the shipped
code imports none of what is left out."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from setuptools import find_namespace_packages, find_packages

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
    """deploy/Dockerfile installs the wheel from what it copies: the product, no more."""
    copied = {line.split()[1] for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and (ROOT / line.split()[1]).is_dir()}
    assert copied == PRODUCT


@pytest.mark.slow
def test_the_built_wheel_holds_no_bench_stress_or_testing_code(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "node_modules", "build", "*.egg-info", "__pycache__", "data"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(tree)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("kvtier-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == PRODUCT
    assert not any(top.startswith(NOT_SHIPPED) for top in tops)
