"""Run the Triton kernels under Triton's CPU interpreter, for tests and GPU-less smoke checks.

Triton decides at decoration time whether a kernel is compiled or interpreted, so the kernel
modules are (re)imported with TRITON_INTERPRET=1 set, and re-imported again afterwards so
code outside the block gets compiled kernels as usual.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

from kernels import backend

# dependency order: later modules import helpers from earlier ones
_TRITON_MODULES = (
    "kernels.triton_quant",
    "kernels.triton_attention",
    "kernels.triton_indexer",
    "kernels.triton_ops",
)


def _load_kernel_modules() -> ModuleType:
    for name in _TRITON_MODULES:
        module = sys.modules.get(name)
        if module is None:
            importlib.import_module(name)
        else:
            importlib.reload(module)
    return backend.triton_module()


@contextlib.contextmanager
def interpreter() -> Iterator[ModuleType]:
    """Yields kernels.triton_ops with every kernel interpreted (CPU tensors welcome)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield _load_kernel_modules()
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
        _load_kernel_modules()
