"""The README's "What is where" table against the tree, and the README's links.

- Every path a row names (its "where" cell) exists.
- Every top-level folder of the repository, and every Python package of the product, is
  named by a row: a "where" path at or inside it, or a path its notes give (`disk/`).
- Every module, file or folder a row's notes name (`stack.py`, `trace/`,
  `tests/conftest.py`, `python -m kernels.gpucheck`) exists: as a path from the root, or
  below one of the row's own folders.
- Every link of README.md and docs/design.md opens a file of the repository (a clone has
  nothing beside it), and no path the README quotes leaves it (`../`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.service import ROOT

PRODUCT = ("kvtier", "kvstore", "services", "replay", "model", "kernels", "proto")
README = ROOT / "README.md"
_QUOTED = re.compile(r"`([^`]+)`")
_FILE = re.compile(r"^[\w.-]+\.(py|js|md|proto|toml|yml|yaml|json|txt|lock|in)$")
_RUN_MODULE = re.compile(r"python -m ([\w.]+)$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass
class Row:
    part: str
    where: list[str]
    notes: list[str]

    def folders(self) -> list[Path]:
        """The row's own folders: its "where" folders, and the folder of each file."""
        paths = [ROOT / w for w in self.where]
        return [p if p.is_dir() else p.parent for p in paths]


def rows() -> list[Row]:
    text = README.read_text()
    body = text.split("\n## What is where\n", 1)[1]
    table = [line for line in body.splitlines() if line.startswith("| ")]
    out = []
    for line in table[2:]:  # past the header and its rule
        part, where, notes = (cell.strip() for cell in line.strip("|").split(" | ", 2))
        out.append(Row(part, _QUOTED.findall(where), _QUOTED.findall(notes)))
    return out


def resolve(row: Row, token: str) -> Path | None | bool:
    """The path a quoted token of ``row``'s notes names; None when it names none that
    exists; False when the token is no path (a class, a command, a config key)."""
    if match := _RUN_MODULE.search(token):
        module = ROOT / match.group(1).replace(".", "/")
        found = next((p for p in (module.with_suffix(".py"), module / "__init__.py")
                      if p.exists()), None)
        return found.parent if found is not None and found.name == "__init__.py" else found
    if " " in token or not ("/" in token or _FILE.match(token)):
        return False
    name = token.rstrip("/")
    candidates = [ROOT / name] + [folder / name for folder in row.folders()]
    candidates += [p for folder in row.folders() for p in sorted(folder.rglob(name))
                   if "__pycache__" not in p.parts]
    return next((p.resolve() for p in candidates if p.exists()), None)


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    return [f for f in listed if (ROOT / f).exists()]


def test_every_path_a_row_names_exists() -> None:
    missing = [(row.part, w) for row in rows() for w in row.where if not (ROOT / w).exists()]
    assert not missing, missing


def test_every_module_a_row_describes_exists() -> None:
    missing = [(row.part, token) for row in rows() for token in row.notes
               if resolve(row, token) is None]
    assert not missing, missing


def test_every_top_level_folder_and_product_package_is_listed() -> None:
    files = tracked_files()
    folders = {f.split("/", 1)[0] for f in files if "/" in f and not f.startswith(".")}
    packages = {str(Path(f).parent) for f in files
                if f.endswith("/__init__.py") and f.split("/", 1)[0] in PRODUCT}
    named = set()
    for row in rows():
        named |= {(ROOT / w).resolve() for w in row.where}
        named |= {p for token in row.notes if isinstance(p := resolve(row, token), Path)}

    def listed(folder: str) -> bool:
        path = (ROOT / folder).resolve()
        return any(n == path or n.is_relative_to(path) for n in named)

    unlisted = sorted(f for f in folders | packages if not listed(f))
    assert not unlisted, f"not in README's 'What is where': {unlisted}"


@pytest.mark.parametrize("document", ["README.md", "docs/design.md"])
def test_links_open_files_of_the_repository(document: str) -> None:
    path = ROOT / document
    broken = []
    for target in _LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        opened = (path.parent / target.split("#", 1)[0]).resolve()
        if not opened.is_relative_to(ROOT) or not opened.exists():
            broken.append(target)
    assert not broken, broken


def test_the_readme_quotes_no_path_outside_the_repository() -> None:
    outside = [t for t in _QUOTED.findall(README.read_text()) if "../" in t]
    assert not outside, outside
