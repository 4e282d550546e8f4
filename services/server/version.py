"""The package's version: the installed one's, or pyproject's in a checkout that was
never installed (the server's build info and ``kvtier --version`` both name it)."""

from __future__ import annotations

from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:
        import tomllib

        with open(PYPROJECT, "rb") as handle:
            return tomllib.load(handle)["project"]["version"]
