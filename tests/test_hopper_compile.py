"""The Hopper kernels (kernels/hopper/) compile with nvcc for sm_90a without spills, and ptxas inserts no
waits of its own into the attention rungs (note C7519: registers a wgmma reads were written while another ran).
No GPU needed; the GPU checks are tests/test_gpu_hopper.py."""

from __future__ import annotations

import pathlib
import re
import shutil

import numpy as np
import pytest

import flashlab.gpu as fgpu
from flashlab.gpu import backward, hopper

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not installed")
FILES = sorted("hopper/" + p.name for p in hopper.HOPPER_DIR.glob("*.cu"))


def test_every_hopper_file_is_known():
    rungs = {r.file for r in fgpu.HOPPER_RUNGS.values()}
    assert set(FILES) == rungs | {"hopper/peak_wgmma.cu", fgpu.HOPPER_SPARSE_FILE, *backward.HOPPER_FILES}


def test_the_launchers_sets_follow_the_kernels_sources():
    """The sets the launcher derives from the order of the ladder (each rung keeps what the rungs before it added)
    agree with what each file does: tensor maps where it calls tma_load_3d, the persistent launch (the batch size as
    an argument) where its kernels take it, a workspace and counters after it where they cut tiles (stream-K), the
    384-thread register cap where its blocks have 384 threads."""
    text = {f: (fgpu.KERNEL_DIR / f).read_text() for f in FILES if f not in backward.HOPPER_FILES}  # the forward's
    assert hopper.TMA_FILES == {f for f, t in text.items() if "tma_load_3d(" in t}
    assert hopper.PERSISTENT_FILES == {f for f, t in text.items() if re.search(r"\bint B\b", t)}
    assert hopper.STREAM_K_FILES == {f for f, t in text.items() if "int B, float* ws, int* cnt) {" in t}
    assert set(fgpu.REGISTER_CAPS) == {f for f, t in text.items() if "#define NTHREADS 384" in t}
    assert set(hopper.KEY_TILE_OF) == {f for f, t in text.items() if "#define BC 128" in t}


@needs_nvcc
def test_the_sparse_kernel_has_every_entry_point_and_no_compiler_inserted_waits():
    names = {k["kernel"] for k in hopper.compile_report(fgpu.HOPPER_SPARSE_FILE)}
    assert names == {f"attn_{mode}_{dt}_d{d}" for mode in ("window", "blocks") for dt in ("f16", "bf16")
                     for d in fgpu.HEAD_DIMS}
    assert hopper.compiler_notes(fgpu.HOPPER_SPARSE_FILE) == []


@needs_nvcc
@pytest.mark.parametrize("file", FILES)
def test_compiles_for_sm90a_without_spills(file):
    report = hopper.compile_report(file)
    assert report, f"no kernels reported for {file}"
    for k in report:
        print(file, k)
        assert k["spill_store_bytes"] == k["spill_load_bytes"] == k["stack_bytes"] == 0, (file, k)
        # three 128-thread blocks per SM at d = 64 (rungs H1, H2); the plan's cap for the larger blocks (H3); the
        # backward's one 256-thread block per SM may use all 255
        cap = 255 if file in backward.HOPPER_FILES else fgpu.REGISTER_CAPS.get(file, 168)
        assert k["registers"] <= cap, (file, k)


@needs_nvcc
@pytest.mark.parametrize("kernel", [k for k, mk in backward.MAIN_KERNELS.items() if mk.hopper])
def test_the_backward_has_every_entry_point_and_no_compiler_inserted_waits(kernel):
    """No C7519 note: ptxas found no register that a running wgmma reads (P^T, dS^T) written before its wait."""
    mk = backward.MAIN_KERNELS[kernel]
    names = {k["kernel"] for k in hopper.compile_report(mk.file)}
    stems = (mk.stem, "bwd_dq_tiles") if mk.dq_tiles else (mk.stem,)  # and the kernel that reads its dQ tiles
    assert names == {f"{stem}_{dt}_d{d}" for stem in stems for dt in ("f16", "bf16") for d in fgpu.HEAD_DIMS}
    assert hopper.compiler_notes(mk.file) == []


@needs_nvcc
@pytest.mark.parametrize("rung", list(fgpu.HOPPER_RUNGS))
def test_rungs_have_every_entry_point_and_no_compiler_inserted_waits(rung):
    r = fgpu.HOPPER_RUNGS[rung]
    names = {k["kernel"] for k in hopper.compile_report(r.file)}
    names_of = {f"attn_fwd_{dt}_d{d}" for dt in r.dtypes for d in fgpu.HEAD_DIMS}
    if r.file in hopper.STREAM_K_FILES:  # and the kernels with the stream-K deal, for calls without a mask
        names_of |= {f"{name}_nomask" for name in names_of}
    assert names == names_of
    assert hopper.compiler_notes(r.file) == []


def _text_sections(cubin: bytes) -> dict[str, bytes]:
    """The machine code of each kernel in an ELF cubin: its .text.NAME sections, read from the section headers."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = headers[names_at][4]
    out = {}
    for h in headers:
        name = cubin[strtab + h[0]:cubin.index(b"\0", strtab + h[0])].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = cubin[h[4]:h[4] + h[5]]
    return out


@needs_nvcc
def test_the_stream_k_rung_s_causal_kernels_are_rung_11_s_code(tmp_path):
    """Chapter 11, section 15: H12's kernels for causal calls are H11's machine code but for a few instructions (10 of
    3,528 at d = 128 with nvcc 13.0), at the same length: the chapter reads its causal rows as a control."""
    import subprocess

    code = {}
    for f in ("hopper/h11_staged_store.cu", "hopper/h12_stream_k.cu"):
        out = tmp_path / (pathlib.Path(f).stem + ".cubin")
        subprocess.run([shutil.which("nvcc"), "-cubin", hopper.NVCC_ARCH, "--std=c++17", "-o", str(out),
                        str(fgpu.KERNEL_DIR / f)], check=True, capture_output=True, timeout=300)
        code[f] = _text_sections(out.read_bytes())
    h11, h12 = code.values()
    release = subprocess.run([shutil.which("nvcc"), "--version"], capture_output=True, text=True).stdout
    assert set(h12) == set(h11) | {f"{name}_nomask" for name in h11}
    for name in h11:
        assert len(h12[name]) == len(h11[name]), name
        differ = sum(h11[name][i:i + 16] != h12[name][i:i + 16] for i in range(0, len(h11[name]), 16))
        if name == "attn_fwd_f16_d128" and "release 13.0," in release:  # the compiler the chapter's count is of
            assert (differ, len(h11[name]) // 16) == (10, 3528)
        assert differ <= 16, (name, differ)


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _nvrtc_available(), reason="CuPy's NVRTC (cupy and libnvrtc) not installed")
@pytest.mark.parametrize("file", FILES)
def test_the_runtime_build_path_compiles_them(file):
    """What ``attention`` runs on an H200: NVRTC through CuPy, headers passed in memory (needs no GPU)."""
    code = hopper.cubin(file)
    assert code[:4] == b"\x7fELF"


@needs_nvcc
def test_plain_sm90_cannot_build_them():
    # Why the Hopper files take their own path (flashlab.gpu.hopper): the plain target rejects wgmma.
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", f"{tmp}/k.cubin",
                              str(fgpu.KERNEL_DIR / "hopper/h1_wgmma.cu")], capture_output=True, text=True)
    assert res.returncode != 0 and "wgmma" in (res.stderr + res.stdout)


def test_plan_refuses_them_off_hopper():
    lim = fgpu.KNOWN_DEVICES["A100"]
    problem = fgpu.forward_problem(fgpu.HOPPER_RUNGS["wgmma"], "f16", 64, True, lim)
    assert problem and "sm_90a" in problem and "sm_80" in problem
    lim90 = fgpu.KNOWN_DEVICES["H200"]
    assert fgpu.forward_problem(fgpu.HOPPER_RUNGS["wgmma"], "bf16", 128, True, lim90) is None
    assert "f32" in fgpu.forward_problem(fgpu.HOPPER_RUNGS["wgmma"], "f32", 64, True, lim90)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulation of the kernels needs g++")
def test_the_gpu_tests_pass_under_the_host_emulation():
    """The Hopper kernels compiled for the CPU by tools/hostemu, with wgmma emulated from the PTX ISA's layouts:
    every gpu-marked test of tests/test_gpu_hopper.py. This checks the kernels' own logic (tiles, masks, the
    online softmax, P handed to the second product in registers, the descriptors they build); whether the
    hardware reads those layouts the same way only an H100 or H200 can say."""
    import subprocess
    import sys

    hostemu = fgpu.KERNEL_DIR.parents[2] / "tools" / "hostemu" / "hostemu.py"
    res = subprocess.run([sys.executable, str(hostemu), "--hopper"], capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0 and " passed" in res.stdout and "failed" not in res.stdout, (
        res.stdout[-3000:] + res.stderr[-3000:])


@pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulation of the kernels needs g++")
@pytest.mark.parametrize("rung", list(fgpu.HOPPER_RUNGS))
def test_emulated_attention_matches_float64(rng, rung):
    import numpy as np

    from flashlab import reference

    q = rng.standard_normal((1, 2, 70, 64)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 150, 64)).astype(np.float16) for _ in range(2))
    o, lse = hopper.emulated_attention(q, k, v, causal=True, rung=rung)
    O, L = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    assert np.abs(o.astype(np.float64) - O).max() < 3e-3
    assert np.abs(lse - L).max() < 1e-4
    with pytest.raises(TypeError, match="float16"):
        hopper.emulated_attention(q.astype(np.float32), k, v)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the host emulation of the kernels needs g++")
@pytest.mark.parametrize("kernel", [name for name, mk in backward.MAIN_KERNELS.items() if mk.hopper])
def test_emulated_backward_matches_float64(rng, kernel):
    """What chapter 11's backward section runs without a Hopper GPU: the kernel's three launches under the host
    emulation, against float64 gradients (GQA, causal with n < m, ragged tiles, two batch entries: four K/V heads
    of two key blocks each, which wgmma_balanced numbers in its own order)."""
    import numpy as np

    from flashlab import reference

    q = rng.standard_normal((2, 4, 70, 64)).astype(np.float16)
    k, v = (rng.standard_normal((2, 2, 150, 64)).astype(np.float16) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float16)
    o, lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    got = hopper.emulated_backward(q, k, v, o.astype(np.float16), lse, do, causal=True, kernel=kernel)
    want = reference.attention_backward(*(x.astype(np.float64) for x in (q, k, v, do)), causal=True)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == np.float16 and g.shape == w.shape, name
        assert np.abs(g.astype(np.float64) - w).max() < 2e-3 * np.abs(w).max(), name
    with pytest.raises(ValueError, match="kernel must be one of"):
        hopper.emulated_backward(q, k, v, o, lse, do, kernel="pipe")
    with pytest.raises(ValueError, match="lse must have shape"):
        hopper.emulated_backward(q, k, v, o.astype(np.float16), lse[..., :-1], do, kernel=kernel)


def test_residue_class_maps_are_packed_layouts_of_the_same_memory():
    """The 4-D map of the residue classes (column, class, position, head) is an ordinary packed layout, as the
    driver's cuTensorMapEncodeTiled describes strides (each one the previous times its size), and it addresses row
    c + r a of each head; the 3-D map is unchanged. No GPU: the layout and the emulation's words."""
    from flashlab.gpu import hopper

    d, rows, heads, r = 64, 300, 6, 3
    sizes, strides, box = hopper._layout(d, rows, heads, r, 128)
    assert sizes == (d, r, rows // r, heads) and box == (hopper.PANEL, 1, 128, 1)
    byte_strides = (2, *strides)  # of every dimension, the first's being the element's size
    assert all(byte_strides[i + 1] == byte_strides[i] * sizes[i] for i in range(len(strides)))
    for c, a, h in ((0, 0, 0), (2, 99, 5), (1, 37, 3)):
        assert c * strides[0] + a * strides[1] + h * strides[2] == ((h * rows) + c + r * a) * d * 2
    assert hopper._layout(d, rows, heads, 1, 64) == ((d, rows, heads), (2 * d, 2 * d * rows), (hopper.PANEL, 64, 1))
    words = np.frombuffer(hopper.host_tensor_map(4096, d, rows, heads, "f16", 128, r), dtype=np.uint64)
    assert list(words[:10]) == [4096, d, rows // r, heads, strides[1], strides[2], hopper.PANEL, 128, r, strides[0]]
