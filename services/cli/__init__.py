"""The ``kvtier`` command line: one module per command (see ``services.cli.main``)."""

from services.cli.main import main

__all__ = ["main"]
