"""The backend switch: default choice, environment override, flipping, and what the Triton
path does with CPU tensors when the interpreter is off."""

from __future__ import annotations

import pytest
import torch

from kernels import backend, interpret, ops
from kernels import reference as ref

if not torch.cuda.is_available():
    interpret.enable()  # before anything imports triton compiled (see kernels/interpret.py)


def test_default_follows_cuda_and_env_overrides(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert backend._default_backend() == ("triton" if torch.cuda.is_available() else "reference")
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    assert backend._default_backend() == "triton"
    monkeypatch.setenv(backend.ENV_VAR, "Reference")
    assert backend._default_backend() == "reference"
    monkeypatch.setenv(backend.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="KVTIER_KERNELS"):
        backend._default_backend()


def test_use_restores_the_previous_backend_even_on_error():
    before = backend.current()
    with pytest.raises(RuntimeError), backend.use("triton"):
        assert backend.current() == "triton"
        raise RuntimeError("boom")
    assert backend.current() == before
    with pytest.raises(ValueError, match="unknown kernel backend"):
        backend.set_backend("cuda")


def test_cpu_tensors_take_the_reference_unless_routed_through_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(3, 32)
    assert not backend.triton_usable(x)  # interpreter on alone does not reroute CPU ops
    with backend.cpu_through_interpreter():
        assert backend.triton_usable(x)
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not backend.triton_usable(x)
    assert not backend.triton_usable(x)
    with backend.use("triton"):
        codes, scales = ops.quantize_int8(x, 16)
    want = ref.quantize_int8(x, 16)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])


def test_triton_wrapper_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        backend.triton_module().quantize_int4(torch.randn(2, 16), 8)
