"""``kvtier --version``: the package's version (``services.server.version``)."""

from __future__ import annotations

import argparse

from services.server.version import package_version


class VersionAction(argparse.Action):
    """Like argparse's ``version`` action, but reads the version only when asked for."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"kvtier {package_version()}")
        parser.exit()
