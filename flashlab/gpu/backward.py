"""FlashAttention backward on the GPU: gradients from Q, K, V, O, dO and the saved logsumexp only.

The forward (``flashlab.gpu.attention``) keeps one float per query row, ``lse``; the backward rebuilds every
probability tile from it, ``P = exp(scale * Q K^T - lse)``, so the n x m matrix P is never stored (chapter 4's
recomputation, here in CUDA). FlashAttention-2's order: a small kernel for ``D = rowsum(dO * O)``, then a main
kernel parallel over K/V blocks that keeps dK and dV of its keys in registers while the query tiles stream past,
and adds its share of dQ into an fp32 buffer with atomics; a last kernel scales and rounds dQ. See
``kernels/bwd_r1_smem.cu`` for the scheme and why dQ uses atomics rather than a second pass.

Three main kernels, one step apart: ``"smem"`` (``bwd_r1_smem.cu``) uses scalar fp32 FMAs on shared-memory tiles
(correctness first); ``"mma"`` (``bwd_r2_mma.cu``) runs the five tile products on tensor cores; ``"pipe"``
(``bwd_r3_pipelined.cu``) gives a block twice the keys (half the query-tile loads and dQ atomics per key) and
copies the next query tile with cp.async while the current one is used. On sm_90 four more: ``"wgmma"``
(``hopper/bwd_h1_wgmma.cu``) runs the products on Hopper's warpgroup MMAs, two warpgroups of 64 keys with operands
read from shared memory, ``"wgmma_overlap"`` (``hopper/bwd_h2_overlap.cu``) computes P and dS while the
products before them run, ``"wgmma_bulk"`` (``hopper/bwd_h3_bulk_dq.cu``) hands dQ's additions to the copy
engine (a warpgroup stages its dQ tile in shared memory and one thread adds it into global memory with one
``cp.reduce.async.bulk``, instead of every thread issuing atomics), and ``"wgmma_balanced"``
(``hopper/bwd_h4_balanced.cu``) starts the longest causal blocks first (``block_order``). ``numpy_backward`` is the
schedule in NumPy, for tests and chapter 8.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import causal_offset, check_scale

# flashlab.gpu imports this module after defining these (at its end); bound once, not on every call
from . import (
    DeviceLimits,
    Plan,
    Workspace,
    _check_half_launch,
    _check_inputs,
    _check_out,
    _cupy,
    choose,
    device_limits,
    hopper_problem,
    kernel_function,
    launch_problem,
)
from .hopper import is_hopper

KERNEL_FILE = "bwd_r1_smem.cu"  # kernels 1 and 3, and the scalar main kernel
MMA_FILE = "bwd_r2_mma.cu"  # the main kernel on tensor cores
PIPE_FILE = "bwd_r3_pipelined.cu"  # tensor cores, 128 keys per block, cp.async double buffering
WGMMA_FILE = "hopper/bwd_h1_wgmma.cu"  # Hopper's warpgroup MMAs (sm_90a), two warpgroups of 64 keys
OVERLAP_FILE = "hopper/bwd_h2_overlap.cu"  # the same, the exponentials and dS under the running products
BULK_FILE = "hopper/bwd_h3_bulk_dq.cu"  # the same, dQ added into global memory by the copy engine
BALANCED_FILE = "hopper/bwd_h4_balanced.cu"  # the same, causal blocks started longest first
HOPPER_FILES = (WGMMA_FILE, OVERLAP_FILE, BULK_FILE, BALANCED_FILE)
KERNEL_FILES = (KERNEL_FILE, MMA_FILE, PIPE_FILE, *HOPPER_FILES)
BLOCK_KEYS = 32  # keys per thread block (BC in bwd_r1_smem.cu; the schedule numpy_backward follows)
BLOCK_ROWS = 32  # query rows per tile (BR in every file)
THREADS = 256  # threads of kernels 1 and 3


@dataclass(frozen=True)
class MainKernel:
    """A main kernel: its file, function stem, keys per block (BC), threads, and the Q/dO tile buffers it keeps in
    dynamic shared memory (0: static shared memory only). ``dq_tiles``: its fp32 dQ buffer holds each query tile
    in the order of the kernel's accumulators (``bwd_h3_bulk_dq.cu``), which its own ``bwd_dq_tiles`` kernel reads
    back, rather than row-major. ``grouped``: it takes one more argument, the heads of a group of its block order
    (``block_order``, ``bwd_h4_balanced.cu``)."""

    file: str
    stem: str
    block_keys: int
    threads: int
    stages: int = 0
    min_cc: int = 80  # mma.sync m16n8k16 and cp.async: sm_80 (the smem kernel's file builds for sm_75 too)
    block_rows: int = BLOCK_ROWS  # query rows per tile
    dq_tiles: bool = False
    grouped: bool = False

    @property
    def hopper(self) -> bool:
        """Built for sm_90a alone (wgmma), like the forward's kernels/hopper/ rungs."""
        return is_hopper(self.file)

    def shared_bytes(self, d: int) -> int:
        """Dynamic shared memory: K, V and `stages` Q and dO tiles, dS^T, and `stages` L and D vectors (and, with
        ``dq_tiles``, an fp32 staging tile of dQ). The mma.sync kernels pad every row by 8 halves (no bank
        conflicts for ldmatrix); the Hopper ones keep wgmma's swizzled layout unpadded and ask for 1024 B more to
        align it."""
        if not self.stages:
            return 0
        pad, align = (0, 1024) if self.hopper else (8, 0)
        keys, rows = self.block_keys, self.block_rows
        tiles = (2 * keys + 2 * self.stages * rows) * (d + pad) * 2
        staging = rows * d * 4 if self.dq_tiles else 0
        return tiles + keys * (rows + pad) * 2 + 2 * self.stages * rows * 4 + staging + align

    def dq_buffer_shape(self, B: int, H: int, n: int, d: int) -> tuple[int, ...]:
        """The fp32 dQ accumulator: (B, H, n, d), or whole tiles of ``block_rows`` rows for ``dq_tiles``."""
        if self.dq_tiles:
            return (B * H * math.ceil(n / self.block_rows) * self.block_rows * d,)
        return (B, H, n, d)


MAIN_KERNELS = {
    "smem": MainKernel(KERNEL_FILE, "bwd_main", BLOCK_KEYS, THREADS, min_cc=75),
    "mma": MainKernel(MMA_FILE, "bwd_mma", 64, 128, stages=1),
    "pipe": MainKernel(PIPE_FILE, "bwd_pipe", 128, 256, stages=2),
    "wgmma": MainKernel(WGMMA_FILE, "bwd_wgmma", 128, 256, stages=2, min_cc=90, block_rows=64),
    "wgmma_overlap": MainKernel(OVERLAP_FILE, "bwd_wgmma_overlap", 128, 256, stages=2, min_cc=90, block_rows=64),
    "wgmma_bulk": MainKernel(BULK_FILE, "bwd_wgmma_bulk", 128, 256, stages=2, min_cc=90, block_rows=64,
                             dq_tiles=True),
    "wgmma_balanced": MainKernel(BALANCED_FILE, "bwd_wgmma_balanced", 128, 256, stages=2, min_cc=90,
                                 block_rows=64, dq_tiles=True, grouped=True),
}
KERNELS = tuple(MAIN_KERNELS)
# The fastest kernel before Hopper, which "best" runs on sm_80 (data/ch8/bwd.json, A100 and H200: 0.57x
# sdpa_flash; "mma" 0.42x).
DEFAULT_KERNEL = "pipe"
# The fastest Hopper kernel at both head sizes: what ``bench.forward.fastest_rung`` picks among the four from the
# H200 run that timed them side by side (data/ch8/bwd_hopper.json; "wgmma_balanced" is within 1 % of it).
HOPPER_BEST = "wgmma_bulk"
FASTEST_FIRST = (HOPPER_BEST, "pipe", "mma", "smem")  # what kernel="best" tries, in this order


@functools.lru_cache(maxsize=64)
def _backward_plan(d: int, kernel: str, lim: DeviceLimits) -> Plan:
    if kernel != "best" and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or 'best'; got {kernel!r}")
    candidates = {name: MAIN_KERNELS[name] for name in (*FASTEST_FIRST, *KERNELS)}

    def problem(_, mk: MainKernel, best: bool) -> str | None:
        if mk.hopper and (why := hopper_problem(lim)):
            return why
        return launch_problem(f" at d = {d}", min_cc=mk.min_cc, shared_bytes=mk.shared_bytes(d), threads=mk.threads,
                              lim=lim)

    name, mk, passed = choose("backward", candidates, problem, kernel, lim)
    return Plan("backward", name, mk.file, mk.shared_bytes(d), mk.threads, lim, passed, mk)


def plan_backward(q, k, v, *, kernel: str = "best", bf16: bool = False) -> Plan:
    """The main kernel ``attention_backward`` launches on this GPU for these inputs, and why (see
    ``flashlab.gpu.plan``): on sm_90 ``HOPPER_BEST``, else "pipe" where a block may hold its shared memory
    (115,200 B at d = 128: sm_80), else "mma" (57,600 B: the 99 KB of sm_86 and sm_89), else "smem" (sm_75: no
    tensor-core backward for Turing; the scalar kernel runs there). A kernel that cannot run raises ValueError
    naming the limit."""
    dt = _check_inputs(q, k, v, bf16)
    if dt == "f32":
        raise TypeError("attention_backward takes float16 or (with bf16=True) bfloat16 bits in uint16; got float32")
    return _backward_plan(q.shape[-1], kernel, device_limits())


def numpy_backward(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None):
    """The kernel's schedule in float64 NumPy: K/V blocks outer, query heads of the group and query tiles inner.

    4-D inputs (B, H, n, d) / (B, Hk, m, d). Returns (dq, dk, dv). Used to check the schedule (causal tile
    skipping, GQA summation, rows that see no key) on the CPU against ``flashlab.reference.attention_backward``.
    """
    q, k, v, o, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, o, do))
    lse = np.asarray(lse, dtype=np.float64)
    B, H, n, d = q.shape
    Hk, m = k.shape[1], k.shape[2]
    G = H // Hk
    sc = check_scale(scale, d)
    off = causal_offset(n, m)
    Dv = np.sum(do * o, axis=-1)
    L = np.where(np.isneginf(lse), np.inf, lse)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for k0 in range(0, m, BLOCK_KEYS):
        k1 = min(k0 + BLOCK_KEYS, m)
        qstart = (max(0, k0 - off) // BLOCK_ROWS) * BLOCK_ROWS if causal else 0
        for g in range(G):
            h = np.arange(Hk) * G + g  # query head g of every group
            for q0 in range(qstart, n, BLOCK_ROWS):
                q1 = min(q0 + BLOCK_ROWS, n)
                Qi, dOi = q[:, h, q0:q1], do[:, h, q0:q1]
                S = Qi @ np.swapaxes(k[:, :, k0:k1], -1, -2)
                if causal:
                    ok = np.arange(k0, k1)[None, :] <= np.arange(q0, q1)[:, None] + off
                    S = np.where(ok, S, -np.inf)
                P = np.exp(sc * S - L[:, h, q0:q1, None])
                dP = dOi @ np.swapaxes(v[:, :, k0:k1], -1, -2)
                dS = P * (dP - Dv[:, h, q0:q1, None])
                dv[:, :, k0:k1] += np.swapaxes(P, -1, -2) @ dOi
                dk[:, :, k0:k1] += sc * (np.swapaxes(dS, -1, -2) @ Qi)
                dq[:, h, q0:q1] += sc * (dS @ k[:, :, k0:k1])
    return dq, dk, dv


def block_order(key_blocks: int, heads: int, group: int) -> list[tuple[int, int]]:
    """(key block, head) of each block of ``bwd_h4_balanced.cu`` in the order the GPU starts them (their linear
    index): groups of ``group`` heads, and within a group every head's key block 0, then every head's key block 1,
    and so on. ``group`` = 1 is the order of the other kernels (a head's key blocks, then the next head's). "head"
    counts (batch entry, K/V head) pairs: hk + Hk b."""
    if key_blocks < 1 or heads < 1 or group < 1:
        raise ValueError(f"key_blocks, heads and group must be at least 1; got {key_blocks}, {heads}, {group}")
    order = []
    for linear in range(key_blocks * heads):  # the kernel's arithmetic, line for line
        g0 = linear // (key_blocks * group) * group
        gs = min(group, heads - g0)
        within = linear - g0 * key_blocks
        order.append((within // gs, g0 + within % gs))
    return order


def balanced_group(key_blocks: int, heads: int, causal: bool) -> int:
    """The heads of a group in ``bwd_h4_balanced.cu``'s order: with the causal mask all of them, so that every
    head's first key block, the longest, starts first (by greedy list scheduling, ``makespan``, smaller groups of
    whole rounds do about as well at the course's shapes, within a fraction of a per cent; all heads is the
    simplest rule that does); without it 1, the other kernels' order (every block is as long as every other, and
    the blocks of a head that run together share its Q and dO tiles in L2)."""
    if key_blocks < 1 or heads < 1:
        raise ValueError(f"key_blocks and heads must be at least 1; got {key_blocks}, {heads}")
    return heads if causal else 1


def makespan(durations, sm_count: int) -> float:
    """When the last block ends if each SM takes the next block in the list as soon as it is free (greedy list
    scheduling, one block per SM at a time: the Hopper backward kernels' occupancy)."""
    import heapq

    free = [0.0] * sm_count
    for t in durations:
        heapq.heappush(free, heapq.heappop(free) + t)
    return max(free)


def _kernels(dt: str, d: int, kernel: str):
    mk = MAIN_KERNELS[kernel]
    dq = kernel_function(mk.file, f"bwd_dq_tiles_{dt}_d{d}") if mk.dq_tiles else kernel_function(KERNEL_FILE,
                                                                                                  f"bwd_dq_{dt}")
    return (kernel_function(KERNEL_FILE, f"bwd_dot_{dt}_d{d}"),
            kernel_function(mk.file, f"{mk.stem}_{dt}_d{d}", shared_bytes=mk.shared_bytes(d)), dq)


def attention_backward(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None,
                       bf16: bool = False, kernel: str = "best", out: tuple[Any, Any, Any] | None = None,
                       workspace: Workspace | None = None):
    """Gradients ``(dq, dk, dv)`` of attention on the GPU, recomputing P from the saved logsumexp.

    q, k, v as for ``flashlab.gpu.attention`` (float16, or bfloat16 bits in uint16 with ``bf16=True``; d 64 or
    128; (n, d) or (batch, heads, n, d) with heads_kv dividing heads); o and lse are what that forward returned
    (lse float32, -inf for a row that saw no key); do is the gradient of the loss with respect to o (o's shape and
    dtype). ``causal`` and ``scale`` must be the forward's. Returns arrays of q's, k's and v's shapes and dtype;
    with grouped-query attention dk and dv are summed over the query heads that share a K/V head.
    Accumulation is fp32; dq is summed with fp32 atomics (or bulk additions), so its last bits vary from run to
    run.
    ``kernel``: "smem" (scalar fp32 FMAs, the first version; P and dS stay fp32), "mma" (tensor cores; P and dS
    are rounded to 16 bits before their products, as in FlashAttention-2), "pipe" ("mma" with 128 keys per block
    and cp.async double buffering), "wgmma", "wgmma_overlap", "wgmma_bulk" and "wgmma_balanced" (Hopper's
    warpgroup MMAs; sm_90 only) or "best"
    (the default): the fastest this GPU runs, ``plan_backward``.
    ``out`` = (dq, dk, dv) writes into given arrays instead of allocating them; ``workspace`` (a
    ``flashlab.gpu.Workspace``) keeps the fp32 dq accumulator and the D vector from call to call. With both, a
    call allocates nothing.
    """
    cp = _cupy()
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    dt = _check_inputs(q, k, v, bf16)
    for name, x in (("o", o), ("do", do)):
        if not isinstance(x, cp.ndarray):
            raise TypeError(f"{name} must be a CuPy array on the GPU; got {type(x).__module__}.{type(x).__name__}")
        if x.shape != q.shape or x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's shape {q.shape} and dtype {q.dtype}; got {x.shape} {x.dtype}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (use cupy.ascontiguousarray)")
    if not (isinstance(lse, cp.ndarray) and lse.dtype == cp.float32 and lse.shape == q.shape[:-1]
            and lse.flags.c_contiguous):
        raise ValueError(f"lse must be the forward's C-contiguous float32 array of shape {q.shape[:-1]}")
    _check_half_launch("attention_backward", dt, {"q": q, "k": k, "v": v, "o": o, "do": do})
    d = q.shape[-1]
    scale = check_scale(scale, d)
    kernel = _backward_plan(d, kernel, device_limits()).kernel

    B, H, n = (1, 1, q.shape[0]) if q.ndim == 2 else q.shape[:3]
    Hk, m = (1, k.shape[0]) if k.ndim == 2 else k.shape[1:3]
    dot, main, dq_convert = _kernels(dt, d, kernel)
    mk = MAIN_KERNELS[kernel]
    acc_shape = mk.dq_buffer_shape(B, H, n, d)
    rows = B * H * n
    if out is None:
        dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
    else:
        dq, dk, dv = out
        for name, x, like in (("out[0]", dq, q), ("out[1]", dk, k), ("out[2]", dv, v)):
            _check_out(name, x, like.shape, like.dtype)
    if workspace is None:
        dvec = cp.empty(q.shape[:-1], dtype=cp.float32)
        dq_acc = cp.zeros(acc_shape, dtype=cp.float32)
    else:
        dvec = workspace.get("bwd_d", q.shape[:-1], cp.float32)
        dq_acc = workspace.get("bwd_dq_acc", acc_shape, cp.float32)
        dq_acc.fill(0)  # a memset on the stream, no kernel
    dot((math.ceil(rows / (THREADS // 32)),), (THREADS,), (o, do, dvec, np.int32(rows)))
    args = (q, k, v, do, lse, dvec, dq_acc, dk, dv, np.int32(n), np.int32(m), np.int32(H), np.int32(Hk),
            np.float32(scale), np.int32(bool(causal)))
    key_blocks = math.ceil(m / mk.block_keys)
    if mk.grouped:
        args = (*args, np.int32(balanced_group(key_blocks, B * Hk, bool(causal))))
    main((key_blocks, Hk, B), (mk.threads,), args, shared_mem=mk.shared_bytes(d))
    if mk.dq_tiles:  # one thread per 16 bytes of the tiled buffer
        blocks = dq_acc.size // 4
        dq_convert((math.ceil(blocks / THREADS),), (THREADS,), (dq_acc, dq, np.float32(scale), np.int32(n),
                                                               np.int64(blocks)))
    else:
        total = dq_acc.size
        dq_convert((math.ceil(total / THREADS),), (THREADS,), (dq_acc, dq, np.float32(scale), np.int64(total)))
    return dq, dk, dv


def naive_attention_backward(q, k, v, do, *, causal: bool = False, scale: float | None = None):
    """Standard attention's backward in CuPy, with P (and dS) materialised: the baseline of memory and speed.

    What an eager framework does: it kept P (n x m per head, in the inputs' precision) from the forward, and the
    backward builds dP and dS of the same size. float16/float32 CuPy arrays, (n, d) or (batch, heads, n, d),
    GQA by repeating K/V heads. Returns (dq, dk, dv) in q's dtype.
    """
    from . import _cupy

    cp = _cupy()
    d = q.shape[-1]
    scale = check_scale(scale, d)
    group = q.shape[-3] // k.shape[-3] if q.ndim == 4 else 1
    kk, vv = (cp.repeat(k, group, axis=1), cp.repeat(v, group, axis=1)) if group > 1 else (k, v)
    s = cp.matmul(q, kk.swapaxes(-1, -2)).astype(cp.float32) * np.float32(scale)
    n, m = q.shape[-2], k.shape[-2]
    if causal:
        s = cp.where(cp.arange(m)[None, :] <= cp.arange(n)[:, None] + (m - n), s, -cp.inf)
    mx = s.max(axis=-1, keepdims=True)
    p = cp.exp(s - cp.where(cp.isfinite(mx), mx, 0))
    total = p.sum(axis=-1, keepdims=True)
    p = p / cp.where(total > 0, total, 1)
    P = p.astype(q.dtype)
    o = cp.matmul(P, vv)
    dv = cp.matmul(P.swapaxes(-1, -2), do)
    dp = cp.matmul(do, vv.swapaxes(-1, -2)).astype(cp.float32)
    Dr = (do.astype(cp.float32) * o.astype(cp.float32)).sum(axis=-1, keepdims=True)
    ds = (p * (dp - Dr)).astype(q.dtype)
    dq = (cp.matmul(ds, kk).astype(cp.float32) * np.float32(scale)).astype(q.dtype)
    dk = (cp.matmul(ds.swapaxes(-1, -2), q).astype(cp.float32) * np.float32(scale)).astype(q.dtype)
    if group > 1:
        B, Hk = k.shape[:2]
        dk = dk.reshape(B, Hk, group, m, d).astype(cp.float32).sum(axis=2).astype(q.dtype)
        dv = dv.reshape(B, Hk, group, m, v.shape[-1]).astype(cp.float32).sum(axis=2).astype(q.dtype)
    return dq, dk, dv
