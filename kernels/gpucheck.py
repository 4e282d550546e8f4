"""`python -m kernels.gpucheck`: every Triton kernel against its PyTorch reference.

On a CUDA machine: realistic sizes (replay T=128 and decode T=1, a 128-token window, 16k
compressed entries, Dc=512, K up to 2048), max abs error, Triton and reference timed in the
same run (CUDA events, after warm-up), and the Triton kernel's achieved GB/s counted from
the bytes it must move. Prints a table, then one JSON line. Exit status 1 if any kernel
disagrees with its reference.

Without CUDA it says so, runs the same checks under the Triton interpreter at tiny sizes
(correctness only; those timings mean nothing) and exits 0 when they agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import backend, reference
from kernels.interpret import interpreter

Args = tuple


@dataclass(frozen=True)
class Case:
    name: str
    kernel: str  # function name in kernels.reference and kernels.triton_ops
    make: Callable[[torch.device], Args]
    bytes_moved: int  # minimum bytes the Triton kernel reads and writes
    exact: bool  # integer outputs / bit-identical maths: require equality
    tol: float = 0.0  # else: max abs error allowed, relative to max(1, max |reference|)


def _randn(gen: torch.Generator, *shape: int, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device)


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _quant_cases(rows: int, dim: int, group: int) -> list[Case]:
    n = rows * dim
    groups = n // group

    def x(dev):
        return (_randn(_gen(dev, 0), rows, dim, device=dev),)

    def int4(dev):
        return (*reference.quantize_int4(x(dev)[0], group), group)

    def int8(dev):
        return (*reference.quantize_int8(x(dev)[0], group), group)

    def codes4(dev):
        return (torch.randint(-8, 8, (rows, dim), generator=_gen(dev, 1), device=dev,
                              dtype=torch.int8),)

    def packed(dev):
        return (reference.pack_int4(codes4(dev)[0]),)

    return [
        Case(f"quantize_int4 {rows}x{dim} g{group}", "quantize_int4",
             lambda d: (*x(d), group), 4 * n + n // 2 + 2 * groups, exact=True),
        Case(f"dequantize_int4 {rows}x{dim} g{group}", "dequantize_int4", int4,
             n // 2 + 2 * groups + 4 * n, exact=True),
        Case(f"quantize_int8 {rows}x{dim} g{group}", "quantize_int8",
             lambda d: (*x(d), group), 4 * n + n + 2 * groups, exact=True),
        Case(f"dequantize_int8 {rows}x{dim} g{group}", "dequantize_int8", int8,
             n + 2 * groups + 4 * n, exact=True),
        Case(f"pack_int4 {rows}x{dim}", "pack_int4", codes4, n + n // 2, exact=True),
        Case(f"unpack_int4 {rows}x{dim}", "unpack_int4", packed, n // 2 + n, exact=True),
    ]


def _window_case(b, h, hkv, t, s, dh, group, window) -> Case:
    def make(dev):
        g = _gen(dev, 2)
        kc, ks = reference.quantize_int8(_randn(g, b, hkv, s, dh, device=dev), group)
        vc, vs = reference.quantize_int8(_randn(g, b, hkv, s, dh, device=dev), group)
        q = _randn(g, b, h, t, dh, device=dev)
        k_pos = torch.arange(s, device=dev)
        q_pos = torch.arange(t, device=dev) + s - t
        return q, kc, ks, vc, vs, q_pos, k_pos, window, group, dh ** -0.5

    kv_bytes = 2 * b * hkv * s * (dh + 2 * dh // group)
    moved = kv_bytes + 4 * b * h * t * dh * 2 + 4 * b * h * t
    return Case(f"window_attention B{b} H{h}/{hkv} T{t} S{s} Dh{dh}", "window_attention",
                make, moved, exact=False, tol=1e-4)


def _sparse_case(b, h, t, n, dc, k, group) -> Case:
    def make(dev):
        g = _gen(dev, 3)
        kv_packed, kv_scales = reference.quantize_int4(_randn(g, b, n, dc, device=dev), group)
        q = _randn(g, b, h, t, dc, device=dev) * dc ** -0.25
        # distinct random entries per query, the last eighth of the slots unused
        idx = torch.rand(b, t, n, generator=g, device=dev).argsort(dim=-1)[..., :k]
        idx = idx.to(torch.int32)
        idx[..., k - k // 8:] = -1
        return q, kv_packed, kv_scales, idx, group, dc ** -0.5

    entry = dc // 2 + 2 * dc // group
    moved = b * t * k * (entry + 4) + 4 * b * h * t * dc * 2 + 4 * b * h * t
    return Case(f"sparse_attention B{b} H{h} T{t} N{n} Dc{dc} K{k}",
                "sparse_compressed_attention", make, moved, exact=False, tol=1e-4)


def _indexer_case(b, t, hi, di, n, group) -> Case:
    def make(dev):
        g = _gen(dev, 4)
        kp, ks = reference.quantize_int4(_randn(g, b, n, di, device=dev), group)
        qi = _randn(g, b, t, hi, di, device=dev)
        w = torch.rand(b, t, hi, generator=g, device=dev)
        # one row per batch row, as batched replay passes sessions of different lengths
        shorter = torch.arange(b, device=dev).view(b, 1) * (n // (2 * b))
        n_visible = (torch.arange(t, device=dev) + (n - t + 1) - shorter).clamp_min(0)
        return qi, kp, ks, w, n_visible, group

    moved = b * n * (di // 2 + 2 * di // group) + 4 * b * t * hi * (di + 1) + 4 * b * t * n
    return Case(f"indexer_scores B{b} T{t} Hi{hi} Di{di} N{n}", "indexer_scores", make,
                moved, exact=False, tol=1e-5)


def _topk_case(b, t, n, k, pool) -> Case:
    def make(dev):
        g = _gen(dev, 5)
        scores = torch.round(_randn(g, b, t, n, device=dev) * 16) / 16  # plenty of ties
        cand = None
        if pool:
            cand = torch.rand(b, t, n, generator=g, device=dev).argsort(-1)[..., :pool]
            cand = cand.to(torch.int32)
        return scores, k, cand

    moved = 4 * b * t * (pool or n) * (2 if pool else 1) + 4 * b * t * k
    label = f" pool{pool}" if pool else ""
    return Case(f"indexer_topk B{b} T{t} N{n} k{k}{label}", "indexer_topk", make, moved,
                exact=True)


def gpu_cases() -> list[Case]:
    return [
        *_quant_cases(8 * 16384, 512, 32),
        *_quant_cases(8 * 8 * 256, 128, 32)[2:4],
        _window_case(1, 8, 2, 1, 256, 128, 32, 128),
        _window_case(8, 8, 2, 128, 256, 128, 32, 128),
        _sparse_case(1, 16, 1, 16384, 512, 2048, 32),
        _sparse_case(8, 16, 128, 16384, 512, 512, 32),
        _sparse_case(8, 16, 128, 16384, 512, 2048, 32),
        _sparse_case(8, 16, 128, 16384, 256, 2048, 32),
        _indexer_case(1, 1, 16, 128, 16384, 32),
        _indexer_case(8, 128, 16, 128, 16384, 32),
        _topk_case(8, 128, 16384, 2048, 0),
        _topk_case(8, 128, 16384, 512, 4096),
    ]


def tiny_cases() -> list[Case]:
    return [
        *_quant_cases(6, 48, 16),
        _window_case(2, 4, 2, 5, 37, 24, 8, 16),
        _sparse_case(2, 4, 5, 13, 48, 6, 16),
        _indexer_case(2, 5, 3, 48, 13, 16),
        _topk_case(1, 2, 13, 4, 0),
        _topk_case(1, 2, 13, 4, 9),
    ]


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def _max_error(got, want) -> tuple[float, float]:
    """(max abs error over finite entries, max |reference|); inf if -inf/NaN patterns differ."""
    worst, scale = 0.0, 0.0
    for g, w in zip(_outputs(got), _outputs(want), strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            return float("inf"), 0.0
        if g.is_floating_point():
            if not torch.equal(torch.isfinite(g), torch.isfinite(w)):
                return float("inf"), 0.0
            finite = torch.isfinite(w)
            if finite.any():
                worst = max(worst, (g[finite] - w[finite]).abs().max().item())
                scale = max(scale, w[finite].abs().max().item())
        elif not torch.equal(g, w):
            worst = max(worst, (g.long() - w.long()).abs().max().item())
    return worst, scale


def _time_ms(fn: Callable[[], object], cuda: bool, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run_case(case: Case, triton_ops, device: torch.device, cuda: bool) -> dict:
    args = case.make(device)
    want = getattr(reference, case.kernel)(*args)
    got = getattr(triton_ops, case.kernel)(*args)
    err, scale = _max_error(got, want)
    ok = err == 0.0 if case.exact else err <= case.tol * max(1.0, scale)
    warmup, iters = (3, 10) if cuda else (0, 1)
    tri_ms = _time_ms(lambda: getattr(triton_ops, case.kernel)(*args), cuda, warmup, iters)
    ref_ms = _time_ms(lambda: getattr(reference, case.kernel)(*args), cuda, warmup, iters)
    return {"case": case.name, "ok": ok, "max_abs_err": err, "triton_ms": round(tri_ms, 4),
            "reference_ms": round(ref_ms, 4), "speedup": round(ref_ms / tri_ms, 2),
            "triton_gb_s": round(case.bytes_moved / tri_ms / 1e6, 1)}


def _print_table(rows: list[dict], out=sys.stdout) -> None:
    header = f"{'case':<52} {'ok':<4} {'max err':>9} {'triton ms':>10} {'ref ms':>10} " \
             f"{'speedup':>8} {'GB/s':>8}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        print(f"{r['case']:<52} {'yes' if r['ok'] else 'NO':<4} {r['max_abs_err']:>9.2e} "
              f"{r['triton_ms']:>10.3f} {r['reference_ms']:>10.3f} {r['speedup']:>8.2f} "
              f"{r['triton_gb_s']:>8.1f}", file=out)


def _run(cases: list[Case], triton_ops, device: torch.device, cuda: bool) -> list[dict]:
    rows = []
    for case in cases:
        try:
            rows.append(run_case(case, triton_ops, device, cuda))
            if cuda:
                torch.cuda.empty_cache()  # the large cases would otherwise pile up
        except Exception as exc:  # report every kernel, not just the first failure
            rows.append({"case": case.name, "ok": False, "max_abs_err": float("inf"),
                         "triton_ms": 0.0, "reference_ms": 0.0, "speedup": 0.0,
                         "triton_gb_s": 0.0, "error": f"{type(exc).__name__}: {exc}"})
        print(f"  {rows[-1]['case']}: {'ok' if rows[-1]['ok'] else 'MISMATCH'}",
              file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="use the tiny interpreter sizes even on a CUDA machine")
    opts = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not opts.tiny
    if cuda:
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
        print(f"kernels.gpucheck on {name}: Triton vs reference at realistic sizes", flush=True)
        rows = _run(gpu_cases(), backend.triton_module(), device, cuda=True)
    else:
        name = "cpu (Triton interpreter)"
        why = "--tiny given" if torch.cuda.is_available() else "no CUDA device"
        print(f"kernels.gpucheck: {why}, so no GPU numbers. Running every kernel under "
              "the Triton interpreter (TRITON_INTERPRET=1) at tiny sizes instead: this checks "
              "correctness only; its timings are meaningless.", flush=True)
        with interpreter() as triton_ops:  # needs triton not imported yet in this process
            rows = _run(tiny_cases(), triton_ops, torch.device("cpu"), cuda=False)
    _print_table(rows)
    ok = all(r["ok"] for r in rows)
    for r in rows:
        if "error" in r:
            print(f"{r['case']}: {r['error']}")
    print(json.dumps({"device": name, "mode": "cuda" if cuda else "interpreter", "ok": ok,
                      "torch": torch.__version__, "results": rows}))
    if not ok:
        print("kernels.gpucheck: some kernels DISAGREE with their references", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
