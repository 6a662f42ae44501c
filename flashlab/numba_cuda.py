"""The tiled forward pass as a ``numba.cuda`` kernel, on a GPU or in the CUDA simulator.

:func:`cuda_forward` computes what :func:`flashlab.numba_cpu.tiled_forward` computes, with a kernel written the way
a CUDA C kernel is written: one thread block per block of ``block_q`` queries (grid axis y walks over
batch·heads), one thread per query row holding its online-softmax state (m, l, acc) in registers, K/V tiles
staged in ``cuda.shared.array`` by all threads together, and ``cuda.syncthreads()`` between loading a tile and
using it (and again before overwriting it).

The CUDA simulator
------------------
``numba.cuda`` can run kernels on the CPU, each thread of a block as a Python thread (slow: small sizes
only). The simulator is chosen when ``numba.cuda`` is *first imported*, from the environment variable
``NUMBA_ENABLE_CUDASIM=1``; it cannot be switched on or off later in the same process. So:

* in a notebook or script, call :func:`use_simulator` before anything imports ``numba.cuda`` (this module
  imports it only on first use), or export ``NUMBA_ENABLE_CUDASIM=1`` before starting Python;
* to use both (a real GPU and the simulator) from one program, run one of them in a subprocess:
  ``python -m flashlab.numba_cuda --simulator`` checks the kernel in the simulator,
  ``python -m flashlab.numba_cuda --gpu`` on the GPU (chapter 5 does this), and :func:`run_in_simulator` runs
  a snippet of Python in a fresh simulator process (the tests do this).

With numba 0.68 ``numba.cuda`` is still built into numba (the simulator needs nothing else). On a GPU, install
the NVIDIA-maintained ``numba-cuda`` package (requirements-gpu.txt): it takes over ``import numba.cuda``, and
the same code runs unchanged on both.

In the simulator, :mod:`flashlab.racetrace` watches a kernel's shared memory and reports data races.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np

from .numba_cpu import _prepare  # the same inputs as the CPU kernel: validated, one dtype, one batch axis

cuda = None  # the numba.cuda module, imported on first use; the simulator swaps this global inside kernels


def use_simulator() -> None:
    """Make ``numba.cuda`` run kernels in the CUDA simulator. Call it before anything imports ``numba.cuda``.

    Raises RuntimeError if ``numba.cuda`` was already imported for a real GPU in this process (the choice is
    made once per process: restart the kernel, or run the simulator in a subprocess).
    """
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if "numba.cuda" in sys.modules:
        if not simulator_active():
            raise RuntimeError(
                "numba.cuda was already imported for a real GPU in this process; the simulator can only be "
                "chosen before that import (restart the kernel and call use_simulator() first)"
            )
        settle_failed_blocks()
        return
    from numba.core import config

    config.ENABLE_CUDASIM = 1  # numba read its environment when it was imported; numba.cuda reads this flag
    settle_failed_blocks()


def settle_failed_blocks() -> None:
    """Make a simulated block that raises wait for its other threads before the launch returns. Idempotent.

    When one thread of a simulated block raises, numba's simulator flags the others to stop at their next
    barrier and raises at once, without waiting for them. Those threads keep running after the launch has
    returned; a thread of the next launch of the same kernel then finds them in the middle of its shared
    tiles (the simulator keys a shared array by its source line), so one kernel's IndexError could change the
    result or the traced tile shapes of the next, depending on how the threads happened to be scheduled.
    """
    if not simulator_active():
        return
    import threading

    from numba.cuda.simulator import kernel as sim

    if getattr(sim.BlockManager.run, "_flashlab_settles", False):
        return
    original = sim.BlockManager.run

    @functools.wraps(original)
    def run(self, grid_point, *args):
        before = set(threading.enumerate())
        try:
            return original(self, grid_point, *args)
        except BaseException:
            # Flagged to abort, each stops at its next barrier or at its end; a thread in an endless loop is
            # left behind after a while rather than hanging its caller.
            deadline = time.monotonic() + SETTLE_SECONDS
            for t in threading.enumerate():
                if t not in before and isinstance(t, sim.BlockThread):
                    t.join(max(0.0, deadline - time.monotonic()))
            raise

    run._flashlab_settles = True
    sim.BlockManager.run = run


SETTLE_SECONDS = 30.0


def simulator_active() -> bool:
    """True when ``numba.cuda`` is (or, once imported, will be) the CUDA simulator."""
    if "numba.cuda" in sys.modules:
        return sys.modules["numba.cuda"].jit.__module__.startswith("numba.cuda.simulator")
    from numba.core import config

    return bool(config.ENABLE_CUDASIM)


def _cuda_module():
    global cuda
    if cuda is None:
        from numba import cuda as numba_cuda

        cuda = numba_cuda
    return cuda


def cuda_ready() -> bool:
    """True when :func:`cuda_forward` can run here: the simulator is on, or a CUDA GPU is visible."""
    return simulator_active() or _cuda_module().is_available()


def gpu_available() -> bool:
    """Whether this machine has a CUDA GPU numba can use, asked in a subprocess (so the answer does not
    depend on, or change, the simulator choice of this process)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    code = "from numba import cuda; print(int(cuda.is_available()))"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip().endswith("1")


@functools.lru_cache(maxsize=None)
def make_cuda_kernel(block_q: int, block_k: int, d: int, dv: int, dtype: str = "float32"):
    """Build the ``numba.cuda`` forward kernel for one tile shape, head size and dtype.

    Like template parameters in CUDA C, ``block_q``, ``block_k``, ``d``, ``dv`` and the dtype are compile-time
    constants here: shared and local arrays need sizes known when the kernel is compiled.

    The kernel's arguments are ``(Q, K, V, O, L, n, m, scale, causal)`` with Q (B, n, d), K (B, m, d),
    V (B, m, dv), O (B, n, dv), L (B, n); launch it as ``kernel[(ceil(n / block_q), B), block_q](...)`` (see
    :func:`launch`). Thread ``t`` of block ``(x, b)`` owns query row ``x * block_q + t`` of batch entry ``b``.
    """
    _cuda_module()
    from numba import from_dtype

    BLOCK_Q, BLOCK_K, D, DV = block_q, block_k, d, dv
    T = from_dtype(np.dtype(dtype))

    @cuda.jit
    def flash_forward_kernel(Q, K, V, O, L, n, m, scale, causal):  # pragma: no cover - runs on the device
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y
        q0 = cuda.blockIdx.x * BLOCK_Q
        row = q0 + t
        offset = m - n
        # Every thread of the block loads tiles, so all of them run the tile loop (the barriers inside it
        # must be reached by the whole block); only threads that own a real row compute.
        active = row < n
        k_tile = cuda.shared.array((BLOCK_K, D), T)
        v_tile = cuda.shared.array((BLOCK_K, DV), T)
        q = cuda.local.array(D, T)
        acc = cuda.local.array(DV, T)
        for c in range(D):
            q[c] = Q[b, row, c] * scale if active else T(0)
        for c in range(DV):
            acc[c] = 0
        m_i = T(-math.inf)  # typed like the data, so that the arithmetic stays in T (expf for float32)
        l_i = T(0)
        # The same bound for every thread of the block: the last key any of its queries can see.
        k_end = min(m, min(q0 + BLOCK_Q, n) + offset) if causal else m
        for k0 in range(0, k_end, BLOCK_K):
            # 1. Stage the K and V tiles in shared memory: thread t copies elements t, t + BLOCK_Q, ...
            for e in range(t, BLOCK_K * D, BLOCK_Q):
                j = e // D
                c = e % D
                k_tile[j, c] = K[b, k0 + j, c] if k0 + j < m else T(0)
            for e in range(t, BLOCK_K * DV, BLOCK_Q):
                j = e // DV
                c = e % DV
                v_tile[j, c] = V[b, k0 + j, c] if k0 + j < m else T(0)
            cuda.syncthreads()  # the tile is complete before anyone reads it
            # 2. Fold the tile into this row's state (m_i, l_i, acc), one key at a time.
            if active:
                cols = min(BLOCK_K, m - k0)
                if causal:
                    cols = min(cols, max(0, row + offset - k0 + 1))
                for j in range(cols):
                    s = T(0)
                    for c in range(D):
                        s += q[c] * k_tile[j, c]
                    m_new = max(m_i, s)
                    alpha = math.exp(m_i - m_new)
                    p = math.exp(s - m_new)
                    l_i = l_i * alpha + p
                    for c in range(DV):
                        acc[c] = acc[c] * alpha + p * v_tile[j, c]
                    m_i = m_new
            cuda.syncthreads()  # everyone is done with the tile before it is overwritten
        if active:
            if l_i > 0:
                for c in range(DV):
                    O[b, row, c] = acc[c] / l_i
                L[b, row] = m_i + math.log(l_i)
            else:
                for c in range(DV):
                    O[b, row, c] = 0
                L[b, row] = -math.inf

    return flash_forward_kernel


def launch(kernel, Q, K, V, *, block_q: int, causal: bool = False, scale: float | None = None):
    """Run a forward kernel built like :func:`make_cuda_kernel`'s on NumPy inputs; return ``(O, L)`` as NumPy.

    The outputs are filled with NaN before the launch, so a row the kernel never writes cannot pass a check.
    """
    Q3, K3, V3, lead, dtype, block_q, _, scale = _prepare(Q, K, V, block_q, 1, scale)
    batch, n, _ = Q3.shape
    m = K3.shape[1]
    O = np.full((batch, n, V3.shape[2]), np.nan, dtype=dtype)
    L = np.full((batch, n), np.nan, dtype=dtype)
    grid = ((n + block_q - 1) // block_q, batch)
    if simulator_active():
        settle_failed_blocks()  # the simulator may have been chosen through the environment alone
        kernel[grid, block_q](Q3, K3, V3, O, L, np.int64(n), np.int64(m), scale, bool(causal))
    else:
        args = [cuda.to_device(x) for x in (Q3, K3, V3, O, L)]
        kernel[grid, block_q](*args, np.int64(n), np.int64(m), scale, bool(causal))
        cuda.synchronize()
        O, L = args[3].copy_to_host(), args[4].copy_to_host()
    return O.reshape(lead + O.shape[1:]), L.reshape(lead + L.shape[1:])


def cuda_forward(
    Q, K, V, *, block_q: int = 32, block_k: int = 32, causal: bool = False, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Tiled exact attention as a ``numba.cuda`` kernel, on a GPU or in the CUDA simulator.

    Same arguments and results as :func:`flashlab.numba_cpu.tiled_forward`. In the simulator every thread is a
    Python thread: keep n, m and d small (tens). See the module docstring for choosing the simulator.
    """
    Q3, K3, V3, _, dtype, block_q, block_k, _ = _prepare(Q, K, V, block_q, block_k, scale)
    if block_q > 1024:
        raise ValueError(f"block_q is the number of threads of a block, at most 1024 on NVIDIA GPUs; got {block_q}")
    tile_bytes = block_k * (Q3.shape[2] + V3.shape[2]) * dtype.itemsize
    if tile_bytes > 48 * 1024:
        most = 48 * 1024 // (tile_bytes // block_k)
        raise ValueError(f"the K and V tiles need {tile_bytes} bytes of shared memory, more than the 48 KB a kernel "
                         f"gets without opting in; use a smaller block_k (here at most {most})")
    _cuda_module()
    if not cuda_ready():
        raise RuntimeError(
            "no CUDA GPU is visible to numba; to run the kernel in the CUDA simulator call "
            "flashlab.numba_cuda.use_simulator() before numba.cuda is imported (or set NUMBA_ENABLE_CUDASIM=1)"
        )
    kernel = make_cuda_kernel(block_q, block_k, Q3.shape[2], V3.shape[2], dtype.name)
    return launch(kernel, Q, K, V, block_q=block_q, causal=causal, scale=scale)


def run_in_simulator(code: str, *, timeout: float = 300, cwd: str | os.PathLike | None = None) -> Any:
    """Run Python ``code`` in a fresh process whose ``numba.cuda`` is the simulator; return the JSON value that
    ``code`` prints on its last line.

    The way to use the simulator from a process that may already use a real GPU (or may later): the choice is
    made once per process. ``code`` is dedented and runs after :func:`use_simulator`; it imports what it needs.
    Raises RuntimeError with the end of the child's stderr if it fails.
    """
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    script = "from flashlab.numba_cuda import use_simulator\nuse_simulator()\n" + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"the simulated run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------
# Command line: check the kernel in the simulator or on the GPU (a fresh process chooses either)
# ----------------------------------------------------------------------------------------------------------


def _relative_error(x, ref) -> float:
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(x), finite):
        return float("inf")
    scale = np.linalg.norm(ref[finite]) or 1.0
    return float(np.linalg.norm(x[finite] - ref[finite]) / scale)


def check_cuda_forward(n: int, m: int, d: int, *, batch: int = 1, block_q: int = 32, block_k: int = 32,
                       causal: bool = False, dtype: str = "float32", seed: int = 0) -> dict:
    """Run :func:`cuda_forward` once on random inputs; return its errors against the float64 reference and
    the wall time (the first call of a shape includes compilation on a GPU)."""
    from . import reference

    rng = np.random.default_rng(seed)
    Q, K, V = (rng.standard_normal((batch, r, d)).astype(dtype) for r in (n, m, m))
    t0 = time.perf_counter()
    O, L = cuda_forward(Q, K, V, block_q=block_q, block_k=block_k, causal=causal)
    seconds = time.perf_counter() - t0
    O_ref, L_ref = reference.attention(Q, K, V, causal=causal)
    return {"n": n, "m": m, "d": d, "batch": batch, "block_q": block_q, "block_k": block_k, "causal": causal,
            "dtype": dtype, "seconds": seconds, "simulator": simulator_active(),
            "o_rel_error": _relative_error(O, O_ref), "l_rel_error": _relative_error(L, L_ref)}


def main(argv=None) -> int:
    """``python -m flashlab.numba_cuda [--simulator | --gpu] [--n N] ...``: check cuda_forward, print JSON."""
    parser = argparse.ArgumentParser(prog="python -m flashlab.numba_cuda", description=main.__doc__)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--simulator", action="store_true", help="run in the CUDA simulator (the default)")
    where.add_argument("--gpu", action="store_true", help="run on a real GPU")
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--m", type=int, default=None, help="keys (default: n)")
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-q", type=int, default=32)
    parser.add_argument("--block-k", type=int, default=32)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.gpu:
        use_simulator()
    result = check_cuda_forward(args.n, args.m or args.n, args.d, batch=args.batch, block_q=args.block_q,
                                block_k=args.block_k, causal=args.causal, dtype=args.dtype, seed=args.seed)
    print(json.dumps(result))
    tol = 1e-5 if args.dtype == "float32" else 1e-12
    return 0 if max(result["o_rel_error"], result["l_rel_error"]) <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
