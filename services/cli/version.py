"""``kvtier --version``: the installed package's version, or pyproject's in a checkout
that was never installed."""

from __future__ import annotations

import argparse
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


class VersionAction(argparse.Action):
    """Like argparse's ``version`` action, but reads the version only when asked for."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"kvtier {package_version()}")
        parser.exit()
