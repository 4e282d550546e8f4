"""The ``cpu`` backend's driver half: always active, the torch device is the CPU."""

from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the cpu backend only runs under TRITON_INTERPRET=1")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 1)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_benchmarker(self):
        raise NotImplementedError("the cpu backend only runs under TRITON_INTERPRET=1")
