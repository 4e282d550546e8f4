"""Run the Triton kernels under Triton's CPU interpreter, for tests and GPU-less smoke checks.

Triton decides when a function is decorated whether it is compiled or interpreted, and that
includes Triton's own library (tl.max, tl.sum, ...), decorated when triton is first
imported. So interpreting is a process-wide mode: TRITON_INTERPRET=1 must be set before
anything imports triton. `enable()` sets it, checks it was in time, and (re)imports our
kernel modules under it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import torch

from kernels import backend

# dependency order: later modules import helpers from earlier ones
_TRITON_MODULES = (
    "kernels.triton_quant",
    "kernels.triton_attention",
    "kernels.triton_indexer",
    "kernels.triton_topk",
    "kernels.triton_ops",
)


def enable() -> ModuleType:
    """Switches this process to the Triton interpreter; returns kernels.triton_ops with every
    kernel interpreted. Raises RuntimeError if triton was already imported without it."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language.standard as triton_std
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(triton_std.max, InterpretedFunction):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its library is compiled "
            "and cannot be interpreted in this process: set TRITON_INTERPRET=1 in the "
            "environment before starting Python")
    loaded = [sys.modules[name] for name in _TRITON_MODULES if name in sys.modules]
    if any(isinstance(value, JITFunction) for m in loaded for value in vars(m).values()):
        for module in loaded:  # imported compiled earlier: redecorate under the interpreter
            importlib.reload(module)
    for name in _TRITON_MODULES:
        importlib.import_module(name)
    return backend.triton_module()


@contextlib.contextmanager
def interpreter() -> Iterator[ModuleType]:
    """Enables the interpreter and, for the block, lets kernels.ops send CPU tensors to the
    Triton backend (outside it they take the reference). Yields kernels.triton_ops."""
    module = enable()
    with backend.cpu_through_interpreter():
        yield module


class TritonOnDevice:
    """kernels.triton_ops seen from CPU tensors: each call moves tensor arguments to `device`,
    runs the Triton wrapper there and brings tensor results back to the CPU."""

    def __init__(self, module: ModuleType, device: torch.device) -> None:
        self.module = module
        self.device = device

    def to_device(self, value):
        return value.to(self.device) if isinstance(value, torch.Tensor) else value

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)

        def call(*args):
            result = fn(*(self.to_device(a) for a in args))
            if isinstance(result, tuple):
                return tuple(r.cpu() for r in result)
            return result.cpu()

        return call


@contextlib.contextmanager
def triton_under_test() -> Iterator[TritonOnDevice]:
    """The Triton backend as tests exercise it: compiled kernels on CUDA when a GPU is
    present, else the interpreter on the CPU."""
    if torch.cuda.is_available():
        yield TritonOnDevice(backend.triton_module(), torch.device("cuda"))
    else:
        with interpreter() as module:
            yield TritonOnDevice(module, torch.device("cpu"))
