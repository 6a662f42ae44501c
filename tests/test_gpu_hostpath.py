"""The launchers' host path: a repeated call reads no file, builds no kernel and allocates nothing it was given.

Runs without a GPU: CuPy is replaced by the NumPy stand-in of tools/hostemu, with a RawModule that counts what it
builds and kernels that record their launches instead of running. What is asserted is deterministic (counts of
file reads, modules, functions, attribute sets, allocations and launches), never a time.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import numpy as np
import pytest

import flashlab.gpu as fgpu
from flashlab.gpu import backward as gbwd
from flashlab.gpu import decoding

_HOSTEMU = pathlib.Path(__file__).resolve().parents[1] / "tools" / "hostemu" / "hostemu.py"
_spec = importlib.util.spec_from_file_location("hostemu", _HOSTEMU)
hostemu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostemu)


class Counts:
    def __init__(self):
        self.reads: list[str] = []
        self.modules = 0
        self.functions = 0
        self.smem_sets = 0
        self.allocations = 0
        self.launches: list[tuple[str, tuple]] = []

    def snapshot(self) -> tuple:
        return (len(self.reads), self.modules, self.functions, self.smem_sets, self.allocations)


@pytest.fixture
def stand_in(monkeypatch):
    """``import cupy`` gives the host stand-in with counting modules, kernels and allocators."""
    counts = Counts()
    cp = hostemu.fake_cupy()

    class Kernel:
        def __init__(self, name):
            object.__setattr__(self, "name", name)

        def __setattr__(self, attr, value):
            if attr == "max_dynamic_shared_size_bytes":
                counts.smem_sets += 1
            object.__setattr__(self, attr, value)

        def __call__(self, grid, block, args, shared_mem=0):
            counts.launches.append((self.name, args))

    class RawModule:
        def __init__(self, code, options=()):
            counts.modules += 1

        def get_function(self, name):
            counts.functions += 1
            return Kernel(name)

    cp.RawModule = RawModule
    def counting(allocate):
        def counted(*a, **k):
            counts.allocations += 1
            return hostemu._wrap(allocate(*a, **k))

        return counted

    for name in ("empty", "empty_like", "zeros", "full"):
        setattr(cp, name, counting(getattr(np, name)))
    cp.asarray = counting(cp.asarray)
    real_read = pathlib.Path.read_text

    def read_text(self, *a, **k):
        if self.suffix == ".cu":
            counts.reads.append(self.name)
        return real_read(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    hostemu.stand_in_hopper(monkeypatch)  # the stand-in device is sm_90, where "best" is a Hopper rung
    fgpu._module.cache_clear()
    monkeypatch.setattr(fgpu, "_FUNCTIONS", {})
    monkeypatch.setattr(fgpu, "_CAPABILITY", {})
    monkeypatch.setattr(fgpu, "_SM_COUNT", {})
    yield types.SimpleNamespace(cp=cp, counts=counts)
    fgpu._module.cache_clear()


def _half(cp, *shape):
    return hostemu._wrap(np.random.default_rng(0).standard_normal(shape).astype(np.float16))


def test_attention_builds_its_kernel_once_and_then_only_launches(stand_in):
    cp, counts = stand_in.cp, stand_in.counts
    q, k, v = (_half(cp, 1, 2, 64, 128) for _ in range(3))
    out = (_half(cp, 1, 2, 64, 128), hostemu._wrap(np.empty((1, 2, 64), np.float32)))
    fgpu.attention(q, k, v, out=out)
    rung = fgpu.plan(q, k, v).spec  # the stand-in device is sm_90: a Hopper rung, with its tensor maps
    assert rung.file.startswith("hopper/")
    assert counts.reads == [pathlib.Path(rung.file).name] and counts.modules == 1 and counts.functions == 1
    assert counts.smem_sets == (rung.shared_bytes(128) > fgpu.STATIC_SMEM_LIMIT)
    before, launched = counts.snapshot(), len(counts.launches)
    for _ in range(3):
        o, lse = fgpu.attention(q, k, v, out=out)
        assert o is out[0] and lse is out[1]
    assert counts.snapshot() == before  # no read, no module, no function, no attribute, no allocation
    assert len(counts.launches) == launched + 3
    fgpu.attention(q, k, v)  # without out=: the two outputs are all it allocates
    assert counts.allocations == before[-1] + 2


@pytest.mark.parametrize("pattern", ["window", "blocks"])
def test_block_sparse_call_builds_its_schedule_once_and_then_only_launches(stand_in, pattern):
    """A block-sparse call (window= or a block mask) after the first: no file read, no module, no allocation (the
    order of the output tiles, the layout's lists and the tensor maps are kept), one launch, the same order array."""
    from flashlab import blocksparse

    cp, counts = stand_in.cp, stand_in.counts
    q, k, v = (_half(cp, 1, 2, 640, 128) for _ in range(3))
    out = (_half(cp, 1, 2, 640, 128), hostemu._wrap(np.empty((1, 2, 640), np.float32)))
    if pattern == "window":
        call = dict(window=(256, 0))
    else:
        call = dict(block_mask=blocksparse.sliding_window(256, 0).block_mask(640, 640, *fgpu.sparse_block(128)))
    fgpu.attention(q, k, v, out=out, **call)
    assert counts.reads == [pathlib.Path(fgpu.HOPPER_SPARSE_FILE).name]  # the stand-in device is sm_90
    before, launched = counts.snapshot(), len(counts.launches)
    for _ in range(3):
        o, lse = fgpu.attention(q, k, v, out=out, **call)
        assert o is out[0] and lse is out[1]
    assert counts.snapshot() == before
    calls = counts.launches[launched:]
    assert [name for name, _ in calls] == [f"attn_{pattern}_f16_d128"] * 3
    orders = [next(a for a in args if isinstance(a, np.ndarray) and a.dtype == np.int32 and a.size == 10)
              for _, args in calls]
    assert all(x is orders[0] for x in orders)  # 5 query blocks x 2 heads, ranked once


def test_window_call_is_planned_once_per_signature_and_still_checks_each_call(stand_in, monkeypatch):
    """A repeated window call neither plans nor checks its window again (its launch is kept by signature), yet every
    call still refuses a non-contiguous array and a wrong out=, and another window is planned afresh."""
    cp, counts = stand_in.cp, stand_in.counts
    q, k, v = (_half(cp, 1, 2, 640, 128) for _ in range(3))
    planned = []
    real_plan = fgpu._plan_sparse
    monkeypatch.setattr(fgpu, "_plan_sparse", lambda *a: planned.append(a) or real_plan(*a))
    for _ in range(3):
        fgpu.attention(q, k, v, window=(256, 0))
    assert len(planned) == 1
    assert [name for name, _ in counts.launches] == ["attn_window_f16_d128"] * 3
    with pytest.raises(ValueError, match="C-contiguous"):
        fgpu.attention(q, k, hostemu._wrap(np.asfortranarray(np.asarray(v))), window=(256, 0))
    with pytest.raises(ValueError, match="out"):
        fgpu.attention(q, k, v, window=(256, 0), out=(_half(cp, 1, 2, 640, 64), hostemu._wrap(np.empty((1, 2, 640),
                                                                                                   np.float32))))
    assert len(planned) == 1
    fgpu.attention(q, k, v, window=[256, 0])  # a list is the same window
    fgpu.attention(q, k, v, window=(128, 0))
    fgpu.attention(q, k, v, window=(256, 0), scale=0.1)
    assert len(planned) == 3
    for _ in range(2):  # bad input is never planned: it gets the full checks' error every time
        with pytest.raises(ValueError, match="left must be >= 0"):
            fgpu.attention(q, k, v, window=(-1, 0))
    monkeypatch.setattr(fgpu, "_SPARSE_KEPT", 2)  # a bounded dictionary: the oldest plans are dropped
    fgpu.attention(q, k, v, window=(64, 0))
    assert len(fgpu._FUNCTIONS["sparse calls"]) == 2


@pytest.mark.parametrize("preallocated", [False, True])
@pytest.mark.parametrize("extra,op,launched", [(["--window", "128"], "attention_window", "attn_window_f16_d128"),
                                               (["--decode-kernels", "fused"], "decode_fused",
                                                "decode_fused_f16_d128")])
def test_bench_host_times_further_calls_when_asked(stand_in, preallocated, extra, op, launched):
    """``python -m flashlab bench host --window W`` and ``--decode-kernels fused``: an op row of its own, a call that
    launches the window kernel or the fused decoding kernel alone."""
    from flashlab.bench import host

    counts = stand_in.counts
    base = ["--n", "256", "--heads", "2", "--m", "512"]
    calls = host._calls(fgpu, host.parser().parse_args([*base, *extra]), preallocated)
    assert list(calls) == [*host.OPS, op]
    before = len(counts.launches)
    calls[op]()
    assert [name for name, _ in counts.launches[before:]] == [launched]
    assert list(host._calls(fgpu, host.parser().parse_args(base), preallocated)) == list(host.OPS)  # as recorded


@pytest.mark.parametrize("kernel", ["best", "pipe"])
def test_backward_with_out_and_a_workspace_allocates_nothing_on_later_calls(stand_in, kernel):
    """On the stand-in sm_90 device "best" is the Hopper kernel (HOPPER_BEST, with its tiled dQ buffer and its own
    converter); "pipe" is what it runs before Hopper. Either way a later call reads no file, allocates nothing and
    clears the workspace's dQ buffer before adding into it."""
    cp, counts = stand_in.cp, stand_in.counts
    q, k, v, o, do = (_half(cp, 1, 2, 64, 64) for _ in range(5))
    lse = hostemu._wrap(np.zeros((1, 2, 64), np.float32))
    grads = tuple(_half(cp, 1, 2, 64, 64) for _ in range(3))
    ws = fgpu.Workspace()
    fgpu.attention_backward(q, k, v, o, lse, do, out=grads, workspace=ws, kernel=kernel)
    name = gbwd.HOPPER_BEST if kernel == "best" else kernel
    mk = gbwd.MAIN_KERNELS[name]
    assert sorted(set(counts.reads)) == sorted({gbwd.KERNEL_FILE, pathlib.Path(mk.file).name})
    before, launched = counts.snapshot(), len(counts.launches)
    acc = ws.get("bwd_dq_acc", mk.dq_buffer_shape(1, 2, 64, 64), np.float32)
    acc[...] = 7.0  # what a previous call left: the next call must clear it
    result = fgpu.attention_backward(q, k, v, o, lse, do, out=grads, workspace=ws, kernel=kernel)
    assert all(a is b for a, b in zip(result, grads, strict=True))
    assert counts.snapshot() == before
    convert = "bwd_dq_tiles_f16_d64" if mk.dq_tiles else "bwd_dq_f16"
    assert [n for n, _ in counts.launches[launched:]] == ["bwd_dot_f16_d64", f"{mk.stem}_f16_d64", convert]
    assert not acc.any()  # the dq accumulator was zeroed before the main kernel
    assert counts.launches[-2][1][6] is acc  # and it is the workspace's buffer the main kernel adds into


def test_decode_default_lengths_pass_a_null_pointer_and_reuse_the_workspace(stand_in):
    cp, counts = stand_in.cp, stand_in.counts
    q = _half(cp, 1, 4, 1, 128)
    kc, vc = _half(cp, 1, 4, 1000, 128), _half(cp, 1, 4, 1000, 128)
    out = (_half(cp, 1, 4, 1, 128), hostemu._wrap(np.empty((1, 4, 1), np.float32)))
    ws = fgpu.Workspace()
    fgpu.decode(q, kc, vc, out=out, workspace=ws)
    held = ws.nbytes
    before, launched = counts.snapshot(), len(counts.launches)
    o, lse = fgpu.decode(q, kc, vc, out=out, workspace=ws)
    assert o is out[0] and lse is out[1]
    assert counts.snapshot() == before and ws.nbytes == held
    calls = counts.launches[launched:]
    assert [name for name, _ in calls] == ["decode_mma_f16_d128", "decode_merge_f16_d128"]  # no fill kernel
    lens = calls[0][1][3]
    assert isinstance(lens, np.int64) and lens == 0 and lens.nbytes == 8  # a null pointer's bytes
    # Given lengths travel as a device array, and fewer splits reuse the workspace's buffers.
    fgpu.decode(q, kc, vc, out=out, workspace=ws, lengths=[500], num_splits=2)
    assert isinstance(counts.launches[-2][1][3], np.ndarray) and ws.nbytes == held


def test_fused_decode_is_one_launch_with_its_tree_in_the_workspace(stand_in):
    """kernel="fused" launches the split kernel alone, with the tree's buffers and counters from the workspace: the
    counters zeroed when allocated (the kernel leaves them at zero), nothing allocated on the next call."""
    cp, counts = stand_in.cp, stand_in.counts
    q = _half(cp, 1, 32, 1, 128)
    kc, vc = _half(cp, 1, 8, 20000, 128), _half(cp, 1, 8, 20000, 128)
    out = (_half(cp, 1, 32, 1, 128), hostemu._wrap(np.empty((1, 32, 1), np.float32)))
    ws = fgpu.Workspace()
    fgpu.decode(q, kc, vc, out=out, workspace=ws, kernel="fused", num_splits=66)
    before, launched = counts.snapshot(), len(counts.launches)
    fgpu.decode(q, kc, vc, out=out, workspace=ws, kernel="fused", num_splits=66)
    assert counts.snapshot() == before
    (name, args), = counts.launches[launched:]
    assert name == "decode_fused_f16_d128"
    tree_o, tree_l, counters, o, lse, ntree, ncount = args[-7:]
    assert o is out[0] and lse is out[1] and (int(ntree), int(ncount)) == decoding.merge_tree_sizes(66) == (5, 6)
    assert tree_o.shape == (32, 5, 128) and tree_l.shape == (32, 5)
    assert counters is ws.get("decode_counters", (8 * 6,), np.int32) and not counters.any()


def test_decode_plans_a_signature_once_and_still_checks_each_call(stand_in, monkeypatch):
    """A repeated decoding step neither plans nor asks for the split count again (its launches are kept by
    signature), yet every call still refuses a non-contiguous array."""
    from flashlab.gpu import decoding

    cp, counts = stand_in.cp, stand_in.counts
    q = _half(cp, 1, 32, 1, 128)
    kc, vc = _half(cp, 1, 8, 1000, 128), _half(cp, 1, 8, 1000, 128)
    planned = []
    real_plan = decoding._plan_step
    monkeypatch.setattr(decoding, "_plan_step", lambda *a: planned.append(a) or real_plan(*a))
    for _ in range(3):
        fgpu.decode(q, kc, vc)
    assert len(planned) == 1
    assert [name for name, _ in counts.launches] == ["decode_mma_f16_d128", "decode_merge_f16_d128"] * 3
    # Same shape, other strides: another signature, so the call is planned, and the plan's checks refuse it.
    with pytest.raises(ValueError, match="C-contiguous"):
        fgpu.decode(q, kc, hostemu._wrap(np.asfortranarray(np.asarray(vc))))
    assert len(planned) == 2 and len(fgpu._FUNCTIONS["decode steps"]) == 1  # nothing kept for it
    strided = hostemu._wrap(np.asarray(kc)[:, :, ::2].copy())
    fgpu.decode(q, strided, strided)  # another signature: planned afresh
    assert len(planned) == 3
    # a cache that grows every step is a new signature every step: the oldest plans are dropped
    monkeypatch.setattr(decoding, "_STEPS_KEPT", 2)
    fgpu.decode(q, kc[:, :, :999].copy(), vc[:, :, :999].copy())
    assert len(fgpu._FUNCTIONS["decode steps"]) == 2 and len(planned) == 4
    fgpu.decode(q, kc, vc)  # the first signature was dropped: planned again
    assert len(planned) == 5



def test_a_planned_decode_step_queues_the_split_first_and_still_refuses_a_wrong_out(stand_in):
    """On a planned step the split kernel, which writes the partials only, is launched before the outputs are checked
    (that Python then overlaps the GPU's work); a wrong ``out=`` is still refused before the merge writes to it, and a
    misaligned input before anything is launched."""
    cp, counts = stand_in.cp, stand_in.counts
    q = _half(cp, 1, 32, 1, 128)
    kc, vc = _half(cp, 1, 8, 1000, 128), _half(cp, 1, 8, 1000, 128)
    ws = fgpu.Workspace()
    out = (_half(cp, 1, 32, 1, 128), hostemu._wrap(np.zeros((1, 32, 1), np.float32)))
    fgpu.decode(q, kc, vc, out=out, workspace=ws)  # plans the step
    o_before, lse_before = np.array(out[0]), np.array(out[1])
    launched = len(counts.launches)
    wrong = (out[0], hostemu._wrap(np.zeros((1, 32, 2), np.float32)))
    with pytest.raises(ValueError, match=r"out\[1\] must be a C-contiguous CuPy array of shape \(1, 32, 1\)"):
        fgpu.decode(q, kc, vc, out=wrong, workspace=ws)
    assert [name for name, _ in counts.launches[launched:]] == ["decode_mma_f16_d128"]  # no merge: nothing written
    assert np.array_equal(np.array(out[0]), o_before) and np.array_equal(np.array(out[1]), lse_before)
    launched = len(counts.launches)
    raw = np.empty(1 * 8 * 1000 * 128 + 1, np.float16)
    shifted = hostemu._wrap(raw[1:].reshape(1, 8, 1000, 128))  # 2 bytes past a 16-byte boundary
    shifted[...] = kc
    assert shifted.data.ptr % 16 == 2
    with pytest.raises(ValueError, match="16-byte boundary"):
        fgpu.decode(q, shifted, vc, out=out, workspace=ws)
    assert len(counts.launches) == launched


def _fake_driver(launched: list):
    """A stand-in for ``cuda.bindings.driver`` that reads each launch's argument block as the driver would: the
    array of pointers at ``params``, each to an 8-byte slot (a function's handle is (its name, its slot count))."""
    import ctypes

    class Driver:
        class CUresult:
            CUDA_SUCCESS = 0

        CUfunction = staticmethod(lambda handle: handle)
        CUstream = staticmethod(lambda ptr: ("stream", ptr))

        @staticmethod
        def cuLaunchKernel(func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            name, count = func
            pointers = (ctypes.c_void_p * count).from_address(params)
            values = [ctypes.c_uint64.from_address(p).value for p in pointers]
            launched.append((name, (gx, gy, gz), bx, stream, params, values))
            return (Driver.failure,)

        failure = 0

    return Driver


def test_a_planned_decode_step_through_the_driver_passes_cupys_arguments_slot_for_slot(stand_in, monkeypatch):
    """With cuda-bindings installed a decoding step launches both kernels through the driver from argument blocks
    kept between calls. Every slot must hold what CuPy's launch passes (the arrays' addresses, the int32 sizes, the
    float32 scale's bits, the causal flag), rewritten on each call, with one block per thread."""
    import threading

    cp, counts = stand_in.cp, stand_in.counts
    q = _half(cp, 1, 32, 1, 128)
    kc, vc = _half(cp, 1, 8, 1000, 128), _half(cp, 1, 8, 1000, 128)
    out = (_half(cp, 1, 32, 1, 128), hostemu._wrap(np.zeros((1, 32, 1), np.float32)))
    ws = fgpu.Workspace()
    calls = [{}, {"scale": 0.5, "causal": True, "lengths": [700]}, {}]  # the last must not keep the second's
    # CuPy's launches first: no driver binding, so each step launches through the kernel objects
    monkeypatch.setattr(decoding, "cuda_driver", lambda purpose: (_ for _ in ()).throw(ImportError(purpose)))
    for kw in calls:
        fgpu.decode(q, kc, vc, out=out, workspace=ws, num_splits=7, **kw)
    by_cupy = [(name, [decoding.slot_value(a) for a in args]) for name, args in counts.launches]
    assert len(by_cupy) == 6 and by_cupy[2][1][3] != 0  # the given lengths: a device array's address

    fgpu._FUNCTIONS.clear()  # plan again, with the driver
    real_get = type(cp.RawModule("")).get_function

    def get_function(self, name):
        kern = real_get(self, name)
        kern.kernel = types.SimpleNamespace(ptr=(name, 13 if "mma" in name else 5))
        return kern

    monkeypatch.setattr(cp.RawModule, "get_function", get_function)
    launched: list = []
    driver = _fake_driver(launched)
    monkeypatch.setattr(decoding, "cuda_driver", lambda purpose: driver)
    bound: list = []  # threads that made the device's context current, one entry per argument block made
    monkeypatch.setattr(decoding, "_bind_context", lambda: bound.append(threading.get_ident()))
    launches_before = len(counts.launches)
    for kw in calls:
        fgpu.decode(q, kc, vc, out=out, workspace=ws, num_splits=7, **kw)
    assert len(counts.launches) == launches_before  # nothing went through CuPy's launch
    step = next(iter(decoding._steps().values()))
    assert [(name, grid, threads, stream) for name, grid, threads, stream, _, _ in launched[:2]] == [
        ("decode_mma_f16_d128", step.grid, step.threads, ("stream", 1)),  # CuPy's null stream: CU_STREAM_LEGACY
        ("decode_merge_f16_d128", (*step.merge_grid, 1, 1), decoding.MERGE_THREADS, ("stream", 1))]
    for i, ((name, values), got) in enumerate(zip(by_cupy, launched, strict=True)):
        if i == 2:  # lengths: a new device array on each call, so its address is the one thing that may differ
            assert got[5][3] != 0 and got[5][:3] + got[5][4:] == values[:3] + values[4:]
            continue
        assert (got[0], got[5]) == (name, values), f"launch {i}"
    assert launched[0][5][11] == np.float32(128 ** -0.5).view(np.uint32) and launched[2][5][11] == np.float32(
        0.5).view(np.uint32) and launched[2][5][12] == 1

    other: list = []
    thread = threading.Thread(target=lambda: other.append(fgpu.decode(q, kc, vc, out=out, workspace=ws, num_splits=7)))
    thread.start()
    thread.join()
    assert other and launched[-2][5] == launched[0][5] and launched[-2][4] != launched[0][4]  # its own block
    # each thread made the context current once per kernel, before its first block: the main thread, then the other
    assert len(bound) == 4 and bound[:2] == [threading.get_ident()] * 2 and bound[2] == bound[3] != bound[0]

    # the handles of the streams launched on are kept, but not without bound (a stream per request)
    split = step.split_launch
    _, address = split.block()
    for stream in range(1, 3 * decoding.STREAMS_KEPT):
        split.launch(address, stream)
        assert 0 < len(split._handles) <= decoding.STREAMS_KEPT
    assert launched[-1][3] == ("stream", 3 * decoding.STREAMS_KEPT - 1)

    driver.failure = 700  # what the driver returns is checked
    with pytest.raises(RuntimeError, match="through the driver failed: 700"):
        fgpu.decode(q, kc, vc, out=out, workspace=ws, num_splits=7)


def test_argument_slots_hold_what_the_kernels_read_and_refuse_anything_else():
    assert decoding.slot_value(np.float32(0.5)) == 0x3F00_0000  # a float32's bits
    assert decoding.slot_value(np.int32(-1)) & 0xFFFF_FFFF == 0xFFFF_FFFF  # an int32 of -1 in the low 4 bytes
    assert decoding.slot_value(np.int64(0)) == 0 and decoding.slot_value(7) == 7
    x = hostemu._wrap(np.zeros(4, np.float16))
    assert decoding.slot_value(x) == x.data.ptr
    for bad in (True, np.bool_(False), 0.5, np.float64(0.5), "7"):  # a Python float would be 8 bytes, not 4
        with pytest.raises(TypeError, match="an int, a float32 or an array"):
            decoding.slot_value(bad)


def test_kernels_are_cached_per_device(stand_in, monkeypatch):
    cp, counts = stand_in.cp, stand_in.counts
    q, k, v = (_half(cp, 1, 1, 16, 64) for _ in range(3))
    fgpu.attention(q, k, v)
    assert counts.functions == 1
    monkeypatch.setattr(cp.cuda.Device, "id", 1, raising=False)
    fgpu.attention(q, k, v)
    assert counts.functions == 2 and counts.modules == 1  # loaded again on the other device, compiled once


def test_workspace_grows_and_keeps_its_buffers(stand_in):
    ws = fgpu.Workspace()
    a = ws.get("x", (2, 3), np.float32)
    assert ws.get("x", (2, 3), np.float32) is a
    b = ws.get("x", (4,), np.float32)  # smaller: a view of the same buffer
    assert b.size == 4 and ws.nbytes == 24
    c = ws.get("x", (10,), np.float32)  # larger: a new buffer
    assert c.shape == (10,) and ws.nbytes == 40
    assert decoding.NULL_POINTER == 0


def test_bench_profile_brackets_one_window_call_of_the_kernel_asked_for(stand_in, monkeypatch, capsys):
    """``bench profile --window W``: the forward of a block-sparse kernel with a causal window of W keys, called once
    to warm up and once between the profiler's start and stop; anything but a forward of one of the package's
    kernels is refused."""
    from flashlab.bench import profile

    cp = stand_in.cp
    events: list = []
    cp.cuda.profiler = types.SimpleNamespace(start=lambda: events.append("start"), stop=lambda: events.append("stop"))
    monkeypatch.setattr(fgpu, "attention", lambda q, k, v, **kw: events.append((q.shape, kw)))
    assert profile.main(["--impl", "hopper_window", "--window", "256", "--d", "64", "--n", "300", "--batch", "1",
                         "--heads", "2"]) == 0
    call = ((1, 2, 300, 64), {"window": (256, 0), "kernel": "hopper_window"})
    assert events == [call, "start", call, "stop"]
    assert "profiled hopper_window shape=(1, 2, 300, 64) causal=False window=256" in capsys.readouterr().out
    for bad in (["--impl", "sdpa_flash"], ["--impl", "mma", "--pass", "decode"]):
        with pytest.raises(SystemExit, match="--window profiles the forward of a block-sparse kernel"):
            profile.main([*bad, "--window", "256", "--n", "64", "--batch", "1", "--heads", "1"])
