"""Hopper's warpgroup MMA on the CPU: the shared-memory layout it reads, its descriptors and its register layouts.

Chapter 11 builds S = Q K^T and O += P V from ``wgmma.mma_async`` (kernels/hopper/). The instruction takes its
shared-memory operands through a 64-bit descriptor and reads them in a swizzled layout; its accumulators and its
register operand are spread over the 128 threads of a warpgroup. This module writes those rules in NumPy, so that a
reader can build a tile's bytes, point a descriptor at them and check that the product read through the descriptor
is the product of the matrices (``product_ss``, ``product_rs``), on any machine. It follows the PTX ISA's description
of wgmma (matrix descriptor, 128-byte swizzle, the m64nNk16 register fragments); the host emulation of the kernels
(``flashlab/hostcuda/cuda_host.h``) follows the same rules in C++.

Layout (kernels/hopper/wgmma.cuh): a tile of 16-bit elements is cut into panels of 64 columns (128 bytes a row);
in a panel row r starts at byte 128 r and its 16-byte chunk c sits at chunk c ^ (r % 8). The hardware applies that
XOR to the address itself (bits 4-6 ^= bits 7-9), so a panel starts on a 1024-byte boundary.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROW_BYTES = 128  # one row of a panel: 64 16-bit elements
ATOM_BYTES = 1024  # 8 rows: the swizzle pattern repeats every 1024 bytes
SWIZZLE_128B = 1  # the descriptor's mode field (bits 62-63) for the 128-byte swizzle


def swizzle(addr: int | np.ndarray) -> int | np.ndarray:
    """The byte the hardware reads for address ``addr`` under the 128-byte swizzle: bits 4-6 ^= bits 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def tile_offset(rows: int, r: int, c: int) -> int:
    """Byte offset of 16-byte chunk ``c`` (columns 8c .. 8c+7) of row ``r`` in a swizzled tile of ``rows`` rows,
    as the kernels' ``tile_offset<ROWS>`` computes it."""
    return (c >> 3) * rows * ROW_BYTES + r * ROW_BYTES + (((c & 7) ^ (r & 7)) << 4)


def stage(tile: np.ndarray) -> np.ndarray:
    """The bytes of a (rows, cols) tile of 16-bit elements in the swizzled layout (cols a multiple of 64)."""
    rows, cols = tile.shape
    if cols % 64 or tile.dtype.itemsize != 2:
        raise ValueError(f"expected a tile of 16-bit elements with a multiple of 64 columns; got {tile.shape} "
                         f"{tile.dtype}")
    out = np.zeros(rows * cols * 2, np.uint8)
    raw = np.ascontiguousarray(tile).view(np.uint8).reshape(rows, cols // 8, 16)
    for r in range(rows):
        for c in range(cols // 8):
            off = tile_offset(rows, r, c)
            out[off:off + 16] = raw[r, c]
    return out


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """What a wgmma shared-memory descriptor says: where the operand starts and how far apart its parts are."""

    start: int  # byte address in shared memory (a multiple of 16)
    leading: int  # leading byte offset: MN-major operands, the distance between 64-column panels
    stride: int  # stride byte offset: the distance between groups of 8 rows

    def encode(self) -> int:
        """The 64-bit value the instruction takes (bits 0-13 start / 16, 16-29 leading / 16, 32-45 stride / 16,
        62-63 the swizzle mode)."""
        for name in ("start", "leading", "stride"):
            value = getattr(self, name)
            if value % 16 or not 0 <= value >> 4 < 1 << 14:
                raise ValueError(f"{name} must be a multiple of 16 below 256 KB; got {value}")
        return (self.start >> 4) | (self.leading >> 4) << 16 | (self.stride >> 4) << 32 | SWIZZLE_128B << 62

    @classmethod
    def decode(cls, value: int) -> Descriptor:
        if value >> 62 != SWIZZLE_128B:
            raise ValueError("only the 128-byte swizzle is modelled here")
        return cls((value & 0x3FFF) << 4, ((value >> 16) & 0x3FFF) << 4, ((value >> 32) & 0x3FFF) << 4)


def _element(smem: np.ndarray, addr: int, dtype) -> float:
    a = int(swizzle(addr))
    return float(smem[a:a + 2].view(dtype)[0])


def read_kmajor(smem: np.ndarray, desc: Descriptor, rows: int, dtype=np.float16) -> np.ndarray:
    """The (rows, 16) slice a K-major operand descriptor points at: row r, element k at start + (r / 8) stride
    + (r % 8) 128 + 2 k, swizzled."""
    return np.array([[_element(smem, desc.start + (r // 8) * desc.stride + (r % 8) * ROW_BYTES + 2 * k, dtype)
                      for k in range(16)] for r in range(rows)])


def read_mnmajor(smem: np.ndarray, desc: Descriptor, cols: int, dtype=np.float16) -> np.ndarray:
    """The (16, cols) slice an MN-major operand descriptor points at (B read with the transpose flag): element
    (k, c) at start + (c / 64) leading + (k / 8) stride + (k % 8) 128 + 2 (c % 64), swizzled."""
    return np.array([[_element(smem, desc.start + (c // 64) * desc.leading + (k // 8) * desc.stride
                               + (k % 8) * ROW_BYTES + 2 * (c % 64), dtype) for c in range(cols)] for k in range(16)])


def product_ss(smem: np.ndarray, a: Descriptor, b: Descriptor, n: int, dtype=np.float16) -> np.ndarray:
    """What ``wgmma.mma_async m64n{n}k16`` with both operands in shared memory computes: A (64 x 16) B^T with
    B (n x 16), both K-major, in float64."""
    return read_kmajor(smem, a, 64, dtype) @ read_kmajor(smem, b, n, dtype).T


def product_rs(a: np.ndarray, smem: np.ndarray, b: Descriptor, n: int, dtype=np.float16) -> np.ndarray:
    """The same with A (64 x 16) from registers and B (16 x n) MN-major in shared memory."""
    return np.asarray(a, np.float64) @ read_mnmajor(smem, b, n, dtype)


def accumulator_owner(row: int, col: int) -> tuple[int, int, int]:
    """(thread of the warpgroup, register index) holding element (row, col) of a 64 x N fp32 accumulator, and the
    warp: warp w holds rows 16 w .. 16 w + 15; lane 4 g + t holds rows g and g + 8, columns 8 j + 2 t and + 1 of
    every 8-column block j, in registers 4 j .. 4 j + 3. Returns (thread, register, warp)."""
    warp, r = divmod(row, 16)
    g, half = r % 8, r // 8
    j, c = divmod(col, 8)
    t, odd = divmod(c, 2)
    return 32 * warp + 4 * g + t, 4 * j + 2 * half + odd, warp


def a_fragment_owner(row: int, k: int) -> tuple[int, int, int]:
    """(thread, 32-bit register, half) holding element (row, k) of a register A operand (64 x 16): mma.sync's A
    layout in each warp's 16 rows; register 0 rows g / k 2t..2t+1, 1 rows g + 8, 2 k + 8, 3 both."""
    warp, r = divmod(row, 16)
    g, lower = r % 8, r // 8
    t, half = divmod(k % 8, 2)
    return 32 * warp + 4 * g + t, lower + 2 * (k >= 8), half
