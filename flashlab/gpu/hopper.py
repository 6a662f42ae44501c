"""Building the Hopper kernels (``kernels/hopper/``) for sm_90a, a target CuPy's RawModule does not ask for.

wgmma (and later setmaxnreg) exist only in the architecture-specific target sm_90a: code built for it runs on
compute capability 9.0 (H100, H200) and nowhere else, not even on newer GPUs. ``cupy.RawModule(code=...)``
always compiles for the plain target of the current device (``-arch=sm_90``), where ptxas rejects wgmma. So the
Hopper files are compiled here with NVRTC for ``-arch=sm_90a`` (through CuPy's own NVRTC binding, which every
CuPy install has), the machine code is written once per process to a temporary file and loaded with
``cupy.RawModule(path=...)``; from there a kernel is found in ``flashlab.gpu``'s dictionary like any other.

The kernels include ``wgmma.cuh`` and ``tma.cuh``, the helpers they share; NVRTC is handed them by name.

The TMA rung reads Q, K and V through tensor maps, 128-byte descriptors of a tensor in global memory that the
driver builds (``cuTensorMapEncodeTiled``). They are built here through NVIDIA's own Python binding of the driver
API, ``cuda-bindings`` (``pip install cuda-bindings``, the package ``cuda-python`` installs): CuPy does not wrap
that call, and the binding is maintained with the driver it wraps. A map depends only on an array's address,
shape and dtype, so each is built once and kept (``tensor_map``), and a call costs no driver call after the first.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import math
import pathlib
import re
import shutil
import subprocess
import tempfile

import numpy as np

from . import HOPPER_SPARSE_FILE, KERNEL_DIR, cuda_driver, hopper_files_from, nvrtc_advice, parse_resource_usage

HOPPER_DIR = KERNEL_DIR / "hopper"
PREFIX = "hopper/"
#: The only compute capability whose GPUs run sm_90a code.
CC = 90
NVRTC_ARCH = "-arch=sm_90a"
# nvcc 13.0's -arch=sm_90a shorthand also ran a plain sm_90 pass that rejects wgmma; the -gencode form does not.
NVCC_ARCH = "-gencode=arch=compute_90a,code=sm_90a"
_TMP: pathlib.Path | None = None


def is_hopper(file: str) -> bool:
    """Whether a kernel file (relative to ``kernels/``) is one of the sm_90a files."""
    return file.startswith(PREFIX)


def _headers() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(HOPPER_DIR.glob("*.cuh"))}


def inlined_source(file: str) -> str:
    """``kernels/FILE`` with its ``#include "wgmma.cuh"`` replaced by the header's text (for the host emulation,
    ``tools/hostemu``, which compiles one text)."""
    text = (KERNEL_DIR / file).read_text()
    for name, header in _headers().items():
        text = text.replace(f'#include "{name}"', header)
    return text


def cubin(file: str, defines: tuple[str, ...] = ()) -> bytes:
    """Machine code for sm_90a of ``kernels/FILE``, compiled by NVRTC (raises RuntimeError with the log)."""
    from cupy_backends.cuda.libs import nvrtc

    source = (KERNEL_DIR / file).read_text()
    headers = _headers()
    # CuPy's wrapper encodes the source, the name and the options itself but passes headers as raw C strings
    prog = nvrtc.createProgram(source, file, tuple(h.encode() for h in headers.values()),
                               tuple(name.encode() for name in headers))
    try:
        try:
            nvrtc.compileProgram(prog, (NVRTC_ARCH, "--std=c++17", *defines))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC could not compile {file} for sm_90a.{nvrtc_advice()}\n"
                               f"{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def module(file: str, defines: tuple[str, ...] = ()):
    """``file`` built for sm_90a and loaded as a ``cupy.RawModule`` (its kernels are RawKernels)."""
    import cupy

    global _TMP
    code = cubin(file, defines)
    if _TMP is None:
        _TMP = pathlib.Path(tempfile.mkdtemp(prefix="flashlab-sm90a-"))
        atexit.register(shutil.rmtree, _TMP, True)
    path = _TMP / (hashlib.sha256(code).hexdigest()[:16] + ".cubin")
    path.write_bytes(code)
    return cupy.RawModule(path=str(path))


@functools.lru_cache(maxsize=32)
def _ptxas_log(file: str, defines: tuple[str, ...] = (), timeout: float = 300) -> str | None:
    """nvcc's output building ``kernels/FILE`` for sm_90a with --resource-usage (None without nvcc): one
    compilation serves both the resource report and the performance notes."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-cubin", NVCC_ARCH, "--std=c++17", "--resource-usage", *defines,
               "-o", str(pathlib.Path(tmp) / "k.cubin"), str(KERNEL_DIR / file)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return res.stderr + res.stdout


def compile_report(file: str, defines: tuple[str, ...] = ()) -> list[dict] | None:
    """ptxas's resource usage of ``kernels/FILE`` built by nvcc for sm_90a (None without nvcc), as
    ``flashlab.gpu.compile_report`` gives it for the other files."""
    log = _ptxas_log(file, tuple(defines))
    return None if log is None else parse_resource_usage(log)


def compiler_notes(file: str, defines: tuple[str, ...] = ()) -> list[str]:
    """ptxas's performance notes on ``file`` (e.g. C7519: a warpgroup.arrive it had to insert because registers
    that a wgmma reads were written while an earlier wgmma ran). Empty without nvcc."""
    log = _ptxas_log(file, tuple(defines))
    return [] if log is None else [line for line in log.splitlines() if re.search(r"\(C\d{4}\)", line)]


def emulation_problem() -> str | None:
    """Why :func:`emulated_attention` cannot run here (None: it can): the host emulation needs a C++20 compiler."""
    from .. import hostcuda

    return hostcuda.compiler_problem()


def emulated_attention(q, k, v, *, causal: bool = False, scale: float | None = None, rung: str = "wgmma"):
    """A Hopper rung run on the CPU: its .cu compiled by g++ against the host emulation of CUDA
    (``flashlab.hostcuda``, wgmma emulated from the rules of ``flashlab.wgmma``). NumPy float16 arrays, q (n, d) or
    (batch, heads, n, d), k and v alike with heads_kv dividing heads; returns ``(o, lse)`` as the GPU call does.
    Slow (one OS thread per CUDA thread): for small shapes, to see the kernel's logic run without a Hopper GPU."""
    from .. import hostcuda
    from .._checks import check_scale
    from . import HEAD_DIMS, HOPPER_RUNGS, KNOWN_DEVICES

    if problem := emulation_problem():
        raise RuntimeError(f"the host emulation needs a C++20 compiler: {problem}")
    arrays = [np.ascontiguousarray(x) for x in (q, k, v)]
    if any(x.dtype != np.float16 for x in arrays) or not (q.ndim == k.ndim == v.ndim and q.ndim in (2, 4)):
        raise TypeError("expected float16 NumPy arrays, all (n, d) or all (batch, heads, n, d)")
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or k.shape != v.shape:
        raise ValueError(f"expected d in {HEAD_DIMS} for q, k and v, and k and v of one shape; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    spec = HOPPER_RUNGS[rung]
    B, H, n = (1, 1, q.shape[0]) if q.ndim == 2 else q.shape[:3]
    Hk, m = (1, k.shape[0]) if k.ndim == 2 else k.shape[1:3]
    if H % Hk:
        raise ValueError(f"k/v heads must divide q heads; got {Hk} and {H}")
    name = forward_entry(spec.file, "f16", d, not causal and k.shape[-2] > 0)
    lib = hostcuda.library(hostcuda.host_source(inlined_source(spec.file)), (name,))
    o = np.full(q.shape, np.nan, np.float16)
    lse = np.full(q.shape[:-1], np.nan, np.float32)
    # a persistent kernel gets as many blocks as an H200 has SMs (or PERSISTENT_BLOCKS)
    grid, more = launch_shape(spec.file, (-(-n // spec.block_rows), H, B), KNOWN_DEVICES["H200"].sm_count, d,
                              lambda floats, counters: (np.zeros(floats, np.float32), np.zeros(counters, np.int32)))
    inputs = arrays
    if spec.file in TMA_FILES:  # the emulation's own tensor maps (host_tensor_map) over the NumPy arrays
        inputs = [np.frombuffer(host_tensor_map(x.ctypes.data, d, x.shape[-2], x.size // (d * x.shape[-2]), "f16",
                                                box), dtype=TENSOR_MAP_DTYPE)[0]
                  for x, box in zip(arrays, (QUERY_TILE, key_tile(spec.file, d), key_tile(spec.file, d)),
                                    strict=True)]
    hostcuda.Kernel(lib, name)(grid, (spec.threads,), (*inputs, o, lse, np.int32(n), np.int32(m), np.int32(H),
                                                       np.int32(Hk), np.float32(check_scale(scale, d)),
                                                       np.int32(bool(causal)), *more))
    return o, lse



def emulated_backward(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None,
                      kernel: str = "wgmma"):
    """A Hopper backward kernel (``flashlab.gpu.backward``'s ``"wgmma"``, ``"wgmma_overlap"``, ``"wgmma_bulk"`` or
    ``"wgmma_balanced"``) run on the CPU under the host emulation, with the same three kernels
    ``attention_backward`` launches (D, the main kernel, dQ's scaling and rounding). float16 NumPy arrays shaped
    as for :func:`emulated_attention`, o and lse as the forward returned them (lse float32); returns
    ``(dq, dk, dv)`` in float16. Slow: small shapes only."""
    from .. import hostcuda
    from .._checks import check_scale
    from . import HEAD_DIMS
    from . import backward as gbwd

    if problem := emulation_problem():
        raise RuntimeError(f"the host emulation needs a C++20 compiler: {problem}")
    mk = gbwd.MAIN_KERNELS.get(kernel)
    if mk is None or not mk.hopper:
        raise ValueError(f"kernel must be one of {[n for n, x in gbwd.MAIN_KERNELS.items() if x.hopper]}; "
                         f"got {kernel!r}")
    q, k, v, o, do = (np.ascontiguousarray(x) for x in (q, k, v, o, do))
    if any(x.dtype != np.float16 for x in (q, k, v, o, do)) or not (q.ndim == k.ndim == v.ndim and q.ndim in (2, 4)):
        raise TypeError("expected float16 NumPy arrays, all (n, d) or all (batch, heads, n, d)")
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or k.shape != v.shape or o.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"expected d in {HEAD_DIMS}, k and v of one shape, o and do of q's; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}, o {o.shape}, do {do.shape}")
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    if lse.shape != q.shape[:-1]:
        raise ValueError(f"lse must have shape {q.shape[:-1]}; got {lse.shape}")
    B, H, n = (1, 1, q.shape[0]) if q.ndim == 2 else q.shape[:3]
    Hk, m = (1, k.shape[0]) if k.ndim == 2 else k.shape[1:3]
    if H % Hk:
        raise ValueError(f"k/v heads must divide q heads; got {Hk} and {H}")
    sc = check_scale(scale, d)
    main_name, dq_name = f"{mk.stem}_f16_d{d}", f"bwd_dq_tiles_f16_d{d}" if mk.dq_tiles else "bwd_dq_f16"
    lib = hostcuda.library(hostcuda.host_source(inlined_source(mk.file)),
                           (main_name, dq_name) if mk.dq_tiles else (main_name,))
    base = hostcuda.library(hostcuda.host_source((KERNEL_DIR / gbwd.KERNEL_FILE).read_text()),
                            (f"bwd_dot_f16_d{d}", "bwd_dq_f16"))
    rows, threads = B * H * n, gbwd.THREADS
    dvec = np.zeros(q.shape[:-1], np.float32)
    hostcuda.Kernel(base, f"bwd_dot_f16_d{d}")((-(-rows // (threads // 32)), 1, 1), (threads,),
                                               (o, do, dvec, np.int32(rows)))
    acc = np.zeros(mk.dq_buffer_shape(B, H, n, d), np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    key_blocks = -(-m // mk.block_keys)
    args = (q, k, v, do, lse, dvec, acc, dk, dv, np.int32(n), np.int32(m), np.int32(H), np.int32(Hk), np.float32(sc),
            np.int32(bool(causal)))
    if mk.grouped:
        args = (*args, np.int32(gbwd.balanced_group(key_blocks, B * Hk, causal)))
    hostcuda.Kernel(lib, main_name)((key_blocks, Hk, B), (mk.threads,), args)
    if mk.dq_tiles:  # one thread per 16 bytes of the tiled buffer
        blocks = acc.size // 4
        hostcuda.Kernel(lib, dq_name)((-(-blocks // threads), 1, 1), (threads,),
                                      (acc, dq, np.float32(sc), np.int32(n), np.int64(blocks)))
    else:
        hostcuda.Kernel(base, dq_name)((-(-acc.size // threads), 1, 1), (threads,),
                                       (acc, dq, np.float32(sc), np.int64(acc.size)))
    return dq, dk, dv

# ------------------------------------------------------------------------------------------- tensor maps (TMA)
#: The files whose kernels take tensor maps for q, k and v instead of pointers.
TMA_FILES = hopper_files_from("tma") | {HOPPER_SPARSE_FILE}  # H2 on, and the block-sparse kernel
#: Keys per tile of the Hopper rungs at each head dimension (their BC); from rung 4 on, 128 at both.
KEY_TILE = {64: 128, 128: 64}
KEY_TILE_OF = {file: {64: 128, 128: 128} for file in sorted(hopper_files_from("overlap") | {HOPPER_SPARSE_FILE})}
QUERY_TILE = 64
#: Persistent kernels: at most one block per SM, each walking the output tiles gridDim.x apart; they take the
#: batch size as one more argument (the grid no longer carries it).
PERSISTENT_FILES = hopper_files_from("persistent") | {HOPPER_SPARSE_FILE}  # H8 on, and the block-sparse kernel
#: Rungs that share the tiles past the last whole round out by key tiles (stream-K, rung 12 on): after the batch size
#: they take a workspace for the pieces of cut tiles and the counters of its boundaries (``stream_k_workspace``).
STREAM_K_FILES = hopper_files_from("stream_k")
#: At most this many persistent blocks (None: one per SM). The host emulation's tests lower it, so that a small
#: problem still gives each block several tiles.
PERSISTENT_BLOCKS: int | None = None


def persistent_grid(grid: tuple[int, int, int], sm_count: int) -> tuple[int, int, int]:
    """The persistent launch of a kernel whose blocks would be ``grid``: one block per SM, or per tile if fewer."""
    cap = sm_count if PERSISTENT_BLOCKS is None else min(sm_count, PERSISTENT_BLOCKS)
    return (max(1, min(grid[0] * grid[1] * grid[2], cap)), 1, 1)


def forward_entry(file: str, dt: str, d: int, nomask: bool) -> str:
    """The kernel of ``kernels/FILE`` a forward call launches: ``attn_fwd_{dt}_d{d}``, or for a call without a mask
    and with keys (``nomask``) to a stream-K rung its ``_nomask`` kernel, the one with the stream-K deal."""
    return f"attn_fwd_{dt}_d{d}" + ("_nomask" if nomask and file in STREAM_K_FILES else "")


def stream_k_workspace(blocks: int, d: int) -> tuple[int, int]:
    """Floats and counters a stream-K rung needs on ``blocks`` persistent blocks at head dimension ``d``: for each
    boundary between two blocks' runs (blocks - 1 of them) two pieces of a cut tile, 8 consumer warps a piece, each
    lane's D / 2 accumulators and its rows' sums and maxima; a counter per boundary and warp."""
    boundaries = max(blocks - 1, 1)
    return boundaries * 2 * 8 * 32 * (d // 2 + 4), boundaries * 8


def stream_k_deal(tiles: int, key_tiles: int, blocks: int) -> list[list[tuple[int, int, int]]]:
    """What each of ``blocks`` persistent blocks of a stream-K rung computes without a mask, as the kernel deals it
    (``h12_stream_k.cu``): for each block its pieces in order, (output tile, first key tile, one past the last).
    Every whole round but the last is dealt one tile a block; the tiles left (``blocks`` to 2 ``blocks`` - 1 of them)
    are cut by key tiles into ``blocks`` runs of equal length (to one key tile), so a tile may be cut in two: its
    first piece ends block k's run, its second starts block k + 1's."""
    if not 0 < blocks <= tiles or key_tiles < 1:
        raise ValueError(f"expected 0 < blocks <= tiles and key_tiles >= 1; got {blocks}, {tiles}, {key_tiles}")
    whole = tiles // blocks - 1
    deal = [[(j * blocks + k, 0, key_tiles) for j in range(whole)] for k in range(blocks)]
    left = (tiles - whole * blocks) * key_tiles
    for k in range(blocks):
        run0, run1 = left * k // blocks, left * (k + 1) // blocks
        for i in range(run0 // key_tiles, -(-run1 // key_tiles)):
            a = i * key_tiles
            deal[k].append((whole * blocks + i, max(run0 - a, 0), min(run1 - a, key_tiles)))
    return deal


def launch_shape(file: str, grid: tuple[int, int, int], sm_count: int, d: int = 128,
                 scratch=None) -> tuple[tuple[int, int, int], tuple]:
    """The grid of ``kernels/FILE`` whose blocks would be ``grid`` (one per 128 query rows, head and batch entry),
    and the arguments it takes after the common ones: a persistent kernel's grid and its batch size, and for a
    stream-K rung its workspace and counters, from ``scratch(floats, counters)`` (float32 and int32 arrays, the
    counters zero; the kernel leaves them at zero)."""
    if file in PERSISTENT_FILES:
        blocks = persistent_grid(grid, sm_count)
        if file in STREAM_K_FILES:
            if scratch is None:
                raise ValueError(f"{file} takes a workspace: pass scratch=")
            return blocks, (np.int32(grid[2]), *scratch(*stream_k_workspace(blocks[0], d)))
        return blocks, (np.int32(grid[2]),)
    return grid, ()


def launch_inputs(file: str, q, k, v, dt: str, d: int, grid: tuple[int, int, int], sm_count: int, scratch=None):
    """What a launcher passes the Hopper kernel of ``file`` (dense or block-sparse): q, k and v (their tensor maps
    where it reads by TMA), its grid, and the arguments it takes after the others (``launch_shape``)."""
    if file in TMA_FILES:
        q, k, v = tma_maps(q, k, v, dt, d, file)
    grid, more = launch_shape(file, grid, sm_count, d, scratch)
    return (q, k, v), grid, more


_SCRATCH: dict[tuple, tuple] = {}


def device_scratch(cp):
    """``scratch`` for ``launch_shape`` on the current device and stream: one workspace and one set of counters,
    kept and grown as needed. Per stream, because two calls of a stream-K rung in flight at once on two streams
    would count on the same counters; calls on one stream run one after another."""
    from . import _device_id

    def scratch(floats: int, counters: int):  # asked only by a stream-K rung's launch
        key = (_device_id(cp), cp.cuda.get_current_stream().ptr)
        ws, cnt = _SCRATCH.get(key, (None, None))
        if ws is None or ws.size < floats or cnt.size < counters:
            ws, cnt = cp.empty(floats, dtype=cp.float32), cp.zeros(counters, dtype=cp.int32)
            _SCRATCH[key] = (ws, cnt)
        return ws, cnt

    return scratch


PANEL = 64  # columns of one box: one 128-byte row of 16-bit elements, the span of the 128-byte swizzle
#: A tensor map as a kernel argument: 128 bytes passed by value (CuPy passes a NumPy structured scalar's bytes).
TENSOR_MAP_DTYPE = np.dtype([("opaque", np.uint64, (16,))])
_MAPS: dict[tuple, object] = {}
_MAPS_KEPT = 256


def _encode(ptr: int, d: int, rows: int, heads: int, dt: str, box_rows: int, classes: int = 1) -> bytes:
    """The driver's tensor map (128 bytes) of a (heads, rows, d) array of 16-bit elements at ``ptr``: boxes of
    64 columns by ``box_rows`` rows of one head, written to shared memory in the 128-byte swizzle, rows past the
    end filled with zeros. ``classes`` = r > 1: the same memory as a 4-D map whose boxes hold rows r apart
    (``_layout``)."""
    cu = cuda_driver("the TMA rung builds tensor maps")
    kind = cu.CUtensorMapDataType
    sizes, strides, box = _layout(d, rows, heads, classes, box_rows)
    # rows r apart: a 256-byte promotion would bring a neighbouring class's row into L2 with each 128-byte row
    promotion = cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B if classes == 1 else (
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B)
    err, tmap = cu.cuTensorMapEncodeTiled(
        kind.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if dt == "bf16" else kind.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, len(sizes),
        ptr, [cu.cuuint64_t(x) for x in sizes], [cu.cuuint64_t(x) for x in strides],
        [cu.cuuint32_t(x) for x in box], [cu.cuuint32_t(1)] * len(sizes),
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        promotion, cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for a ({heads}, {rows}, {d}) {dt} array with "
                           f"boxes of {box_rows} x {PANEL}" + (f" in {classes} residue classes" if classes > 1 else ""))
    return ctypes.string_at(tmap.getPtr(), 128)


def _layout(d: int, rows: int, heads: int, classes: int, box_rows: int) -> tuple[tuple, tuple, tuple]:
    """Sizes, byte strides (of every dimension but the first) and box of a tensor map over (heads, rows, d) 16-bit
    elements: 3-D (column, row, head); or, for ``classes`` = r > 1 (r dividing rows), 4-D (column, class, position
    in the class, head), whose box holds box_rows rows of one class, r rows apart: position a of class c is row
    c + r a of its head, and positions past rows / r are zeros. The sparse kernel's residue classes
    (kernels/hopper/sparse_h8.cu)."""
    if classes == 1:
        return (d, rows, heads), (d * 2, rows * d * 2), (PANEL, box_rows, 1)
    return (d, classes, rows // classes, heads), (d * 2, classes * d * 2, rows * d * 2), (PANEL, 1, box_rows, 1)


def tensor_map(x, dt: str, box_rows: int, classes: int = 1):
    """The tensor map of a CuPy array ``x`` (n, d) or (batch, heads, n, d) of 16-bit elements, as the kernel
    parameter it is passed as (a NumPy structured scalar of 128 bytes): built once per address, shape, dtype, box and
    ``classes`` (``_layout``), then found in a dictionary."""
    # A call finds its maps with one tuple and one dictionary lookup each (np.prod alone would cost microseconds).
    key = (x.data.ptr, x.shape, dt, box_rows, classes)
    value = _MAPS.get(key)
    if value is None:
        d, rows, heads = x.shape[-1], x.shape[-2], math.prod(x.shape[:-2])
        value = np.frombuffer(_encode(x.data.ptr, d, rows, heads, dt, box_rows, classes),
                              dtype=TENSOR_MAP_DTYPE)[0]
        if len(_MAPS) >= _MAPS_KEPT:
            _MAPS.pop(next(iter(_MAPS)))
        _MAPS[key] = value
    return value


def key_tile(file: str, d: int) -> int:
    """Keys per tile (the rows of a K or V box) of the Hopper kernel file ``file`` at head dimension ``d``."""
    return KEY_TILE_OF.get(file, KEY_TILE)[d]


def tma_maps(q, k, v, dt: str, d: int, file: str, classes: int = 1) -> tuple:
    """The three tensor maps the TMA rung of ``file`` takes in place of q, k and v (``classes``: ``_layout``)."""
    bc = key_tile(file, d)
    return (tensor_map(q, dt, QUERY_TILE, classes), tensor_map(k, dt, bc, classes),
            tensor_map(v, dt, bc, classes))


def host_tensor_map(ptr: int, d: int, rows: int, heads: int, dt: str, box_rows: int, classes: int = 1) -> bytes:
    """What the host emulation of CUDA (``flashlab.hostcuda``) takes for a tensor map in place of the driver's
    opaque one: address, sizes, strides in bytes and box, in 16 words. ``tools/hostemu`` puts it in place of
    ``_encode``."""
    sizes, strides, _ = _layout(d, rows, heads, classes, box_rows)
    if classes == 1:  # cuda_host.h's tma_load_3d: rows and heads, their strides
        words = [ptr, d, rows, heads, strides[0], strides[1], PANEL, box_rows] + [0] * 8
    else:  # and tma_load_4d: the positions of a class as the rows, the classes between (words 8 and 9)
        words = [ptr, d, sizes[2], heads, strides[1], strides[2], PANEL, box_rows, classes, strides[0]] + [0] * 6
    return np.array(words, dtype=np.uint64).tobytes()
