"""``python -m flashlab bench backward``: the backward pass, the course's kernels against PyTorch SDPA and naive CuPy.

Given the forward's o and lse, each main kernel of ``flashlab.gpu.backward`` (impl ``ours_<kernel>``) is timed
against PyTorch SDPA's flash and cuDNN backends (autograd backward only) and naive CuPy (P materialised), in one
run on the same random fp16 inputs; each implementation's gradients are computed once (into fresh arrays) and
compared with the first implementation's before timing, then timed under each protocol of --protocols (one row
each; the course's kernels into preallocated gradients with a reused workspace). FLOP = 2.5 x the forward's
4 n^2 d batch heads (half with the causal mask). Rows: pass "bwd", written to data/ch8/bwd.json (not
data/benchmarks/, whose rows are forward rows checked against the forward FLOP count).
"""

from __future__ import annotations

import argparse
import sys

from .. import records
from ..gpu import backward
from . import (
    add_dtypes,
    add_protocols,
    add_rounds,
    error_line,
    gpu_main,
    median_times,
    ratio_cells,
    record_parser,
    run_grid,
    training_kernel_hashes,
    without_torch,
)
from .forward import flop

OUT_DIR = records.DATA_DIR / "ch8"
IMPLS = ("sdpa_flash", "ours_pipe", "ours_mma", "ours_smem", "sdpa_cudnn", "cupy_naive")


def bwd_flop(n: int, d: int, batch: int, heads: int, causal: bool) -> float:
    """Backward FLOP: 2.5 x the forward's (five n x n x d products instead of two)."""
    return 2.5 * flop(n, d, batch, heads, causal)


def _bwd_impl(name: str, arrays: list, causal: bool):
    """(kind, fn, result) where result() runs once into fresh arrays and returns (dq, dk, dv) as CuPy arrays."""
    import cupy as cp

    import flashlab.gpu as fgpu

    q, k, v, do = arrays
    bf16 = q.dtype == cp.uint16  # bfloat16 bit patterns (run_grid's --dtypes bfloat16)
    if name.removeprefix("ours_") in backward.KERNELS:
        o, lse = fgpu.attention(q, k, v, causal=causal, bf16=bf16)
        kernel = name.removeprefix("ours_")
        out = (cp.empty_like(q), cp.empty_like(k), cp.empty_like(v))
        workspace = fgpu.Workspace()

        def fn():
            return fgpu.attention_backward(q, k, v, o, lse, do, causal=causal, kernel=kernel, bf16=bf16, out=out,
                                           workspace=workspace)

        def result():
            grads = fgpu.attention_backward(q, k, v, o, lse, do, causal=causal, kernel=kernel, bf16=bf16)
            return tuple(fgpu.from_bf16(g) for g in grads) if bf16 else grads

        return "cupy", fn, result
    if name == "cupy_naive":
        if bf16:
            raise ValueError("cupy_naive takes float16 or float32 (CuPy has no bfloat16 matrix product)")

        def fn():
            return backward.naive_attention_backward(q, k, v, do, causal=causal)

        return "cupy", fn, fn
    if name in ("sdpa_flash", "sdpa_cudnn"):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        def tensor(x):
            t = torch.from_dlpack(x)
            return t.view(torch.bfloat16) if bf16 else t

        tq, tk, tv = (tensor(x).detach().requires_grad_(True) for x in (q, k, v))
        tdo = tensor(do)
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                                   enable_gqa=tq.shape[1] != tk.shape[1])

        def fn():
            return torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)

        def result():
            grads = fn()
            torch.cuda.synchronize()
            return tuple(cp.from_dlpack(g.float().contiguous()) for g in grads)

        return "torch", fn, result
    raise ValueError(f"unknown backward implementation {name!r}")


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """Time every implementation of ``args.impls`` at each (d, n, causal) under each protocol; append one row
    each."""
    run_grid(args, rows, pass_name="bwd", inputs=4, impl=_bwd_impl, flop=bwd_flop)


def format_rows(rows: list[dict]) -> str:
    """Plain text, one line per row: protocol, time, TFLOP/s and the speed as a multiple of sdpa_flash's and
    sdpa_cudnn's at the same (dtype, d, n, causal) under the same protocol."""

    def key(r: dict) -> tuple:
        return (r.get("dtype", "float16"), r["d"], r["n"], r["causal"])

    times = median_times(rows, key=key)
    width = max((len(r["impl"]) for r in rows), default=12)
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(error_line(r))
            continue
        flash, cudnn = ratio_cells(r, times, key=key)
        lines.append(f"{r['impl']:<{width}} {key(r)[0]:<8} d={r['d']:<4} n={r['n']:<6} causal={r['causal']!s:<5} "
                     f"{records.protocol_of(r):<10} {r['median_ms']:9.3f} ms {r['tflops']:8.2f} TFLOP/s "
                     f"x{flash:>5} sdpa_flash x{cudnn:>5} sdpa_cudnn")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("backward", __doc__.splitlines()[0], name="bwd", out=OUT_DIR)
    p.add_argument("--impls", nargs="+", default=list(IMPLS),
                   help=f"{', '.join(IMPLS)} (differences against the first)")
    p.add_argument("--d", nargs="+", type=int, default=[128], help="head dimensions")
    p.add_argument("--n", nargs="+", type=int, default=[4096, 16384], help="sequence lengths")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    p.add_argument("--tokens", type=int, default=16384, help="batch x n (batch = tokens // n)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=None, help="fixed batch size (overrides --tokens)")
    add_dtypes(p)
    add_protocols(p)
    add_rounds(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print it; write data/ch8/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)

    def prepare(args: argparse.Namespace) -> None:
        args.impls = without_torch(args.impls, quiet=True)

    return gpu_main("backward", argv, parser(), run, format_rows, prepare=prepare,
                    extra_provenance=training_kernel_hashes)
