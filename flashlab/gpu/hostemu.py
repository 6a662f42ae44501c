"""Run chapter 8's CUDA kernels on a CPU: a host emulation for checking kernels where no GPU is at hand.

``python -m flashlab.gpu.hostemu [pytest arguments]`` runs the GPU-marked tests (default: the backward and
decoding tests) with the kernels compiled by the host C++ compiler instead of NVRTC, behind a NumPy stand-in for
CuPy. ``python -m flashlab.gpu.hostemu --selfcheck [--quick]`` runs ``bench8 selfcheck`` the same way.

How: each ``.cu`` is compiled with g++ (C++20) after a small header maps CUDA to the host. A thread block runs as
one OS thread per CUDA thread, blocks one after another; ``__syncthreads`` is a block-wide ``std::barrier``,
``__shfl_xor_sync`` goes through a per-warp buffer and barrier, ``atomicAdd`` takes a lock, ``__shared__`` arrays
are function statics (shared by the block's threads); the inline-PTX fp16/bf16 conversions are replaced by host
code (``_Float16``; bf16 round to nearest even). Threads really run concurrently and lanes are not in lock step,
so a missing barrier tends to show as a wrong result, but this is no race detector (use compute-sanitizer on a
GPU), says nothing about speed, and supports only what the chapter-8 kernels use (not mma/ldmatrix/cp.async: the
forward's tensor-core kernels cannot run here, so ``flashlab.gpu.attention`` is replaced by the float64
reference, rounded to the input type). It found no bug in the first versions of ``bwd_r1_smem.cu`` and
``decode_r1_split.cu`` but catches deliberate ones (a dropped ``- D`` term, unweighted merges).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

from . import KERNEL_DIR, backward, decoding

HEADER = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
using std::max;
using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx;
inline dim3 blockIdx, gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline std::barrier<>* g_block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> g_warp_bar;
inline float g_shfl[32][32];
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_shfl[w][l] = x;
    g_warp_bar[w]->arrive_and_wait();
    const float y = g_shfl[w][l ^ o];
    g_warp_bar[w]->arrive_and_wait();
    return y;
}
inline std::mutex g_atomic;
inline float atomicAdd(float* p, float v) {
    std::lock_guard<std::mutex> g(g_atomic);
    float o = *p;
    *p = o + v;
    return o;
}
inline std::uint16_t f16_bits(float f) { _Float16 h = (_Float16)f; std::uint16_t x; std::memcpy(&x, &h, 2); return x; }
inline float f16_val(std::uint16_t x) { _Float16 h; std::memcpy(&h, &x, 2); return (float)h; }
inline std::uint16_t bf16_bits(float f) {
    unsigned u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (std::uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <class... A, std::size_t... I>
void call_unpacked(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*(std::remove_cv_t<std::remove_reference_t<A>>*)args[I]...);
}
template <class... A>
void launch(void (*k)(A...), unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** args) {
    gridDim = dim3{gx, gy, gz};
    blockDim = dim3{bx, 1, 1};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = dim3{x, y, z};
                std::barrier<> bar(bx);
                g_block_bar = &bar;
                g_warp_bar.clear();
                for (unsigned w = 0; w < (bx + 31) / 32; ++w) g_warp_bar.emplace_back(new std::barrier<>(32));
                std::vector<std::thread> ts;
                for (unsigned t = 0; t < bx; ++t)
                    ts.emplace_back([=] {
                        threadIdx = dim3{t, 0, 0};
                        call_unpacked(k, args, std::index_sequence_for<A...>{});
                    });
                for (auto& th : ts) th.join();
            }
}
"""

HOST_TYPES = """struct F16 {
    static inline float load(u16 x) { return f16_val(x); }
    static inline u16 store(float f) { return f16_bits(f); }
};
struct BF16 {
    static inline float load(u16 x) { return __uint_as_float((u32)x << 16); }
    static inline u16 store(float f) { return bf16_bits(f); }
};
"""

FILES = backward.KERNEL_FILES + decoding.KERNEL_FILES


def host_source(cu_text: str) -> str:
    """The .cu text made host C++: PTX conversion structs replaced, a launcher exported per ``extern "C"`` kernel."""
    a = cu_text.index("struct F16 {")
    b = cu_text.index("__device__ __forceinline__ float warp_")
    src = cu_text[:a] + HOST_TYPES + cu_text[b:]
    names = []
    for macro in re.finditer(r"DEFINE_KERNELS\((\w+), \w+, (\d+)\)", src):
        dt, d = macro.groups()
        body = src[src.index("#define DEFINE_KERNELS"):src.index("\nDEFINE_KERNELS(")]
        names += [f"{stem}_{dt}_d{d}" for stem in re.findall(r"(\w+)_##DT##_d##D\(", body)]
    names += re.findall(r'extern "C" __global__ void __launch_bounds__\(\w+\) (\w+)\(', src)
    exports = "\n".join(f'extern "C" void launch_{n}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** a) '
                        f"{{ launch({n}, gx, gy, gz, bx, a); }}" for n in names)
    return HEADER + src + "\n" + exports + "\n"


@functools.lru_cache(maxsize=None)
def library(file: str) -> ctypes.CDLL:
    """Compile one kernel file for the host (cached by source hash in the temp directory) and load it."""
    gxx = shutil.which("g++")
    if gxx is None:
        raise RuntimeError("the host emulation needs g++ (C++20, with <barrier>)")
    src = host_source((KERNEL_DIR / file).read_text())
    tag = hashlib.sha256(src.encode()).hexdigest()[:16]
    out = pathlib.Path(tempfile.gettempdir()) / f"flashlab_hostemu_{pathlib.Path(file).stem}_{tag}.so"
    if not out.exists():
        cpp = out.with_suffix(".cpp")
        cpp.write_text(src)
        res = subprocess.run([gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(out), str(cpp)],
                             capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"g++ failed on {file}:\n{res.stderr[-4000:]}")
    return ctypes.CDLL(str(out))


# ------------------------------------------------------------------------------------- a NumPy stand-in for CuPy
class ndarray(np.ndarray):  # noqa: N801 - CuPy's name
    """A NumPy array with the two CuPy attributes the launchers and tests use: ``.data.ptr`` and ``.get()``."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        return np.asarray(self).copy()


def _wrap(x):
    return x.view(ndarray) if isinstance(x, np.ndarray) and not isinstance(x, ndarray) else x


class _Kernel:
    def __init__(self, name: str):
        for file in FILES:
            try:
                self.fn = getattr(library(file), "launch_" + name)
                return
            except AttributeError:
                continue
        raise AttributeError(f"no kernel {name!r} in {FILES}")

    def __call__(self, grid, block, args, shared_mem=0):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        values = []
        for a in args:
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError("kernel arguments must be C-contiguous")
                values.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int32):
                values.append(ctypes.c_int(int(a)))
            elif isinstance(a, np.float32):
                values.append(ctypes.c_float(float(a)))
            elif isinstance(a, np.int64):
                values.append(ctypes.c_longlong(int(a)))
            else:
                raise TypeError(f"unsupported kernel argument {type(a).__name__}")
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        self.fn(*(ctypes.c_uint(int(g)) for g in grid), ctypes.c_uint(int(block[0])), ptrs)


class _RawModule:
    def __init__(self, code=None, options=()):
        pass

    def get_function(self, name):
        return _Kernel(name)


class _Event:
    def record(self):
        self.t = time.perf_counter()


class _Pool:
    def free_all_blocks(self):
        pass

    def total_bytes(self):
        return 0

    def used_bytes(self):
        return 0


class _Rng:
    def __init__(self, seed=None):
        self.g = np.random.default_rng(seed)

    def standard_normal(self, shape, dtype=np.float64):
        return _wrap(self.g.standard_normal(shape).astype(dtype))


class _Device:
    compute_capability = "90"
    attributes = {"MultiProcessorCount": 132}

    def synchronize(self):
        pass


def fake_cupy() -> types.ModuleType:
    """A module named ``cupy`` backed by NumPy, launching kernels through the host emulation."""
    mod = types.ModuleType("cupy")
    mod.__version__ = "hostemu"
    mod.ndarray = ndarray
    for name in ("float16", "float32", "float64", "uint16", "uint32", "int32", "int64", "bool_", "inf", "nan"):
        setattr(mod, name, getattr(np, name))
    mod.asarray = lambda x, dtype=None: np.array(x, dtype=dtype, copy=True).view(ndarray)
    mod.ascontiguousarray = lambda x, dtype=None: _wrap(np.ascontiguousarray(x, dtype=dtype))
    mod.copyto = np.copyto
    mod.RawModule = _RawModule
    mod.random = types.SimpleNamespace(default_rng=_Rng)
    mod.get_default_memory_pool = _Pool
    mod.cuda = types.SimpleNamespace(
        Device=_Device, Event=_Event, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, runtimeGetVersion=lambda: 0,
                                      driverGetVersion=lambda: 0,
                                      getDeviceProperties=lambda i: {"name": b"host emulation (no GPU)"}))

    def fallback(name):
        f = getattr(np, name)
        if not callable(f):
            return f

        def wrapped(*a, **k):
            r = f(*a, **k)
            return tuple(_wrap(x) for x in r) if isinstance(r, tuple) else _wrap(r)

        return wrapped

    mod.__getattr__ = fallback
    return mod


def install() -> None:
    """Make ``import cupy`` give the stand-in, and the forward the float64 reference (its kernels need PTX)."""
    import flashlab.gpu as fgpu
    from flashlab import reference

    cp = fake_cupy()
    sys.modules["cupy"] = cp

    def attention(q, k, v, *, causal=False, scale=None, bf16=False, **_):
        f = fgpu.from_bf16 if bf16 else (lambda x: x.astype(np.float32))
        O, L = reference.attention(*(np.asarray(f(x), np.float64) for x in (q, k, v)), causal=causal, scale=scale)
        o = fgpu.to_bf16(cp.asarray(O.astype(np.float32))) if bf16 else cp.asarray(O.astype(q.dtype))
        return o, cp.asarray(L.astype(np.float32))

    fgpu.attention = attention


def main(argv: list[str] | None = None) -> int:
    """Install the emulation, then run pytest -m gpu on the chapter-8 tests (or ``--selfcheck``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    install()
    if argv[:1] == ["--selfcheck"]:
        from . import bench8

        return 1 if bench8.selfcheck(quick="--quick" in argv) else 0
    import pytest

    root = pathlib.Path(__file__).resolve().parents[2]
    args = argv or [str(root / "tests" / "test_gpu_backward.py"), str(root / "tests" / "test_gpu_decode.py")]
    return int(pytest.main(["-q", "-m", "gpu", *args]))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
