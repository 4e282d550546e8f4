"""Which implementation `kernels.ops` runs: the Triton kernels or the PyTorch references.

The choice is made once at import: Triton when CUDA is available, the reference otherwise;
the environment variable KVTIER_KERNELS=triton|reference overrides it. Tests flip it with
`set_backend(name)` or the context manager `use(name)`.

The Triton modules are imported lazily, on the first call that needs them, because Triton
decides at decoration time whether a kernel runs compiled or under the interpreter
(TRITON_INTERPRET=1); importing them eagerly would freeze that choice too early.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

BACKENDS = ("triton", "reference")
ENV_VAR = "KVTIER_KERNELS"


def _default_backend() -> str:
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested:
        if requested not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={requested!r}: expected one of {BACKENDS}")
        return requested
    return "triton" if torch.cuda.is_available() else "reference"


_current = _default_backend()


def current() -> str:
    """Name of the selected backend: 'triton' or 'reference'."""
    return _current


def set_backend(name: str) -> None:
    """Select the backend for every later call through `kernels.ops`."""
    global _current
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}: expected one of {BACKENDS}")
    _current = name


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run a block with `name` selected, restoring the previous backend afterwards."""
    previous = _current
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# CPU tensors reach the Triton path only when asked for: with TRITON_INTERPRET=1 and
# KVTIER_KERNELS=triton both set at start-up, or inside cpu_through_interpreter() (tests).
# Otherwise a process that merely has the interpreter on would run every CPU op interpreted.
_cpu_via_interpreter = os.environ.get(ENV_VAR, "").strip().lower() == "triton"


@contextlib.contextmanager
def cpu_through_interpreter() -> Iterator[None]:
    """For the block, the Triton backend takes CPU tensors too (needs TRITON_INTERPRET=1)."""
    global _cpu_via_interpreter
    previous = _cpu_via_interpreter
    _cpu_via_interpreter = True
    try:
        yield
    finally:
        _cpu_via_interpreter = previous


def triton_usable(*tensors: torch.Tensor) -> bool:
    """Whether the Triton path runs these tensors: CUDA ones, or CPU ones under the
    interpreter when CPU routing is on (see cpu_through_interpreter)."""
    if all(t.is_cuda for t in tensors):
        return True
    return interpreting() and _cpu_via_interpreter and not any(t.is_cuda for t in tensors)


def triton_module() -> ModuleType:
    """The module holding the Triton wrappers (imported on first use)."""
    return importlib.import_module("kernels.triton_ops")
