"""Block-sparse attention on the GPU (flashlab/gpu/kernels/sparse_r9_window.cu) against the float64 reference.

``attention(..., window=(left, right), dilation=r)`` and ``attention(..., block_mask=...)`` are held to the rule of
every fp16/bf16 kernel (CONTRIBUTING.md, Correctness): the max error against float64 at most twice that of naive
attention in the same precision, masked the same way; lse too, and the rows that see no key are -inf in both.
Outputs are poisoned first, so an element the kernel forgot shows up. The same tests run on a CPU under the host
emulation (``python tools/hostemu/hostemu.py --sparse``; the last test here runs it).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_gpu_plan import gpu_like  # noqa: F401 - the simulated-GPU fixture

import flashlab.gpu as fgpu
from flashlab import blocksparse, reference

HOSTEMU = pathlib.Path(__file__).resolve().parents[1] / "tools" / "hostemu" / "hostemu.py"
HALF = ("f16", "bf16")


def _tga():
    import test_gpu_attention as tga  # the forward's test helpers: rounding, transfers, error

    return tga


# ---------------------------------------------------------------------------------------------- CPU-side checks
def test_fragment_bits_follow_the_mma_accumulator_layout(rng):
    """Thread t's word for 16-row tile mt holds, at bit (e // 2) * BC / 4 + 2 nt + e % 2, the element its
    accumulator register e of fragment nt holds: row 32 warp + 16 mt + 8 (e // 2) + lane // 4, column
    8 nt + 2 (lane % 4) + e % 2 (written out here thread by thread)."""
    for bc in (64, 32):
        masks = rng.random((3, 128, bc)) < 0.5
        words = fgpu.pack_fragment_bits(masks)
        assert words.shape == (3, 2, 128) and words.dtype == np.uint32
        for p in range(3):
            for mt in range(2):
                for t in range(128):
                    warp, lane = divmod(t, 32)
                    for nt in range(bc // 8):
                        for e in range(4):
                            row = 32 * warp + 16 * mt + 8 * (e // 2) + lane // 4
                            col = 8 * nt + 2 * (lane % 4) + e % 2
                            bit = (int(words[p, mt, t]) >> ((e // 2) * bc // 4 + 2 * nt + e % 2)) & 1
                            assert bit == masks[p, row, col], (bc, p, mt, t, nt, e)
    with pytest.raises(ValueError, match="128"):
        fgpu.pack_fragment_bits(np.zeros((1, 64, 64), bool))


def test_wgmma_bits_follow_the_wgmma_accumulator_layout(rng):
    """Thread t of consumer c finds, at bit 4 (jj % 8) + e of word jj // 8, the element its wgmma m64n128
    accumulator 4 jj + e holds: row 64 c + 16 warp + lane // 4 + 8 (e // 2), column 8 jj + 2 (lane % 4) + e % 2
    (written out here thread by thread), as hopper/sparse_h8.cu reads it."""
    masks = rng.random((2, 128, 128)) < 0.5
    words = fgpu.pack_wgmma_bits(masks)
    assert words.shape == (2, 2, 2, 128) and words.dtype == np.uint32
    for p in range(2):
        for c in range(2):
            for t in range(128):
                warp, lane = divmod(t, 32)
                for jj in range(16):
                    for e in range(4):
                        row = 64 * c + 16 * warp + lane // 4 + 8 * (e // 2)
                        col = 8 * jj + 2 * (lane % 4) + e % 2
                        bit = (int(words[p, c, jj // 8, t]) >> (4 * (jj % 8) + e)) & 1
                        assert bit == masks[p, row, col], (p, c, t, jj, e)
    with pytest.raises(ValueError, match="128, 128"):
        fgpu.pack_wgmma_bits(np.zeros((1, 128, 64), bool))


def test_plan_names_the_sparse_kernel_or_says_why_not(monkeypatch):
    h200, a100, t4 = (fgpu.KNOWN_DEVICES[name] for name in ("H200", "A100", "T4"))
    for sparse in ("window", "blocks"):
        for d in fgpu.HEAD_DIMS:
            for dt in HALF:
                plan = fgpu.plan_for("forward", h200, dtype=dt, d=d, sparse=sparse)
                assert plan.kernel == f"hopper_{sparse}" and plan.file == fgpu.HOPPER_SPARSE_FILE
                # the sm_80 kernel still runs there by name; the Hopper one nowhere else
                assert fgpu.plan_for("forward", h200, dtype=dt, d=d, sparse=sparse,
                                     kernel=f"sparse_{sparse}").file == fgpu.SPARSE_FILE
                with pytest.raises(ValueError, match="sm_90a"):
                    fgpu.plan_for("forward", a100, dtype=dt, d=d, sparse=sparse, kernel=f"hopper_{sparse}")
        with pytest.raises(ValueError, match="sm_80 or newer"):
            fgpu.plan_for("forward", t4, dtype="f16", d=64, sparse=sparse)
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            fgpu.plan_for("forward", h200, dtype="f32", d=64, sparse=sparse)
        with pytest.raises(ValueError, match="scale > 0"):
            fgpu.plan_for("forward", h200, d=64, sparse=sparse, positive_scale=False)
    for d in fgpu.HEAD_DIMS:  # nothing spills on sm_80 (SPARSE_SPILLS): the 64-key kernels run there too
        assert fgpu.plan_for("forward", a100, d=d, sparse="window").kernel == "sparse_window"
        assert fgpu.plan_for("forward", a100, d=d, sparse="blocks").kernel == "sparse_blocks"
    # Where the window kernel's 64-key tiles spill, its 32-key variant runs: the plan reads SPARSE_SPILLS.
    with monkeypatch.context() as patch:
        patch.setattr(fgpu, "SPARSE_SPILLS", {("sparse_window", 128): (80,)})
        fgpu._sparse_plan.cache_clear()
        try:
            plan = fgpu.plan_for("forward", a100, d=128, sparse="window")
            assert plan.kernel == "sparse_window_c32" and "spills registers at d = 128 on sm_80" in plan.reason
            with pytest.raises(ValueError, match="'best' would choose 'sparse_window_c32'"):
                fgpu.plan_for("forward", a100, d=128, sparse="window", kernel="sparse_window")
            assert fgpu.plan_for("forward", a100, d=64, sparse="window").kernel == "sparse_window"
            assert fgpu.plan_for("forward", h200, d=128, sparse="window").kernel == "hopper_window"
        finally:
            fgpu._sparse_plan.cache_clear()  # the plans made with the patched table
    with pytest.raises(ValueError, match="'window' or 'blocks'"):
        fgpu.plan_for("forward", h200, sparse="diagonal")
    with pytest.raises(ValueError, match="sparse_window"):
        fgpu.plan_for("forward", h200, sparse="window", kernel="addressing")
    assert fgpu.plan_for("forward", h200, sparse="window", kernel="sparse_window_c32").kernel == "sparse_window_c32"


def test_sparse_tiles_are_the_kernel_file_tiles():
    """SPARSE_TILES (what a block mask is built with) is what the kernel file compiles: BR rows, BC_* keys."""
    src = (fgpu.KERNEL_DIR / fgpu.SPARSE_FILE).read_text()
    define = {name: int(value) for name, value in re.findall(r"#define (BC_D64|BC_D128) (\d+)", src)}
    for name in ("sparse_window", "sparse_blocks"):
        assert fgpu.SPARSE_TILES[name] == {64: (128, define["BC_D64"]), 128: (128, define["BC_D128"])}, name
    c32 = fgpu.SPARSE_KERNELS["sparse_window_c32"]
    assert c32.defines == ("-DBC_D128=32",) and fgpu.SPARSE_TILES[c32.name] == {64: (128, define["BC_D64"]),
                                                                               128: (128, 32)}
    for name, rung in fgpu.SPARSE_KERNELS.items():
        for d in fgpu.HEAD_DIMS:
            bq, bk = fgpu.SPARSE_TILES[name][d]
            if rung.file == fgpu.HOPPER_SPARSE_FILE:  # two buffers of Q, the stages of K and V, alignment, barriers
                stages = fgpu.HOPPER_SPARSE_STAGES[d]
                assert rung.shared_bytes(d) >= (2 * bq + 2 * stages * bk) * d * 2 + 1024 + 128, (name, d)
            else:
                assert rung.shared_bytes(d) == (bq + 4 * bk) * d * 2, (name, d)
            assert rung.block_rows == bq, (name, d)
    hopper_src = (fgpu.KERNEL_DIR / fgpu.HOPPER_SPARSE_FILE).read_text()
    assert re.search(r"#define BR 128\b", hopper_src) and re.search(r"#define BC 128\b", hopper_src)
    stages = re.search(r"int sparse_stages\(\) \{ return D == 128 \? (\d+) : (\d+); \}", hopper_src)
    assert stages and fgpu.HOPPER_SPARSE_STAGES == {128: int(stages[1]), 64: int(stages[2])}
    assert re.search(r"8 \* \(4 \+ 4 \* (\d+)\) <= 128", hopper_src)[1] == str(max(fgpu.HOPPER_SPARSE_STAGES.values()))
    assert fgpu.SPARSE_TILES["hopper_window"] == fgpu.SPARSE_TILES["hopper_blocks"] == {64: (128, 128),
                                                                                         128: (128, 128)}


def test_benchmark_counts_pairs_and_masks_as_the_patterns_mean(rng):
    """bench sparse: the visible pairs (its FLOP) counted from the formula equal the mask's; FlexAttention's
    mask_mod, evaluated on index grids, is the same mask as the pattern of attention(window=, dilation=)."""
    from flashlab.bench import sparse

    for _ in range(40):
        n, m = (int(x) for x in rng.integers(1, 90, size=2))
        window = (rng.choice([None, int(rng.integers(0, m))]), rng.choice([None, 0, int(rng.integers(0, n))]))
        dilation = int(rng.integers(1, 6))
        pattern = sparse.pattern_of(window, dilation)
        mask = pattern.mask(n, m)
        assert sparse.visible_pairs(pattern, n, m) == int(mask.sum()), (n, m, window, dilation)
        mod = sparse.mask_mod(window[0], window[1], dilation, offset=m - n)
        np.testing.assert_array_equal(mod(0, 0, np.arange(n)[:, None], np.arange(m)[None, :]), mask)
    args = sparse.parser().parse_args([])
    assert args.n == [16384, 65536] and args.windows == [256, 512, 1024, 2048, 4096, 8192]
    assert [label for label, _, _ in sparse.patterns(args)][-1] == "dilated 4 window 8192"


def test_benchmark_table_takes_time_per_tile_against_dense_causal():
    from flashlab.bench import sparse

    base = {"n": 1024, "d": 128, "batch": 1, "heads": 1, "protocol": "throughput"}
    rows = [{**base, "impl": "causal", "pattern": "causal", "density": 0.5, "median_ms": 2.0, "tflops": 1.0},
            {**base, "impl": "flex_causal", "pattern": "causal", "density": 0.5, "median_ms": 2.5, "tflops": 1.0},
            {**base, "impl": "sparse_window", "pattern": "window 256", "density": 0.125, "median_ms": 0.6,
             "tflops": 1.0},
            {**base, "impl": "flex", "pattern": "window 256", "density": 0.125, "median_ms": 0.75, "tflops": 1.0},
            {**base, "impl": "sparse_blocks", "pattern": "window 256", "error": "out of memory"}]
    ratios = sparse.per_tile_ratios(rows)
    assert ratios[("sparse_window", "throughput", 1024, "window 256")] == pytest.approx((0.6 / 0.125) / (2.0 / 0.5))
    assert ratios[("flex", "throughput", 1024, "window 256")] == pytest.approx((0.75 / 0.125) / (2.5 / 0.5))
    table = sparse.format_rows(rows).splitlines()
    window_row = next(line for line in table if line.startswith("sparse_window"))
    # per tile vs dense causal, speed vs flex (0.75 / 0.6), and no memory floor in these rows
    assert window_row.split()[-3:] == ["1.20", "1.25", "-"]
    assert any("out of memory" in line for line in table)
    assert sparse.floor_ratios(rows) == {} and sparse.floor_over_tiles(rows) == {}
    # with the run's memory floor: each time over it, and the floor over the time proportional to the pattern's tiles
    floored = [{**r, "floor_ms": 0.4} for r in rows]
    assert sparse.floor_ratios(floored)[("sparse_window", "throughput", 1024, "window 256")] == pytest.approx(1.5)
    tiles = sparse.floor_over_tiles(floored)
    assert tiles[("throughput", 1024, "window 256")] == pytest.approx(0.4 / (2.0 / 0.5 * 0.125))  # 0.8
    assert ("throughput", 1024, "causal") in tiles and len(tiles) == 2  # flex_causal, and the window's pattern
    assert sparse.format_rows(floored).splitlines()[3].split()[-1] == "1.50"
    # a row of the residue classes is taken per tile it computes
    rows.append({**base, "impl": "hopper_window", "pattern": "window 256", "density": 0.125,
                 "computed_density": 0.05, "median_ms": 0.3, "tflops": 1.0})
    ratios = sparse.per_tile_ratios(rows)
    assert ratios[("hopper_window", "throughput", 1024, "window 256")] == pytest.approx((0.3 / 0.05) / (2.0 / 0.5))


def test_computed_density_counts_the_tiles_of_each_residue_class():
    """A dilated window as r classes: class c's mask is the pattern's mask on rows and columns c, c + r, ... (a
    plain window), tiled on its own; computed_density counts those tiles over the whole grid's."""
    from flashlab.bench import sparse

    for n, window, r in ((1536, (600, 0), 3), (2048, (None, 0), 4), (1024, (100, 40), 2), (1000, (512, 0), 3)):
        got = sparse.computed_density("hopper_window", n, window, r)
        if n % r:
            assert got is None
            continue
        mask = sparse.pattern_of(window, r).mask(n, n)
        tiles = 0
        for c in range(r):
            cls = mask[c::r, c::r]
            assert cls.sum() == mask[c::r].sum()  # a row sees only keys of its own class
            tiles += blocksparse.from_mask(cls).block_mask(n // r, n // r, *sparse.TILE).computed.sum()
        assert got == pytest.approx(tiles / (-(-n // sparse.TILE[0]) * -(-n // sparse.TILE[1])))
        assert sparse.computed_density("sparse_window", n, window, r) is None


class _FakeTorch:
    """Just enough of PyTorch for ``bench sparse``'s :class:`Flex` on a CPU, with torch.compile's rule for when a
    call recompiles: a compiled function keeps one compilation per guard key, and the key holds each tensor's shape
    and dtype (never its values), a function's code and its closure (tensors as tensors, other values as values), and
    plain values as themselves. Under ``set_stance("fail_on_recompile")`` a new key for a function compiled before
    raises. create_block_mask evaluates the mask_mod on index grids; flex_attention is masked float64 attention."""

    class Tensor(np.ndarray):
        def fill_(self, value):
            self[...] = value
            return self

    def __init__(self, monkeypatch) -> None:
        import contextlib
        import sys
        import types

        self.compiled: dict[str, set] = {}
        self.stance = "default"
        fake = self

        def zeros(shape, dtype=None, device=None):
            return np.zeros(shape, dtype=dtype).view(fake.Tensor)

        def compile(fn, dynamic=None):
            def run(*args, **kwargs):
                key = tuple(fake._guard(a) for a in (*args, *sorted(kwargs.items())))
                seen = fake.compiled.setdefault(fn.__name__, set())
                if key not in seen and seen and fake.stance == "fail_on_recompile":
                    raise RuntimeError(f"recompiling {fn.__name__}")
                seen.add(key)
                return fn(*args, **kwargs)
            return run

        @contextlib.contextmanager
        def set_stance(stance):
            before, fake.stance = fake.stance, stance
            try:
                yield
            finally:
                fake.stance = before

        def create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cuda"):
            return fake.BlockMask(np.asarray(mod(0, 0, np.arange(Q_LEN)[:, None], np.arange(KV_LEN)[None, :]), bool),
                                  mod)

        def flex_attention(q, k, v, block_mask=None):
            return reference.attention(q, k, v, mask=block_mask.dense)[0]

        torch = types.ModuleType("torch")
        torch.int32, torch.zeros, torch.compile = np.int32, zeros, compile
        torch.no_grad = contextlib.nullcontext
        torch.cuda = types.SimpleNamespace(synchronize=lambda: None)
        torch.compiler = types.SimpleNamespace(set_stance=set_stance)
        flex = types.ModuleType("torch.nn.attention.flex_attention")
        flex.create_block_mask, flex.flex_attention = create_block_mask, flex_attention
        for name, module in (("torch", torch), ("torch.nn", types.ModuleType("torch.nn")),
                             ("torch.nn.attention", types.ModuleType("torch.nn.attention")),
                             ("torch.nn.attention.flex_attention", flex)):
            monkeypatch.setitem(sys.modules, name, module)

    class BlockMask:
        def __init__(self, dense, mask_mod) -> None:
            self.dense, self.mask_mod = dense, mask_mod

        def sparsity(self) -> float:
            return 100.0 * (1 - self.dense.mean())

    def _guard(self, x):
        if isinstance(x, self.BlockMask):
            return ("BlockMask", self._guard(x.dense), self._guard(x.mask_mod))
        if isinstance(x, tuple):
            return tuple(self._guard(a) for a in x)
        if isinstance(x, np.ndarray):
            return ("tensor", x.shape, x.dtype.str)
        if callable(x) and hasattr(x, "__code__"):
            return (x.__code__, tuple(self._guard(c.cell_contents) for c in (x.__closure__ or ())))
        return x


def test_flexattention_compiles_once_per_length_and_means_each_pattern(monkeypatch, rng):
    """bench sparse's Flex: flex_attention and create_block_mask compiled once per n (torch.compile's guard rule,
    emulated), then every window and dilation served by the same compilations, each block mask the pattern's own
    mask, each output that of the pattern; a mask_mod with its window as numbers would recompile (and is refused)."""
    from flashlab.bench import sparse

    torch = _FakeTorch(monkeypatch)
    flex = sparse.Flex()
    args = sparse.parser().parse_args(["--windows", "3", "9", "--dilation", "4", "--dilated-window", "20",
                                       "--impls", "flex"])
    assert args.impls == ["flex"]
    for n in (40, 70):
        q, k, v = (rng.standard_normal((1, 1, n, 8)) for _ in range(3))
        seconds = flex.compile(q, k, v)
        assert set(seconds) == {"mask_compile_s", "compile_s"} and min(seconds.values()) >= 0
        for label, window, dilation in [("causal", (None, 0), 1), *sparse.patterns(args)]:
            pattern = sparse.pattern_of(window, dilation)
            with flex.frozen():
                bm = flex.mask(n, window, dilation)
                out = flex(q, k, v, bm)
            np.testing.assert_array_equal(bm.dense, pattern.mask(n, n), err_msg=label)
            np.testing.assert_allclose(out, reference.attention(q, k, v, mask=pattern)[0], rtol=1e-12, atol=1e-12)
    assert {name: len(keys) for name, keys in torch.compiled.items()} == {"create_block_mask": 2,
                                                                          "flex_attention": 2}
    with flex.frozen(), pytest.raises(RuntimeError, match="recompiling create_block_mask"):
        flex.make_mask(sparse.mask_mod(5, 0, 1), None, None, 70, 70, device="cuda")
    args = sparse.parser().parse_args(["--impls", "flex", "--flex-allow-recompile"])
    with sparse.Flex(args.flex_allow_recompile).frozen():  # asked to: a recompilation is let through
        flex.make_mask(sparse.mask_mod(6, 0, 1), None, None, 70, 70, device="cuda")


def test_the_make_target_runs_the_recorded_command():
    """`make bench-sparse` runs the command in data/benchmarks/sparse.json's provenance (its --out aside)."""
    from flashlab import records

    if shutil.which("make") is None:
        pytest.skip("needs make")
    root = pathlib.Path(__file__).resolve().parents[1]
    res = subprocess.run(["make", "-n", "-C", str(root), "bench-sparse"], capture_output=True, text=True, timeout=60)
    made = [line.split("-m flashlab bench ", 1)[1] for line in res.stdout.splitlines() if "-m flashlab bench" in line]
    recorded = records.read_record("benchmarks/sparse")["provenance"]["command"].split("-m flashlab bench ", 1)[1]
    recorded = re.sub(r"\s--out\s+\S+", "", recorded)
    assert made == [recorded]


def test_selfcheck_runs_each_sparse_kernel_this_gpu_runs_and_names_the_others(gpu_like, capsys):  # noqa: F811
    """``python -m flashlab selfcheck sparse`` (what ``make sanitize`` runs the sparse kernels through) on simulated
    GPUs whose launches are recorded, not run: on a T4 it launches nothing and says why for each kernel, dtype and d;
    on an A100 it launches every kernel, dtype, d and case the plan allows there (all of them: none spills) and
    fails each of them, since a kernel that never ran left its poisoned outputs unwritten."""
    from flashlab.gpu import selfcheck

    launches = gpu_like(fgpu.KNOWN_DEVICES["T4"])
    assert selfcheck.main(["sparse"]) == 0 and not launches
    out = capsys.readouterr().out
    hopper = [name for name, r in fgpu.SPARSE_KERNELS.items() if r.file == fgpu.HOPPER_SPARSE_FILE]
    assert hopper == ["hopper_window", "hopper_blocks"]
    per_kernel = 2 * len(fgpu.HEAD_DIMS)
    assert out.count("skipped: needs sm_80 or newer") == (len(fgpu.SPARSE_KERNELS) - len(hopper)) * per_kernel
    assert out.count("skipped: the Hopper kernels are built for sm_90a") == len(hopper) * per_kernel

    a100 = fgpu.KNOWN_DEVICES["A100"]
    launches = gpu_like(a100)
    expected = []
    for name in fgpu.SPARSE_KERNELS:
        if name in hopper:  # sm_90a only: said so, as on the T4
            continue
        blocks = name == "sparse_blocks"
        cases = [c for c in selfcheck.SPARSE_CASES if (c[3] == "block_mask") == blocks]
        assert len(cases) == (2 if blocks else 3)
        expected += [(fgpu.SPARSE_FILE, f"attn_{'blocks' if blocks else 'window'}_{dt}_d{d}")
                     for dt in HALF for d in fgpu.HEAD_DIMS for _ in cases
                     if fgpu.sparse_problem(name, dt, d, True, a100) is None]
    with np.errstate(invalid="ignore"):
        assert selfcheck.main(["sparse"]) == 1
    out = capsys.readouterr().out
    assert [(file, fn) for file, fn, _ in launches] == expected and len(expected) == 12 + 12 + 8
    assert out.count(" FAIL\n") == len(expected) and f"selfcheck: {len(expected)} FAILED" in out
    hopper_skips = out.count("skipped: the Hopper kernels are built for sm_90a")
    assert out.count("skipped") == hopper_skips == len(hopper) * per_kernel


@pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulation of the kernels needs g++")
def test_selfcheck_sparse_passes_under_the_host_emulation():
    """The sparse part of the selfcheck with the kernels run for real on a CPU (tools/hostemu): every kernel, both
    dtypes, both d, every case, within its bound against float64."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import hostemu; hostemu.install(real_forward=True); "
            "from flashlab.gpu import selfcheck; raise SystemExit(selfcheck.main(['sparse']))")
    res = subprocess.run([sys.executable, "-c", code, str(HOSTEMU.parent)], capture_output=True, text=True,
                         timeout=1800, cwd=HOSTEMU.parents[2])
    from flashlab.gpu import selfcheck

    lines = [line for line in res.stdout.splitlines() if line.startswith("sparse ")]
    assert res.returncode == 0 and "selfcheck: all ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    cases = {name: sum((c[3] == "block_mask") == (name in fgpu.SPARSE_MODES["blocks"]) for c in selfcheck.SPARSE_CASES)
             for name in fgpu.SPARSE_KERNELS}
    assert sum(line.endswith(" ok") for line in lines) == sum(cases.values()) * 2 * len(fgpu.HEAD_DIMS)
    # the Hopper window kernel ran a dilation as residue classes at least once per dtype and d
    assert sum(fgpu.residue_classes("hopper_window", how.get("dilation", 1), n, m) > 1
               for n, m, _, how in selfcheck.SPARSE_CASES if how != "block_mask") == 1


# ----------------------------------------------------------------------------------------------------- helpers
def _naive_masked(q, k, v, mask, scale, dt):
    """Eager attention in dtype dt with an (n, m) mask: the same-precision baseline of the 2x rule."""
    tga = _tga()
    if q.ndim == 4 and k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = tga._round(q @ np.swapaxes(k, -1, -2), dt) * np.float32(scale)
    s = np.where(mask, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    p = np.exp(s - mx)
    tot = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (mx + np.log(tot))[..., 0]
    p = tga._round(p / np.where(tot > 0, tot, 1), dt)
    return tga._round(p @ v, dt), lse


def _inputs(rng, dt, B, H, Hk, n, m, d):
    tga = _tga()
    q = tga._round(rng.standard_normal((B, H, n, d)), dt)
    k = tga._round(rng.standard_normal((B, Hk, m, d)), dt)
    v = tga._round(rng.standard_normal((B, Hk, m, d)), dt)
    return q, k, v


def _check(rng, dt, shape, pattern, *, inputs=None, nan_keys: int = 0, **call):
    """One call against float64 with ``pattern`` (a blocksparse pattern: what the call means), by the 2x rule;
    ``nan_keys``: the kernel's copy of the first keys and values holds NaN (the references see the numbers)."""
    import cupy as cp

    tga = _tga()
    B, H, Hk, n, m, d = shape
    q, k, v = inputs if inputs is not None else _inputs(rng, dt, B, H, Hk, n, m, d)
    scale = fgpu.check_scale(call.get("scale"), d)
    mask = pattern.mask(n, m)
    O_ref, L_ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), scale=scale, mask=mask)
    O_nv, L_nv = _naive_masked(q, k, v, mask, scale, dt)
    k, v = k.copy(), v.copy()
    k[..., :nan_keys, :] = v[..., :nan_keys, :] = np.nan
    qg, kg, vg = (tga._to_gpu(x, dt) for x in (q, k, v))
    o = cp.full(qg.shape, 0xFFFF if dt == "bf16" else np.nan, dtype=qg.dtype)
    lse = cp.full(qg.shape[:-1], np.nan, dtype=cp.float32)
    fgpu.attention(qg, kg, vg, bf16=dt == "bf16", out=(o, lse), **call)
    cp.cuda.Device().synchronize()
    O, L = tga._from_gpu(o, dt), lse.get().astype(np.float64)

    what = f"{dt} B={B} H={H} Hk={Hk} n={n} m={m} d={d} {({a: b for a, b in call.items() if a != 'block_mask'})}"
    assert np.isfinite(O).all(), f"unwritten or nan outputs: {what}"
    assert not np.isnan(L).any(), f"unwritten or nan lse: {what}"
    np.testing.assert_array_equal(np.isneginf(L), np.isneginf(L_ref), err_msg=f"-inf rows differ: {what}")
    assert tga._err(O, O_ref) <= 2 * tga._err(O_nv, O_ref) + 1e-6, (what, tga._err(O, O_ref), tga._err(O_nv, O_ref))
    fin = np.isfinite(L_ref)
    lerr = tga._err(L[fin], L_ref[fin])
    assert lerr <= 2 * tga._err(L_nv[fin], L_ref[fin]) + 1e-5 * max(1.0, float(np.abs(L_ref[fin]).max(initial=0))), (
        what, lerr)
    assert (O[..., ~mask.any(axis=1), :] == 0).all(), f"a row that sees no key is not 0: {what}"
    return O, L


def _length(rng, small: bool):
    """Ragged lengths: 1, a prime, below a tile, or a few tiles and a remainder."""
    return int(rng.choice([1, 7, 61, 127, int(rng.integers(2, 128)), int(rng.integers(129, 300 if small else 400))]))


# ------------------------------------------------------------------------------------------------- GPU checks
# "best": the kernel the plan runs (on Hopper the wgmma kernels); "mma": the sm_80 kernels by name, which still run
# there (and are what every other GPU runs)
FAMILIES = {"best": {}, "mma": {"window": "sparse_window", "blocks": "sparse_blocks"}}


def _named(family: str, mode: str) -> dict:
    name = FAMILIES[family].get(mode)
    return {"kernel": name} if name else {}


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dt", HALF)
def test_sliding_windows_on_ragged_shapes(rng, dt, family):
    for trial in range(6):
        d = fgpu.HEAD_DIMS[trial % 2]
        n, m = _length(rng, True), _length(rng, True)
        Hk = int(rng.integers(1, 3))
        H = Hk * int(rng.integers(1, 3))  # GQA when H > Hk
        # each side: 0, a few tokens, up to the whole sequence, or no limit
        left = [0, min(int(rng.integers(1, 40)), m - 1), m - 1, None][trial % 4]
        right = [0, None, int(rng.integers(0, n)), 0][trial % 4]
        _check(rng, dt, (1, H, Hk, n, m, d), blocksparse.sliding_window(left, right), window=(left, right),
               **_named(family, "window"))


@pytest.mark.gpu
def test_the_32_key_window_variant(rng):
    """sparse_window_c32 (what the plan would take at d = 128 where 64-key tiles spill), asked for by name."""
    for dt, (n, m, left, right, r) in zip(HALF, ((200, 170, 45, 3, 1), (130, 300, None, 0, 4)), strict=True):
        _check(rng, dt, (1, 2, 1, n, m, 128), blocksparse.dilated(r, left=left, right=right), window=(left, right),
               dilation=r, kernel="sparse_window_c32")


@pytest.mark.gpu
def test_window_edge_cases(rng):
    pattern = blocksparse.sliding_window
    # left and right 0: each query sees its own position only; n > m leaves the first n - m rows empty
    _check(rng, "f16", (1, 2, 1, 150, 37, 64), pattern(0, 0), window=(0, 0))
    # a window wider than n (but within m), n != m both ways
    _check(rng, "f16", (1, 1, 1, 50, 300, 128), pattern(200, 0), window=(200, 0))
    _check(rng, "bf16", (1, 1, 1, 300, 50, 64), pattern(49, 120), window=(49, 120))
    # causal=True cuts the right side at 0; window (None, None) is dense attention
    _check(rng, "f16", (2, 2, 2, 200, 200, 64), pattern(70, 0), window=(70, 30), causal=True)
    _check(rng, "f16", (1, 1, 1, 130, 190, 64), pattern(None, None), window=(None, None))
    # huge logits: the running max is subtracted
    q, k, v = _inputs(rng, "f16", 1, 1, 1, 140, 140, 64)
    _check(rng, "f16", (1, 1, 1, 140, 140, 64), pattern(33, 5), inputs=((q * 125).astype(np.float16), k, v),
           window=(33, 5), scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dt", HALF)
def test_dilated_windows(rng, dt, family):
    # the last: a stride wider than a tile's span of deltas leaves empty tiles inside a block's range (7 of them in
    # 128 x 128 tiles, 23 in 128 x 64), which the producer and the consumers must skip alike
    for d, (n, m, left, right, r) in zip((64, 128, 64, 128), ((200, 200, None, 0, 3), (150, 260, 90, 10, 4),
                                                              (100, 70, 69, 0, 200), (1000, 1000, 900, 0, 300)),
                                         strict=True):
        _check(rng, dt, (1, 2, 1, n, m, d), blocksparse.dilated(r, left=left, right=right), window=(left, right),
               dilation=r, **_named(family, "window"))


@pytest.mark.gpu
@pytest.mark.parametrize("dt", HALF)
def test_dilated_windows_by_residue_classes(rng, dt):
    """Where the dilation divides n and m, the Hopper window kernel runs each residue class as a plain window (row
    c + r a of a head is row a of class c): GQA, two batch entries, both d, a ragged last tile in a class, a
    window shorter than the stride within a class, n != m, causal and not, and a class of two rows."""
    cases = ((384, 384, None, 0, 3, 64), (390, 600, 90, 6, 3, 128), (400, 400, 300, 50, 4, 64),
             (400, 400, 399, 0, 200, 128), (256, 512, 100, 3, 2, 128))
    for n, m, left, right, r, d in cases:
        assert fgpu.residue_classes("hopper_window", r, n, m) == r
        _check(rng, dt, (2, 4, 2, n, m, d), blocksparse.dilated(r, left=left, right=right), window=(left, right),
               dilation=r)
    _check(rng, dt, (1, 2, 1, 300, 300, 64), blocksparse.dilated(3, left=80, right=0), window=(80, 80),
           dilation=3, causal=True)  # causal=True cuts the right side at 0


def test_residue_classes_only_where_the_dilation_divides_both_lengths():
    assert fgpu.residue_classes("hopper_window", 4, 400, 800) == 4
    assert fgpu.residue_classes("hopper_window", 4, 402, 800) == 1  # the last class would be short
    assert fgpu.residue_classes("hopper_window", 4, 400, 802) == 1
    assert fgpu.residue_classes("hopper_window", 1, 400, 800) == 1
    assert fgpu.residue_classes("sparse_window", 4, 400, 800) == 1  # the sm_80 kernel masks the dilation


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dt", HALF)
def test_block_masks_of_every_kind_of_pattern(rng, dt, family):
    for d in fgpu.HEAD_DIMS:
        n, m = _length(rng, True), _length(rng, True)
        user = rng.random((n, m)) < 0.3
        tiles = rng.random((int(np.ceil(n / 37)), int(np.ceil(m / 50)))) < 0.4
        for pattern in (blocksparse.local_global(min(17, m - 1), min(3, n - 1), sorted({0, m // 2})),
                        blocksparse.dilated(5, left=min(90, m - 1)),
                        blocksparse.from_mask(user),
                        blocksparse.from_blocks(tiles, 37, 50) & blocksparse.causal()):
            bm = pattern.block_mask(n, m, *fgpu.sparse_block(d))
            _check(rng, dt, (1, 2, 1, n, m, d), pattern, block_mask=bm, **_named(family, "blocks"))


@pytest.mark.gpu
def test_a_prepared_layout_serves_every_batch_and_head(rng):
    n, m, d = 260, 300, 128
    pattern = blocksparse.local_global(40, 0, [0, 1, 2]) & blocksparse.causal()
    layout = fgpu.sparse_layout(pattern.block_mask(n, m, *fgpu.sparse_block(d)))
    # in the tiles of the kernel it was made for (Hopper's re-blocks the mask), the same computed tiles as the
    # pattern's block mask; the last key tile (300 keys: a short one in 64- and 128-key tiles) is masked wherever
    # it is computed
    own = pattern.block_mask(n, m, layout.block_q, layout.block_k)
    assert (layout.block_q, layout.block_k) == fgpu.SPARSE_TILES[layout.kernel][d]
    counts = own.counts()
    assert layout.counts["empty"] == counts["empty"] and int(layout.row_ptr[-1]) == counts["partial"] + counts["full"]
    assert layout.counts["partial"] == counts["partial"] + int((own.kinds[:, -1] == blocksparse.FULL).sum())
    _check(rng, "bf16", (2, 4, 2, n, m, d), pattern, block_mask=layout)


@pytest.mark.gpu
def test_a_block_mask_is_laid_out_once_per_mask(rng, monkeypatch):
    import cupy as cp

    built = []
    real = fgpu.sparse_layout
    monkeypatch.setattr(fgpu, "sparse_layout", lambda bm, kernel="best": built.append(bm) or real(bm, kernel))
    q, k, v = (cp.asarray(x.astype(np.float16)) for x in _inputs(rng, "f16", 1, 1, 1, 70, 90, 64))
    first = blocksparse.sliding_window(20, 0).block_mask(70, 90, *fgpu.sparse_block(64))
    o1 = fgpu.attention(q, k, v, block_mask=first)[0].get()
    o2 = fgpu.attention(q, k, v, block_mask=first)[0].get()
    assert len(built) == 1 and (o1 == o2).all()
    other = blocksparse.sliding_window(5, 0).block_mask(70, 90, *fgpu.sparse_block(64))  # same shape, other mask
    o3 = fgpu.attention(q, k, v, block_mask=other)[0].get()
    assert len(built) == 2 and not (o3 == o1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [1, 2, 5])
def test_the_hopper_kernels_walk_several_output_tiles_per_block(rng, monkeypatch, blocks):
    """The Hopper kernels' persistent blocks with fewer blocks than output tiles (on the GPU it would be one block per
    SM): each block walks several output tiles in the order of sparse_order, dealt in a snake, so the ring's phases,
    Q's barriers and the consumers' turns carry over from tile to tile, across tiles with many computed key tiles,
    few, and none (a query block whose window holds no key), in odd last rounds that leave blocks idle."""
    from flashlab.gpu import hopper

    if fgpu.hopper_problem() is not None:
        pytest.skip(fgpu.hopper_problem())
    monkeypatch.setattr(hopper, "PERSISTENT_BLOCKS", blocks)
    # window (40, 0) with n = 420 queries on m = 150 keys: the first 270 rows see nothing (query blocks 0 and 1 have
    # no key tile), the others a growing number
    _check(rng, "f16", (2, 2, 1, 420, 150, 64), blocksparse.sliding_window(40, 0), window=(40, 0))
    _check(rng, "bf16", (1, 3, 3, 390, 390, 128), blocksparse.dilated(3, left=None, right=40), window=(None, 40),
           dilation=3)
    pattern = blocksparse.local_global(20, 5, [0, 200]) & blocksparse.causal()
    _check(rng, "f16", (2, 2, 2, 300, 333, 128), pattern,
           block_mask=pattern.block_mask(300, 333, *fgpu.sparse_block(128)))


def test_sparse_order_ranks_query_blocks_by_their_tiles():
    """The Hopper kernels take the query blocks most computed tiles first (ties in block order, so neighbours that
    share keys stay together); a window's tiles per block, counted from its formula, are its block mask's."""
    assert fgpu.sparse_order([1, 3, 2, 3, 0], 1).tolist() == [1, 3, 2, 0, 4]
    assert fgpu.sparse_order([2, 2, 2], 1).tolist() == [0, 1, 2]
    # two heads: the most tiles first across heads; ties by head, then query block (qb + 3 * head)
    assert fgpu.sparse_order([1, 3, 3], 2).tolist() == [1, 2, 4, 5, 0, 3]
    for counts, heads in (([5, 1, 5, 0, 2, 2], 3), ([0, 0], 4), ([7], 5)):
        order = fgpu.sparse_order(counts, heads)
        assert sorted(order.tolist()) == list(range(len(counts) * heads)) and order.dtype == np.int32
        assert np.all(np.diff(np.asarray(counts)[order % len(counts)]) <= 0)
    for n, m, left, right in ((1000, 1000, 256, 0), (700, 300, 50, 20), (300, 900, 10_000, 5), (130, 600, 100, 0)):
        counts = fgpu.window_tiles_per_block(n, m, left, right, 128, 128)
        bm = blocksparse.sliding_window(min(left, m - 1), min(right, n - 1)).block_mask(n, m, 128, 128)
        np.testing.assert_array_equal(counts, (bm.kinds != blocksparse.EMPTY).sum(axis=1), err_msg=str((n, m)))


@pytest.mark.gpu
def test_empty_tiles_are_never_read(rng):
    """Keys that no query's window reaches hold NaN: a kernel that loaded and computed their tiles would spread it
    (NaN times a zero probability is NaN). A block mask's empty tiles likewise."""
    import cupy as cp

    n, m, d = 130, 600, 64
    # window (100, 0): query i (position i + 470) sees keys from 370 on, so keys 0-319 are unseen: the first five
    # 64-key tiles (keys 0-319) or the first two 128-key tiles (keys 0-255) are empty, in the tiles of the kernel
    # the plan runs (a partial tile is read, its unseen keys included)
    x = cp.zeros((1, 1, n, d), cp.float16)
    y = cp.zeros((1, 1, m, d), cp.float16)
    bk = fgpu.SPARSE_TILES[fgpu.plan(x, y, y, window=(100, 0)).kernel][d][1]
    _check(rng, "f16", (1, 1, 1, n, m, d), blocksparse.sliding_window(100, 0), nan_keys=320 // bk * bk,
           window=(100, 0))
    blocks = np.ones((2, 10), bool)
    blocks[:, :5] = False
    pattern = blocksparse.from_blocks(blocks, 128, 64)
    bm = pattern.block_mask(n, m, *fgpu.sparse_block(d))
    bk = fgpu.SPARSE_TILES[fgpu.plan(x, y, y, block_mask=bm).kernel][d][1]
    _check(rng, "f16", (1, 1, 1, n, m, d), pattern, nan_keys=320 // bk * bk, block_mask=bm)


@pytest.mark.gpu
def test_bad_sparse_inputs_get_clear_errors():
    import cupy as cp

    x = cp.zeros((1, 1, 100, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="larger than the sequence"):
        fgpu.attention(x, x, x, window=(100, 0))
    with pytest.raises(ValueError, match="larger than the sequence"):
        fgpu.attention(x, x, x, window=(0, 100))
    with pytest.raises(TypeError, match="pair"):
        fgpu.attention(x, x, x, window=64)
    with pytest.raises(ValueError, match=">= 0"):
        fgpu.attention(x, x, x, window=(-1, 0))
    with pytest.raises(ValueError, match="dilation"):
        fgpu.attention(x, x, x, window=(10, 0), dilation=0)
    with pytest.raises(ValueError, match="give window"):
        fgpu.attention(x, x, x, dilation=2)
    bm = blocksparse.causal().block_mask(100, 100, *fgpu.sparse_block(64))
    with pytest.raises(ValueError, match="n = 100 queries and m = 100 keys; this call has n = 100, m = 90"):
        fgpu.attention(x, x[..., :90, :], x[..., :90, :], block_mask=bm)
    with pytest.raises(ValueError, match=r"tiles of 128 x 32; the block-sparse kernel reads tiles of 128 x 64 "
                                         r"\(d = 64 or 128\)"):
        y = cp.zeros((1, 1, 100, 128), dtype=cp.float16)
        fgpu.attention(y, y, y, block_mask=blocksparse.causal().block_mask(100, 100, 128, 32))
    with pytest.raises(ValueError, match="tiles of 64 x 64"):
        fgpu.attention(x, x, x, block_mask=blocksparse.causal().block_mask(100, 100, 64, 64))
    with pytest.raises(TypeError, match="BlockMask"):
        fgpu.attention(x, x, x, block_mask=np.ones((100, 100), bool))
    with pytest.raises(ValueError, match="not both"):
        fgpu.attention(x, x, x, window=(5, 0), block_mask=bm)
    with pytest.raises(ValueError, match="causal=True with block_mask"):
        fgpu.attention(x, x, x, causal=True, block_mask=bm)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fgpu.attention(*(cp.zeros((100, 64), cp.float32),) * 3, window=(5, 0))
    with pytest.raises(ValueError, match="scale > 0"):
        fgpu.attention(x, x, x, window=(5, 0), scale=-0.1)
    family = "hopper" if fgpu.hopper_problem() is None else "sparse"
    assert fgpu.plan(x, x, x, window=(5, 0)).kernel == f"{family}_window"
    assert fgpu.plan(x, x, x, block_mask=bm).kernel == f"{family}_blocks"
    if family == "hopper":  # a layout made for one kernel: "best" runs that kernel, another kernel is refused
        layout = fgpu.sparse_layout(bm, kernel="sparse_blocks")
        assert fgpu.plan(x, x, x, block_mask=layout).kernel == "sparse_blocks"
        with pytest.raises(ValueError, match="the layout was made for sparse_blocks; this call runs hopper_blocks"):
            fgpu.attention(x, x, x, block_mask=layout, kernel="hopper_blocks")


def test_the_recorded_benchmark_holds_together():
    """data/benchmarks/sparse.json (``python -m flashlab bench sparse``): every timed row's density, visible pairs and
    memory floor are its pattern's and its run's (recomputed here), its TFLOP/s is 4 d pairs / time, it has >= 20
    runs, every (implementation, n, pattern) was timed under both protocols, and every output agreed with the window
    kernel's (or, for dense causal, with the course's rung) before it was timed."""
    from flashlab import records
    from flashlab.bench import sparse

    rec = records.read_record("benchmarks/sparse")
    rows = [r for r in rec["rows"] if "error" not in r]
    assert rec["provenance"]["kernel_sha256_sparse"] and rows
    protocols: dict[tuple, set] = {}
    for r in rows:
        pattern = sparse.pattern_of(tuple(r["window"]), r["dilation"])
        assert r["density"] == pattern.block_mask(r["n"], r["n"], *sparse.TILE).density, r
        assert r["pairs"] == sparse.visible_pairs(pattern, r["n"], r["n"]), r
        flop = 4 * r["d"] * r["pairs"] * r["batch"] * r["heads"]
        assert r["tflops"] == pytest.approx(flop / (r["median_ms"] * 1e-3) / 1e12, rel=1e-3, abs=2e-3), r
        assert r["repeat"] >= records.MIN_REPEAT
        assert r["max_abs_diff"] <= 2e-3, r  # fp16 outputs of two summation orders: a few units of 2^-11
        protocols.setdefault((r["impl"], r["n"], r["pattern"]), set()).add(r["protocol"])
        # the memory floor: Q, K, V read and O (fp16) and the lse (fp32) written once, at the run's copy bandwidth
        assert r["io_bytes"] == r["batch"] * r["heads"] * r["n"] * (4 * 2 * r["d"] + 4), r
        assert r["floor_ms"] == pytest.approx(r["io_bytes"] / (r["copy_gbps"] * 1e9) * 1e3, rel=1e-3), r
    assert all(p == set(records.PROTOCOLS) for p in protocols.values()), protocols
    assert {n for _, n, _ in protocols} == {16384, 65536}


def _with_flex(record: dict, slower: float) -> dict:
    """The record with FlexAttention rows added as a run with it would add them: every window kernel row and dense
    causal row again as ``flex`` and ``flex_causal``, ``slower`` times the time."""
    extra = [{**r, "impl": {"sparse_window": "flex", "causal": "flex_causal"}[r["impl"]],
              "median_ms": r["median_ms"] * slower} for r in record["rows"]
             if "error" not in r and r["impl"] in ("sparse_window", "causal")]
    return {**record, "rows": record["rows"] + extra}


def test_the_plot_shows_every_implementation_the_record_timed_flexattention_as_soon_as_it_is_there():
    """viz.plot_sparse_times (chapter 3's figure of the record): a panel per protocol, one line per implementation
    and n through its windows' (density, time), dense causal as a star, the line proportional to the computed tiles
    through it, the record's GPU, date and command in the caption; FlexAttention's rows, once in the record, are
    drawn and summarised with no change anywhere (bench.sparse.summary gives the speed against it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashlab import records, viz
    from flashlab.bench import sparse

    recorded = records.read_record("benchmarks/sparse")
    bare = {**recorded, "rows": [r for r in recorded["rows"] if not r["impl"].startswith("flex")]}
    cases = [(bare, False, False), (_with_flex(bare, 1.25), True, True)]
    if len(bare["rows"]) < len(recorded["rows"]):  # the record as run, FlexAttention's own rows in it
        cases.append((recorded, True, False))
    for record, flex, synthetic in cases:
        rows = [r for r in record["rows"] if "error" not in r]
        fig = viz.plot_sparse_times(record)
        assert [ax.get_title() for ax in fig.axes] == [f"{p} protocol" for p in records.PROTOCOLS]
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert ("FlexAttention, same mask" in legend) == flex
        caption = fig.texts[-1].get_text()
        prov = record["provenance"]
        assert prov["gpu"] in caption and prov["date_utc"][:10] in caption and prov["command"] in caption
        for ax, protocol in zip(fig.axes, records.PROTOCOLS, strict=True):
            drawn = {(tuple(line.get_xdata()), tuple(line.get_ydata())) for line in ax.get_lines()}
            for impl in [i for i in viz.SPARSE_IMPLS if any(r["impl"] == i for r in rows)]:
                for n in {r["n"] for r in rows}:
                    windows = sorted((r for r in rows if r["impl"] == impl and r["n"] == n and r["dilation"] == 1
                                      and records.protocol_of(r) == protocol), key=lambda r: r["density"])
                    assert (tuple(r["density"] for r in windows), tuple(r["median_ms"] for r in windows)) in drawn
            for c in (r for r in rows if r["impl"] == "causal" and records.protocol_of(r) == protocol):
                assert ((c["density"],), (c["median_ms"],)) in drawn
                proportional = [line for line in ax.get_lines() if line.get_linestyle() == "--"
                                and line.get_xdata()[-1] == c["density"]]
                assert len(proportional) == 1
                x, y = proportional[0].get_data()
                np.testing.assert_allclose(y / x, c["median_ms"] / c["density"])
        plt.close(fig)
        lines = sparse.summary(record["rows"])
        assert len(lines) == len({(records.protocol_of(r), r["n"], r["impl"]) for r in rows
                                  if r["impl"] in sparse.IMPLS})
        against_flex = [line for line in lines if "speed / FlexAttention's" in line]
        assert len(against_flex) == (len([line for line in lines if " flex " not in line]) if flex else 0)
        if synthetic:  # the synthetic FlexAttention is 1.25 x the window kernel's time on every pattern
            assert all(line.endswith("speed / FlexAttention's: 1.25") for line in against_flex
                       if " sparse_window " in line)
    only_errors = {**bare, "rows": bare["rows"] + [{**bare["rows"][0], "impl": "flex", "error": "x"}]}
    fig = viz.plot_sparse_times(only_errors)
    assert fig.texts[-1].get_text().endswith("not timed in this record: flex")
    plt.close(fig)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulation of the kernels needs g++")
def test_the_gpu_tests_above_pass_under_the_host_emulation():
    """The kernel itself, compiled for the CPU by tools/hostemu (real index arithmetic, barriers, shuffles and
    fragment layouts; no timing, no race detection): every gpu-marked test of this file."""
    res = subprocess.run([sys.executable, str(HOSTEMU), "--sparse"], capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0 and " passed" in res.stdout and "failed" not in res.stdout, (
        res.stdout[-3000:] + res.stderr[-3000:])


def notes_numbers(rows: list[dict]) -> dict[str, str]:
    """The numbers docs/kernels.md's block-sparse section states, computed from a record of ``bench sparse``."""
    from flashlab import records
    from flashlab.bench import sparse

    ok = [r for r in rows if "error" not in r]
    ratios = sparse.per_tile_ratios(ok)
    flex = {(records.protocol_of(r), r["n"], r["pattern"]): r["median_ms"] for r in ok if r["impl"] == "flex"}

    def span(values, unit="×"):
        return f"{min(values):.2f}–{max(values):.2f}{unit}"

    def speed(prefix):
        return span([flex[(records.protocol_of(r), r["n"], r["pattern"])] / r["median_ms"] for r in ok
                     if r["impl"].startswith(prefix) and (records.protocol_of(r), r["n"], r["pattern"]) in flex])

    def tiles(impl, pattern):
        return [v for (i, _, _, pat), v in ratios.items() if i == impl and pat == pattern]

    def first_window(n, protocol):  # the smallest w from which every window is within 15 %
        windows = sorted(r["window"][0] for r in ok if r["impl"] == "hopper_blocks" and r["n"] == n
                         and r["dilation"] == 1 and records.protocol_of(r) == protocol)
        within = [ratios[("hopper_blocks", protocol, n, f"window {w}")] <= 1.15 for w in windows]
        return next(w for i, w in enumerate(windows) if all(within[i:]))

    dilated = next(r["pattern"] for r in ok if r["dilation"] > 1)
    ms = {(r["impl"], records.protocol_of(r), r["n"], r["pattern"]): r["median_ms"] for r in ok}
    causal = {(r["n"], records.protocol_of(r)): r for r in ok if r["impl"] == "causal"}
    per_sm = 16384 // 128 * 16 / 132
    tile_us = causal[(16384, "throughput")]["median_ms"] * 1e3 / (sum(range(1, 129)) * 16 / 132)
    w256 = next(r["median_ms"] for r in ok if r["impl"] == "hopper_window" and r["n"] == 16384
                and r["pattern"] == "window 256" and records.protocol_of(r) == "throughput")
    return {
        "HOPPER_FLEX": speed("hopper_"),
        "SM80_FLEX": speed("sparse_"),
        "PROPORTIONAL": (f"w = {first_window(16384, 'throughput')} at n = 16384 under the throughput protocol "
                         f"({first_window(16384, 'latency')} under the latency protocol) and from w = "
                         f"{first_window(65536, 'throughput')} at n = 65536 ({first_window(65536, 'latency')})"),
        "SMALLEST": span(tiles("hopper_window", "window 256") + tiles("hopper_blocks", "window 256")),
        "FLEX_SMALLEST": span(tiles("flex", "window 256")),
        "OVERHEAD": (f"an output tile takes {w256 * 1e3 / per_sm:.1f} µs at w = 256, n = 16384 ({w256:.3f} ms for "
                     f"{per_sm:.1f} output tiles an SM under the throughput protocol), of which its 3 key tiles at "
                     f"dense causal's rate ({tile_us:.2f} µs each) account for {3 * tile_us:.1f} µs: about "
                     f"{w256 * 1e3 / per_sm - 3 * tile_us:.1f} µs of fixed cost"),
        "BELOW_ONE": span([v for (i, _, _, pat), v in ratios.items() if i.startswith("hopper_") and v < 1]),
        "REF_64": f"{causal[(65536, 'throughput')]['tflops']:.0f}",
        "REF_16": f"{causal[(16384, 'throughput')]['tflops']:.0f}",
        "DILATED_BLOCKS": span(tiles("hopper_blocks", dilated)),
        "DILATED_WINDOW": span(tiles("hopper_window", dilated)),
        "LATENCY_EXTRA": span([ms[(i, "latency", 16384, p)] - ms[(i, "throughput", 16384, p)]
                               for (i, _, n, p) in ms if i.startswith("hopper_") and n == 16384], " ms more a call"),
        **floor_numbers(ok),
    }


def floor_numbers(ok: list[dict]) -> dict[str, str]:
    """The numbers of docs/kernels.md's bullet on the memory floor, from a record's rows (none for an older record
    without ``floor_ms``)."""
    from flashlab.bench import sparse

    if not all(r.get("floor_ms") for r in ok):
        return {}
    over_tiles, over_floor = sparse.floor_over_tiles(ok), sparse.floor_ratios(ok)
    run = {r["n"]: r for r in ok}

    def span(values, unit="×"):
        return f"{min(values):.2f}–{max(values):.2f}{unit}"

    def kernels(w, prefix):
        return [v for (i, _, _, pat), v in over_floor.items() if i.startswith(prefix) and pat == f"window {w}"]

    return {
        "COPY": f"{run[16384]['copy_gbps']:.0f} GB/s at n = 16384 and {run[65536]['copy_gbps']:.0f} GB/s at",
        "BYTES": f"{run[16384]['io_bytes'] / 1e6:.0f} MB and {run[65536]['io_bytes'] / 1e6:.0f} MB",
        "FLOOR": f"less than {run[16384]['floor_ms']:.3f} ms and {run[65536]['floor_ms']:.3f} ms",
        "FLOOR_256": f"At w = 256 that floor is {span([v for k, v in over_tiles.items() if k[2] == 'window 256'])} the",
        "HOPPER_256": f"run at {span(kernels(256, 'hopper_'))} the floor there (`hopper_window` at "
                      f"{span(kernels(256, 'hopper_window'))})",
        "FLOOR_512": f"At w = 512 the floor is {span([v for k, v in over_tiles.items() if k[2] == 'window 512'])} the",
        "HOPPER_512": f"kernels take {span(kernels(512, 'hopper_'))} it",
        "COPIES": (f"that copy was short ({q_bytes(run[16384]) / 1e6:.0f} MB), and at the bandwidth of the "
                   f"{q_bytes(run[65536]) / 1e6:.0f} MB copy"),
    }


def q_bytes(row: dict) -> int:
    """Bytes of Q in a sparse record's run: what its copy moved to measure the bandwidth."""
    return row["batch"] * row["heads"] * row["n"] * row["d"] * 2


def test_the_notes_state_the_recorded_block_sparse_run():
    """docs/kernels.md's block-sparse section: both tables are the record as bench.sparse.markdown_table prints it,
    the command is the record's, and every number of its statements is the record's (notes_numbers)."""
    from flashlab import records
    from flashlab.bench import sparse

    rec = records.read_record("benchmarks/sparse")
    notes = " ".join((fgpu.KERNEL_DIR.parents[2] / "docs" / "kernels.md").read_text().split())
    for n in (65536, 16384):
        assert " ".join(sparse.markdown_table(rec["rows"], n).split()) in notes, n
    assert rec["provenance"]["command"] in notes
    for key, value in notes_numbers(rec["rows"]).items():
        assert value.lower() in notes.lower(), (key, value)
    # what the statements say in words, checked against the record
    ok = [r for r in rec["rows"] if "error" not in r]
    flex = {(records.protocol_of(r), r["n"], r["pattern"]): r["median_ms"] for r in ok if r["impl"] == "flex"}
    assert all(flex[(records.protocol_of(r), r["n"], r["pattern"])] > r["median_ms"] for r in ok
               if r["impl"].startswith("hopper_"))  # "faster on every pattern, n and protocol"
    # the sm_80 kernels against FlexAttention: where they lose, by protocol, and that they win everywhere else
    sm80 = {(r["impl"], records.protocol_of(r), r["n"], r["pattern"]): r["median_ms"] for r in ok
            if r["impl"].startswith("sparse_")}
    loses = {key for key, ms in sm80.items() if flex[key[1:]] < ms}
    expected = {(impl, p, n, pat) for impl, p, n, pat in sm80 if pat.startswith("window ") and (
        (p == "throughput" and (int(pat.split()[1]) >= 2048
                                or (impl == "sparse_window" and n == 65536 and pat == "window 1024")))
        or (p == "latency" and int(pat.split()[1]) in ((2048, 4096) if n == 65536 else (4096, 8192))))}
    assert loses == expected
    # chapter 3's reading of the plot: from w = 2048 (1024 at n = 65536) the Hopper kernels lie on the line (within
    # the 15 % of the notes), not at w = 1024 and n = 16384, at w = 256 above it and FlexAttention further above; on
    # the dilated pattern the window kernel sits on it at the smaller density of its residue classes and the list
    # kernel stays near it
    ratios = sparse.per_tile_ratios(ok)
    hopper = {key: v for key, v in ratios.items() if key[0].startswith("hopper_")}
    on_line = {16384: 2048, 65536: 1024}
    assert all(v <= 1.15 for (_, _, n, pat), v in hopper.items()
               if pat.startswith("window ") and int(pat.split()[1]) >= on_line[n])
    assert any(v > 1.15 for (_, _, n, pat), v in hopper.items() if pat == "window 1024" and n == 16384)
    assert all(1.0 < v < ratios[("flex", p, n, pat)] for (_, p, n, pat), v in hopper.items() if pat == "window 256")
    assert all(v > 1.15 for (_, _, _, pat), v in hopper.items() if pat == "window 256")  # "not met at w = 256"
    dilated_rows = [r for r in ok if r["impl"] == "hopper_window" and r["dilation"] > 1]
    assert dilated_rows and all(r["computed_density"] < 0.3 * r["density"] for r in dilated_rows)  # "a quarter"
    assert all(v <= (1.15 if impl == "hopper_window" else 1.25) for (impl, _, _, pat), v in hopper.items()
               if pat.startswith("dilated"))
    # the memory floor's reading: at w = 256 the floor is about the tile-proportional time, at one cell above the 15 %
    # ("the traffic alone exceeds the 15 %"), at w = 512 well below it ("not the traffic")
    floors = sparse.floor_over_tiles(ok)
    assert floors[("throughput", 16384, "window 256")] > 1.15
    assert all(0.95 < v for (_, _, pat), v in floors.items() if pat == "window 256")
    assert all(v < 0.8 for (_, _, pat), v in floors.items() if pat == "window 512")
    cells = json.loads(next((fgpu.KERNEL_DIR.parents[2] / "notebooks").glob("03_*.ipynb")).read_text())["cells"]
    lesson = " ".join("".join(next(c for c in cells if c.get("id") == "sparse-gpu-lesson")["source"]).split())
    assert ("From windows of 2048 keys on (1024 at $n = 65\\,536$), the Hopper kernels' points lie on the dashed "
            "line, within 15 %") in lesson
    model = rec["provenance"]["gpu"].split()[1]  # "NVIDIA H100 80GB HBM3" -> "H100"
    assert f"here on the same {model}" in lesson
    measured = "".join(next(c for c in cells if c.get("id") == "sparse-gpu-measured-text")["source"])
    assert measured.startswith(f"**Measured on an {model}**")


def test_the_notes_read_the_narrow_window_profile():
    """docs/kernels.md's reading of data/raw/ncu/ncu_sparse_window.txt (make profile-sparse): each kernel's DRAM and SM
    throughput as Nsight Compute printed them, neither saturated at the narrow windows, and the issue rate alike."""
    import re

    from flashlab import records
    from flashlab.bench import profile

    def width(profiled: str):  # the window of a "profiled ..." line, "causal" for dense causal
        window = re.search(r"window=(\d+)", profiled)
        return int(window[1]) if window else "causal"

    text = (records.DATA_DIR / "raw" / "ncu" / "ncu_sparse_window.txt").read_text()
    notes = " ".join((fgpu.KERNEL_DIR.parents[2] / "docs" / "kernels.md").read_text().split())
    got = {}
    for part in re.split(r"^profiled ", text, flags=re.M)[1:]:
        values = {name: float(re.search(rf"^\s+{re.escape(name)}\s+(?:[^\d\s]\S*\s+)?([\d.]+)\s*$", part, re.M)[1])
                  for name in ("DRAM Throughput", "Compute (SM) Throughput", "Issued Warp Per Scheduler")}
        got[width(part.splitlines()[0])] = values
    assert set(got) == {"causal", 256, 512, 2048}
    pct = {k: (round(v["DRAM Throughput"]), round(v["Compute (SM) Throughput"])) for k, v in got.items()}
    assert (f"keeps DRAM {pct[256][0]} % busy and the SMs {pct[256][1]} % at w = 256, {pct[512][0]} % and "
            f"{pct[512][1]} % at w = 512, {pct[2048][0]} % and {pct[2048][1]} % at w = 2048, against "
            f"{pct['causal'][0]} % and {pct['causal'][1]} % for dense causal") in notes
    assert all(d < 60 and sm < 75 for d, sm in pct.values())  # "neither memory nor the SMs saturated"
    # the stall counters of the same target: as many stall cycles per instruction, more of them on the long scoreboard
    stalls = {width(proc["profiled"]): proc["metrics"]
              for proc in records.read_record("ncu/stalls_sparse_window")["processes"]}
    assert set(stalls) == set(got)
    cycles = [profile.stall_cycles(m) for m in stalls.values()]
    assert f"at every width ({min(cycles):.1f}–{max(cycles):.1f})" in notes
    lsb = {k: m[profile.STALL.format("long_scoreboard")] for k, m in stalls.items()}
    tensor = {k: round(m["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"])
              for k, m in stalls.items()}
    assert lsb[256] > lsb[512] > lsb[2048]
    assert (f"grow from {lsb[2048]:.2f} cycles per instruction at w = 2048 and for dense causal to {lsb[512]:.2f} at "
            f"w = 512 and {lsb[256]:.2f} at w = 256, while the tensor pipe is busy {tensor[2048]} %, {tensor[512]} % "
            f"and {tensor[256]} % of the time ({tensor['causal']} % for dense causal;") in notes
    assert abs(lsb["causal"] - lsb[2048]) < 0.01
    assert all(abs(v["Issued Warp Per Scheduler"] - 0.43) < 0.03 for v in got.values())  # "about 0.43 ... in all four"
