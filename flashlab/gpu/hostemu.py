"""Run the course's CUDA kernels on a CPU: a host emulation for checking kernels where no GPU is at hand.

``python -m flashlab.gpu.hostemu [--real-forward] [pytest arguments]`` runs the GPU-marked tests (default: the
backward and decoding tests) with the kernels compiled by the host C++ compiler instead of NVRTC, behind a NumPy
stand-in for CuPy. ``--selfcheck [--quick]`` runs ``bench8 selfcheck`` the same way; ``--forward-check`` runs
the forward ladder's rung 9 (proven on an H200) against float64, which checks the emulation itself.

How: each ``.cu`` is compiled with g++ (C++20) after a header maps CUDA to the host. A thread block runs as one OS
thread per CUDA thread, blocks one after another; ``__syncthreads`` is a block-wide ``std::barrier``; warp-level
operations (``__shfl_xor_sync``, ``__any_sync``, ``ldmatrix`` x4 and x4.trans, ``mma.sync`` m16n8k16 with fp16 or
bf16 inputs and fp32 accumulators) exchange values through per-warp buffers between two warp barriers;
``cp.async`` copies at once; ``atomicAdd`` takes a lock; ``__shared__`` arrays are function statics and dynamic
shared memory one arena. Device helpers written in inline PTX (conversions, ``ex2``, ldmatrix, cp.async, mma) are
replaced by host versions of the same name; other inline PTX is refused with an error. Threads really run
concurrently and lanes are not in lock step, so a missing barrier tends to show as a wrong result, but this is no
race detector (use compute-sanitizer on a GPU) and says nothing about speed. By default the forward that the
backward tests need is the float64 reference (fast); ``--real-forward`` emulates the forward kernel too.
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
// --- warp-level PTX of the tensor-core kernels: ldmatrix, mma.sync m16n8k16, cp.async, vote
alignas(16) inline unsigned char g_arena[232448];  // dynamic shared memory ("extern __shared__")
inline unsigned g_xa[32][32][4], g_xb[32][32][2];
inline void warp_sync() { g_warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
inline bool __any_sync(unsigned, bool p) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xa[w][l][0] = p;
    warp_sync();
    bool any = false;
    for (int i = 0; i < 32; ++i) any |= g_xa[w][i][0] != 0;
    warp_sync();
    return any;
}
inline float __log2f(float x) { return std::log2(x); }
inline float ex2(float x) { return std::exp2(x); }
inline unsigned smem_addr(const void* p) { return (unsigned)((const unsigned char*)p - g_arena); }
// lanes 8j..8j+7 give the row addresses of 8x8 block j; lane l gets row l/4, columns 2(l%4), +1 of each block
inline void ldsm_x4(unsigned* r, unsigned addr) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xa[w][l][0] = addr;
    warp_sync();
    for (int j = 0; j < 4; ++j) std::memcpy(&r[j], g_arena + g_xa[w][8 * j + l / 4][0] + 4 * (l % 4), 4);
    warp_sync();
}
// transposed: lane l gets rows 2(l%4), +1 at column l/4
inline void ldsm_x4_t(unsigned* r, unsigned addr) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xa[w][l][0] = addr;
    warp_sync();
    for (int j = 0; j < 4; ++j) {
        std::uint16_t lo, hi;
        std::memcpy(&lo, g_arena + g_xa[w][8 * j + 2 * (l % 4)][0] + 2 * (l / 4), 2);
        std::memcpy(&hi, g_arena + g_xa[w][8 * j + 2 * (l % 4) + 1][0] + 2 * (l / 4), 2);
        r[j] = lo | ((unsigned)hi << 16);
    }
    warp_sync();
}
inline void cp_async16(unsigned dst, const void* src, bool valid) {  // synchronous here: a copy, or 16 zeros
    if (valid) std::memcpy(g_arena + dst, src, 16); else std::memset(g_arena + dst, 0, 16);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
// D = A B + C for one warp: A 16x16 (a0: row g, k 2t..2t+1; a1: row g+8; a2: k + 8; a3: both), B 16x8 (b0: k 2t..2t+1,
// column g; b1: k + 8), C/D 16x8 (c0, c1: row g, columns 2t, 2t+1; c2, c3: row g + 8), g = lane / 4, t = lane % 4.
template <float (*CV)(std::uint16_t)>
inline void mma_emul(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) g_xa[w][l][i] = a[i];
    g_xb[w][l][0] = b0;
    g_xb[w][l][1] = b1;
    warp_sync();
    auto half = [](unsigned x, int k) { return (std::uint16_t)(k % 2 ? x >> 16 : x & 0xffffu); };
    auto A = [&](int row, int k) {
        const unsigned x = g_xa[w][4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)];
        return CV(half(x, k));
    };
    auto B = [&](int k, int col) { return CV(half(g_xb[w][4 * col + (k % 8) / 2][k >= 8], k)); };
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
        float x = c[e];
        for (int k = 0; k < 16; ++k) x += A(row, k) * B(k, col);
        out[e] = x;
    }
    warp_sync();
    for (int e = 0; e < 4; ++e) c[e] = out[e];
}
inline float bf16_val(std::uint16_t x) { return __uint_as_float((unsigned)x << 16); }

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

HOST_TYPES = {
    "F16": """struct F16 {
    static inline float load(u16 x) { return f16_val(x); }
    static inline u16 store(float f) { return f16_bits(f); }
    static inline u32 pack(float lo, float hi) { return f16_bits(lo) | ((u32)f16_bits(hi) << 16); }
    static inline void mma(float* c, const u32* a, u32 b0, u32 b1) { mma_emul<f16_val>(c, a, b0, b1); }
};""",
    "BF16": """struct BF16 {
    static inline float load(u16 x) { return bf16_val(x); }
    static inline u16 store(float f) { return bf16_bits(f); }
    static inline u32 pack(float lo, float hi) { return bf16_bits(lo) | ((u32)bf16_bits(hi) << 16); }
    static inline void mma(float* c, const u32* a, u32 b0, u32 b1) { mma_emul<bf16_val>(c, a, b0, b1); }
};""",
}
# Device helpers whose bodies are inline PTX: removed, the header's host versions (same names) stand in.
PTX_HELPERS = ("ex2", "smem_addr", "ldsm_x4", "ldsm_x4_t", "cp_async16", "cp_async_commit", "cp_async_wait")
ASM_REWRITES = [
    (r'asm volatile\("mov\.u32 %0, %1;" : "=r"\((\w+)\) : "r"\((\w+)\)\);', r"\1 = \2;"),
    (r'asm volatile\("mov\.u32 %0, %%ctaid\.([xyz]);" : "=r"\((\w+)\)\);', r"\2 = blockIdx.\1;"),
    (r"extern __shared__ __align__\(16\) u16 smem\[\];", "u16* smem = (u16*)g_arena;"),
]


def _definition_span(src: str, start: int) -> tuple[int, int]:
    """[start, end) of the definition beginning at ``start``: through its matching closing brace (and a ';')."""
    i = src.index("{", start)
    depth = 0
    while True:
        if src[i] == "{":
            depth += 1
        elif src[i] == "}":
            depth -= 1
            if depth == 0:
                end = i + 1
                return start, end + 1 if src[end:end + 1] == ";" else end
        i += 1

def host_source(cu_text: str) -> str:
    """The .cu text made host C++: PTX conversion structs replaced, a launcher exported per ``extern "C"`` kernel."""
    src = cu_text
    for name, host in HOST_TYPES.items():
        a, b = _definition_span(src, src.index(f"struct {name} {{"))
        src = src[:a] + host + src[b:]
    for name in PTX_HELPERS:
        m = re.search(rf"__device__ __forceinline__ \w+ {name}\(", src)
        if m:
            a, b = _definition_span(src, m.start())
            if src[:a].rstrip().endswith("template <int N>"):  # keep no template shell around a removed body
                a = src[:a].rstrip().rindex("template <int N>")
            src = src[:a] + src[b:]
    for pattern, repl in ASM_REWRITES:
        src = re.sub(pattern, repl, src)
    if "asm" in re.sub(r"//.*", "", src):
        raise ValueError("inline PTX the host emulation does not know is left in this kernel file")
    names = _kernel_names(src)
    if not names:
        raise ValueError('no extern "C" __global__ kernel found in this kernel file')
    exports = "\n".join(f'extern "C" void launch_{n}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** a) '
                        f"{{ launch({n}, gx, gy, gz, bx, a); }}" for n in names)
    return HEADER + src + "\n" + exports + "\n"


def _kernel_names(src: str) -> list[str]:
    """Every ``extern "C" __global__`` kernel, read after the preprocessor has expanded the file's macros (the
    files define their kernels through macros, one per dtype, d or row count)."""
    cpp = shutil.which("g++")
    if cpp is None:
        raise RuntimeError("the host emulation needs g++ (C++20, with <barrier>)")
    res = subprocess.run([cpp, "-E", "-P", "-x", "c++", "-D__launch_bounds__(...)=", "-"], input=src,
                         capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"the preprocessor failed on a kernel file:\n{res.stderr[-4000:]}")
    return list(dict.fromkeys(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(', res.stdout)))


@functools.lru_cache(maxsize=None)
def library(code: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile one kernel file's text for the host (cached by hash in the temp directory) and load it."""
    gxx = shutil.which("g++")
    if gxx is None:
        raise RuntimeError("the host emulation needs g++ (C++20, with <barrier>)")
    src = host_source(code)
    tag = hashlib.sha256((src + repr(defines)).encode()).hexdigest()[:16]
    out = pathlib.Path(tempfile.gettempdir()) / f"flashlab_hostemu_{tag}.so"
    if not out.exists():
        cpp = out.with_suffix(".cpp")
        cpp.write_text(src)
        res = subprocess.run([gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", *defines, "-o", str(out),
                              str(cpp)], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"g++ failed:\n{res.stderr[-4000:]}")
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
    def __init__(self, lib: ctypes.CDLL, name: str):
        self.fn = getattr(lib, "launch_" + name)
        self.max_dynamic_shared_size_bytes = 0

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
    def __init__(self, code: str, options=()):
        self.lib = library(code, tuple(o for o in options if o.startswith("-D")))

    def get_function(self, name):
        return _Kernel(self.lib, name)


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


def install(real_forward: bool = False) -> None:
    """Make ``import cupy`` give the stand-in; unless ``real_forward``, the forward is the float64 reference."""
    import flashlab.gpu as fgpu
    from flashlab import reference

    cp = fake_cupy()
    sys.modules["cupy"] = cp
    if real_forward:
        return

    def attention(q, k, v, *, causal=False, scale=None, bf16=False, **_):
        f = fgpu.from_bf16 if bf16 else (lambda x: x.astype(np.float32))
        O, L = reference.attention(*(np.asarray(f(x), np.float64) for x in (q, k, v)), causal=causal, scale=scale)
        o = fgpu.to_bf16(cp.asarray(O.astype(np.float32))) if bf16 else cp.asarray(O.astype(q.dtype))
        return o, cp.asarray(L.astype(np.float32))

    fgpu.attention = attention


def forward_check() -> int:
    """Rung 9 of the forward ladder (tensor cores; correct on an H200) under the emulation, against float64."""
    import flashlab.gpu as fgpu
    from flashlab import reference

    cp = sys.modules["cupy"]
    rng = np.random.default_rng(0)
    bad = 0
    for dt in ("f16", "bf16"):
        for d in fgpu.HEAD_DIMS:
            n, m, causal = (131, 77, True) if d == 64 else (77, 131, False)
            x = [rng.standard_normal(s).astype(np.float32) for s in ((1, 2, n, d), (1, 1, m, d), (1, 1, m, d))]
            dev = [fgpu.to_bf16(cp.asarray(a)) if dt == "bf16" else cp.asarray(a.astype(np.float16)) for a in x]
            host = [(fgpu.from_bf16(a) if dt == "bf16" else a.astype(np.float32)).get().astype(np.float64)
                    for a in dev]
            o, lse = fgpu.attention(*dev, causal=causal, kernel="addressing", bf16=dt == "bf16")
            O, L = reference.attention(*host, causal=causal)
            err = float(np.abs((fgpu.from_bf16(o) if dt == "bf16" else o.astype(np.float32)).get() - O).max())
            fin = np.isfinite(L)
            lerr = float(np.abs(lse.get()[fin] - L[fin]).max())
            ok = err < (2e-2 if dt == "bf16" else 3e-3) and lerr < 1e-4 and (np.isneginf(lse.get()) == ~fin).all()
            bad += not ok
            print(f"addressing {dt:<4} d={d:<4} n={n} m={m} causal={causal!s:<5} max error o {err:.1e}, "
                  f"lse {lerr:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    print("forward check:", "all ok" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """Install the emulation, then run pytest -m gpu on the chapter-8 tests (or a check; see the docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    real = "--real-forward" in argv or "--forward-check" in argv
    argv = [a for a in argv if a != "--real-forward"]
    install(real_forward=real)
    if argv[:1] == ["--forward-check"]:
        return forward_check()
    if argv[:1] == ["--selfcheck"]:
        from . import bench8

        return 1 if bench8.selfcheck(quick="--quick" in argv) else 0
    import pytest

    root = pathlib.Path(__file__).resolve().parents[2]
    args = argv or [str(root / "tests" / "test_gpu_backward.py"), str(root / "tests" / "test_gpu_decode.py")]
    return int(pytest.main(["-q", "-m", "gpu", *args]))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
