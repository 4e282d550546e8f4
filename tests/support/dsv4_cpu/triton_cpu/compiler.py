"""The ``cpu`` backend's compiler half: it never compiles (interpreter only)."""

from __future__ import annotations

import hashlib

from triton.backends.compiler import BaseBackend, GPUTarget, Language


class InterpreterOnlyBackend(BaseBackend):

    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return hashlib.sha256(b"kvtier-test-cpu-interpreter").hexdigest()

    def parse_options(self, options: dict) -> object:
        raise NotImplementedError("the cpu backend only runs under TRITON_INTERPRET=1")

    def add_stages(self, stages: dict, options: object, language: Language) -> None:
        raise NotImplementedError("the cpu backend only runs under TRITON_INTERPRET=1")

    def load_dialects(self, context) -> None:
        raise NotImplementedError("the cpu backend only runs under TRITON_INTERPRET=1")

    def get_module_map(self) -> dict:
        return {}
