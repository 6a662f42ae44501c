// What rung 10 and the block-sparse kernel add to wgmma.cuh: O stored through shared memory, 16 bytes at a time.
//
// A consumer's O lies in the accumulator layout (wgmma.cuh): a thread holds 4 bytes (two columns) of each 8-column
// block of its two rows. Stored straight from there, O takes D / 4 stores of 4 bytes a thread, and each warp
// instruction fills half of every 32-byte sector it touches; with short output tiles (a few key tiles each) those
// stores fill the queue of outstanding global accesses and the consumer waits on it. Here each warp writes its 16
// rows into a staging tile of shared memory with stmatrix (the inverse of ldmatrix: registers in the accumulator
// layout in, 8 x 8 blocks of rows out), in the 128-byte swizzle so that the eight rows of a block fall in different
// banks, then reads them back as 16-byte chunks in row order and stores those: D / 16 stores of 16 bytes a thread,
// each warp instruction writing 512 contiguous bytes (two rows at d = 128, four at d = 64).

// stmatrix, four 8 x 8 blocks of 16-bit elements: lanes 8j .. 8j + 7 give the shared addresses of the 8 rows of block
// j, and register j of lane (g, t) = (lane / 4, lane % 4) holds row g, columns 2t and 2t + 1 of block j.
__device__ __forceinline__ void stsm_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}
// 16 bytes from shared memory.
__device__ __forceinline__ uint4 lds_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// 16 bytes to global memory, as one instruction: written as a plain uint4 store, the compiler split it into four
// 4-byte stores in these kernels.
__device__ __forceinline__ void stg_v4(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// A warp's 16 rows of O, rows row0 .. row0 + 15 of ob, ld elements apart (those at n or past it are not written;
// ld is D but where the rows of a head are interleaved, as the block-sparse kernel's residue classes): its accumulators
// (the 64 x D layout's rows 16 w .. 16 w + 15) times 1 / l of the row (i0 for row g, i1 for row g + 8), or zeros
// when `empty`. stage: the warp's own 16 * D * 2 bytes of shared memory, 16-byte aligned (the swizzle puts the 8 rows
// of a block in 8 different 16-byte bank groups from any such start).
template <class Ty, int D>
__device__ __forceinline__ void store_rows(const float* oacc, float i0, float i1, bool empty, u32 stage, u16* ob,
                                           int row0, int n, int lane, int ld = D) {
    __syncwarp();  // every lane has read the warp's previous rows out of the stage
    ob += (size_t)row0 * ld;
    const int j = lane >> 3, r = (lane & 7) + 8 * (j & 1);  // this lane addresses row r of block j
#pragma unroll
    for (int p = 0; p < D / 16; ++p) {  // blocks: rows 0-7 and 8-15 of chunk 2p, then of chunk 2p + 1
        u32 a[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int jj = 2 * p + h;
            a[2 * h] = empty ? 0u : Ty::pack(oacc[4 * jj] * i0, oacc[4 * jj + 1] * i0);
            a[2 * h + 1] = empty ? 0u : Ty::pack(oacc[4 * jj + 2] * i1, oacc[4 * jj + 3] * i1);
        }
        stsm_x4(stage + tile_offset<16>(r, 2 * p + (j >> 1)), a[0], a[1], a[2], a[3]);
    }
    __syncwarp();  // the blocks every lane wrote are visible to every lane
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
        const int q = 32 * i + lane, row = q / (D / 8), ch = q % (D / 8);
        const uint4 v = lds_v4(stage + tile_offset<16>(row, ch));
        if (row0 + row < n) stg_v4(ob + (row * ld + 8 * ch), v);
    }
}
