"""Run the course's CUDA kernels on a CPU: a host emulation for checking kernels where no GPU is at hand.

``python tools/hostemu/hostemu.py [--real-forward] [pytest arguments]`` runs the GPU-marked tests (default: the
backward and decoding tests) with the kernels compiled by the host C++ compiler instead of NVRTC, behind a NumPy
stand-in for CuPy. ``--selfcheck [--quick]`` runs ``python -m flashlab selfcheck backward-decode`` the same way;
``--forward-check`` runs the forward ladder's rung 9 (proven on an H200) against float64, which checks the emulation
itself; ``--sparse`` runs the block-sparse kernel's GPU tests (``tests/test_gpu_sparse.py``); ``--hopper`` the Hopper
kernels' (``tests/test_gpu_hopper.py``), whose wgmma the header emulates from the PTX ISA's layouts (accumulators,
A fragments, the descriptors' 128-byte swizzle): a check of the kernels' own logic, not of that reading of the ISA.

How: each ``.cu`` is compiled with g++ (C++20) by :mod:`flashlab.hostcuda`, whose ``cuda_host.h`` maps CUDA to the
host. The kernels (and that package) of this checkout are the ones run, whatever ``flashlab`` is installed. A thread
block runs as one OS thread per CUDA thread, blocks one after another; ``__syncthreads`` is a block-wide
``std::barrier``; warp-level operations (``__shfl_xor_sync``, ``__any_sync``, ``ldmatrix`` x4 and x4.trans,
``mma.sync`` m16n8k16 with fp16 or bf16 inputs and fp32 accumulators) exchange values through per-warp buffers
between two warp barriers; ``cp.async`` copies at once; ``atomicAdd`` takes a lock; ``__shared__`` arrays are
function statics and dynamic shared memory one arena. Device helpers written in inline PTX (conversions, ``ex2``,
ldmatrix, cp.async, mma) are replaced by host versions of the same name, and inline ``asm`` statements of ldmatrix,
mma.sync and mov by host calls (``flashlab.hostcuda.host_source``); other inline PTX is refused with an error.
Threads really run concurrently and lanes are not in lock step, so a missing barrier tends to show as a wrong
result, but this is no race detector (use compute-sanitizer on a GPU) and says nothing about speed. By default the
forward that the backward tests need is the float64 reference (fast); ``--real-forward`` emulates the forward kernel
too.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import sys
import time
import types

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if __name__ == "__main__":  # the kernels, launchers and host CUDA of this checkout, whatever else is installed
    sys.path.insert(0, str(ROOT))

from flashlab import hostcuda  # noqa: E402 - after the checkout is on the path


@functools.lru_cache(maxsize=None)
def library(code: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile one kernel file's text for the host (cached by hash) and load it: one launcher per kernel."""
    src = hostcuda.host_source(code)
    names = hostcuda.kernel_names(src)
    if not names:
        raise ValueError('no extern "C" __global__ kernel found in this kernel file')
    return hostcuda.library(src, tuple(names), defines)


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


class _RawModule:
    def __init__(self, code: str, options=()):
        self.lib = library(code, tuple(o for o in options if o.startswith("-D")))

    def get_function(self, name):
        return hostcuda.Kernel(self.lib, name)


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
        get_current_stream=lambda: types.SimpleNamespace(ptr=0),
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


def stand_in_hopper(monkeypatch=None) -> None:
    """Route the sm_90a files through the stand-in ``cupy``: they go to ``cupy.RawModule`` as one text, as every
    other file does (NVRTC needs CuPy's real binding), and tensor maps are the emulation's own (the driver binding
    needs a driver). With ``monkeypatch`` (a test whose stand-in device, sm_90 by default, picks a Hopper rung) the
    change is undone after the test; without, it stays (``install``)."""
    from flashlab.gpu import hopper

    def put(name, value):
        if monkeypatch is None:
            setattr(hopper, name, value)
        else:
            monkeypatch.setattr(hopper, name, value)

    put("module", lambda file, defines=(): sys.modules["cupy"].RawModule(hopper.inlined_source(file), defines))
    put("_encode", hopper.host_tensor_map)
    put("_MAPS", {})


def kernel_texts() -> dict[str, str]:
    """{the text ``cupy.RawModule`` receives: the kernel file (relative to kernels/)} for every kernel file, the
    Hopper files as ``stand_in_hopper`` passes them: for stand-in modules that record which file they were given."""
    import flashlab.gpu as fgpu
    from flashlab.gpu import hopper

    texts = {p.read_text(): p.name for p in fgpu.KERNEL_DIR.glob("*.cu")}
    texts.update({hopper.inlined_source(f"hopper/{p.name}"): f"hopper/{p.name}"
                  for p in hopper.HOPPER_DIR.glob("*.cu")})
    return texts


def install(real_forward: bool = False) -> None:
    """Make ``import cupy`` give the stand-in; unless ``real_forward``, the forward is the float64 reference."""
    import flashlab.gpu as fgpu
    from flashlab import reference

    cp = fake_cupy()
    sys.modules["cupy"] = cp
    stand_in_hopper()  # the sm_90a files: one text, compiled like the others (no NVRTC here)
    if real_forward:
        return

    real = fgpu.attention

    def attention(q, k, v, *, causal=False, scale=None, bf16=False, **kw):
        if kw.get("window") is not None or kw.get("block_mask") is not None:  # block-sparse: the kernel itself
            return real(q, k, v, causal=causal, scale=scale, bf16=bf16, **kw)
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
    real = "--real-forward" in argv or "--forward-check" in argv or "--sparse" in argv or "--hopper" in argv
    argv = [a for a in argv if a != "--real-forward"]
    if argv[:1] == ["--sparse"]:  # the block-sparse kernel's gpu tests (any further pytest arguments follow)
        argv = [str(ROOT / "tests" / "test_gpu_sparse.py"), *argv[1:]]
    if argv[:1] == ["--hopper"]:  # the sm_90a kernels' gpu tests: wgmma emulated with the documented layouts
        argv = [str(ROOT / "tests" / "test_gpu_hopper.py"), *argv[1:]]
    install(real_forward=real)
    if argv[:1] == ["--forward-check"]:
        return forward_check()
    if argv[:1] == ["--selfcheck"]:
        from flashlab.gpu import selfcheck

        return 1 if selfcheck.backward_and_decode(quick="--quick" in argv) else 0
    import pytest

    args = argv or [str(ROOT / "tests" / "test_gpu_backward.py"), str(ROOT / "tests" / "test_gpu_decode.py")]
    return int(pytest.main(["-q", "-m", "gpu", *args]))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
