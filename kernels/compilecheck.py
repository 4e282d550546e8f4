"""`python -m kernels.compilecheck`: compile every Triton kernel for a CUDA GPU without one.

The interpreter checks the maths but not what only the compiler sees (type rules of loop
variables, layouts, register pressure). This compiles each kernel ahead of time for a
target architecture (default sm_90, the H100/H200), with the same launch configuration the
wrappers use at realistic sizes, through Triton's bundled ptxas; it prints registers and
spill stack per kernel when cuobjdump is available. Exit status 1 if any kernel fails.
Run it in a process where TRITON_INTERPRET is not set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import backend
from kernels import triton_attention as attention
from kernels import triton_indexer as indexer
from kernels import triton_quant as quant
from kernels import triton_topk as topk


@dataclass(frozen=True)
class Build:
    label: str
    kernel: object  # a triton JITFunction
    types: dict[str, str]  # runtime argument name -> Triton signature type
    launch: dict  # constexprs, plus num_warps when the wrapper sets it


_Q4 = {"packed_ptr": "*u8", "scale_ptr": "*fp16", "M": "i32"}
_Q8 = {"codes_ptr": "*i8", "scale_ptr": "*fp16", "M": "i32"}
_WINDOW = {"q_ptr": "*fp32", "kc_ptr": "*i8", "ks_ptr": "*fp16", "vc_ptr": "*i8",
           "vs_ptr": "*fp16", "qpos_ptr": "*i64", "kpos_ptr": "*i64", "out_ptr": "*fp32",
           "lse_ptr": "*fp32", "H": "i32", "HKV": "i32", "T": "i32", "S": "i32",
           "window": "i32", "sm_scale": "fp32"}
_SPARSE = {"q_ptr": "*fp32", "kv_ptr": "*u8", "sc_ptr": "*fp16", "idx_ptr": "*i32",
           "out_ptr": "*fp32", "lse_ptr": "*fp32", "H": "i32", "T": "i32", "N": "i32",
           "K": "i32", "K_SPLIT": "i32", "sm_scale": "fp32",
           **{f"{t}_s{d}": "i32" for t in ("out", "lse") for d in "btsh"}}
_INDEXER = {"qi_ptr": "*fp32", "kp_ptr": "*u8", "ks_ptr": "*fp16", "w_ptr": "*fp32",
            "nvis_ptr": "*i64", "out_ptr": "*fp32", "T": "i32", "HI": "i32", "N": "i32"}


def builds() -> list[Build]:
    """Every kernel, at the launch configurations of the sizes kernels.gpucheck runs."""
    return [
        Build("quantize_int4 g32", quant._quantize_int4_kernel,
              {"x_ptr": "*fp32", **_Q4}, quant.int4_launch(32)),
        Build("dequantize_int4 g32", quant._dequantize_int4_kernel,
              {**_Q4, "out_ptr": "*fp32"}, quant.int4_launch(32)),
        Build("quantize_int8 g32", quant._quantize_int8_kernel,
              {"x_ptr": "*fp32", **_Q8}, quant.int8_launch(32)),
        Build("dequantize_int8 g32", quant._dequantize_int8_kernel,
              {**_Q8, "out_ptr": "*fp32"}, quant.int8_launch(32)),
        Build("pack_int4", quant._pack_int4_kernel,
              {"q_ptr": "*i8", "packed_ptr": "*u8", "P": "i32"}, {"BLOCK": 2048}),
        Build("unpack_int4", quant._unpack_int4_kernel,
              {"packed_ptr": "*u8", "q_ptr": "*i8", "P": "i32"}, {"BLOCK": 2048}),
        Build("window decode rep4 Dh128", attention._window_attention_kernel, _WINDOW,
              attention.window_launch(4, 1, 128, 32)),
        Build("window replay rep4 T128 Dh128", attention._window_attention_kernel, _WINDOW,
              attention.window_launch(4, 128, 128, 32)),
        Build("sparse H16 Dc512", attention._sparse_attention_kernel, _SPARSE,
              attention.sparse_launch(16, 512, 32)),
        Build("sparse H16 Dc256", attention._sparse_attention_kernel, _SPARSE,
              attention.sparse_launch(16, 256, 32)),
        Build("sparse H4 Dc64", attention._sparse_attention_kernel, _SPARSE,
              attention.sparse_launch(4, 64, 16)),
        Build("indexer_scores Di128", indexer._indexer_scores_kernel, _INDEXER,
              indexer.indexer_launch(128, 32)),
        Build("indexer_topk", topk._topk_select_kernel,
              {"scores_ptr": "*fp32", "cand_ptr": "*fp32", "out_ptr": "*i32", "N": "i32",
               "P": "i32", "K": "i32"}, topk.topk_launch(16384, False)),
        Build("indexer_topk pool", topk._topk_select_kernel,
              {"scores_ptr": "*fp32", "cand_ptr": "*i64", "out_ptr": "*i32", "N": "i32",
               "P": "i32", "K": "i32"}, topk.topk_launch(4096, True)),
    ]


def _resource_usage(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=False).stdout
    fields = [part for line in out.splitlines() if "REG:" in line for part in line.split()]
    return " ".join(p for p in fields if p.startswith(("REG:", "STACK:")))


def compile_one(build: Build, arch: int) -> tuple[bool, str]:
    launch = dict(build.launch)
    num_warps = launch.pop("num_warps", 4)
    signature = {**build.types, **{name: "constexpr" for name in launch}}
    source = ASTSource(build.kernel, signature, launch)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps})
    usage = _resource_usage(compiled.asm["cubin"]) if "cubin" in compiled.asm else ""
    return True, f"smem={compiled.metadata.shared} {usage}".strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    opts = parser.parse_args(argv)
    if backend.interpreting():
        print("kernels.compilecheck: TRITON_INTERPRET is set, so the kernels are interpreted "
              "and cannot be compiled: unset it and rerun")
        return 2
    failures = 0
    for build in builds():
        start = time.perf_counter()
        try:
            _, detail = compile_one(build, opts.arch)
            status = "ok"
        except Exception as exc:  # report every kernel, not only the first failure
            failures += 1
            status, detail = "FAILED", f"{type(exc).__name__}: {exc}"
        print(f"{build.label:<32} sm_{opts.arch} {status:<6} "
              f"{time.perf_counter() - start:5.1f}s {detail}", flush=True)
    print(f"kernels.compilecheck: {len(builds()) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
