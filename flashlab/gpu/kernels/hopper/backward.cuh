// What the Hopper backward kernels (bwd_h*.cu) add to wgmma.cuh, which must be included before this file.

// d (64 x N) = A B (+ d): A (64 x 16) and B (16 x N) both MN-major in shared memory (both transpose flags set):
// A is read from a [k][64] tile (dS^T: a row per key), B from a [k][N] tile (K: a row per key).
template <int N>
struct WgmmaT;

template <>
struct WgmmaT<32> {
    template <bool BF16>
    static __device__ __forceinline__ void ss(float* d, u64 da, u64 db, int scale_d) {
        if (BF16) {
            asm volatile(
                "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n}\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                : "l"(da), "l"(db), "r"(scale_d));
        } else {
            asm volatile(
                "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n}\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                : "l"(da), "l"(db), "r"(scale_d));
        }
    }
};

template <>
struct WgmmaT<64> {
    template <bool BF16>
    static __device__ __forceinline__ void ss(float* d, u64 da, u64 db, int scale_d) {
        if (BF16) {
            asm volatile(
                "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                : "l"(da), "l"(db), "r"(scale_d));
        } else {
            asm volatile(
                "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                : "l"(da), "l"(db), "r"(scale_d));
        }
    }
};

// Two neighbouring fp32 values added into global memory by one reduction (sm_90): half the instructions of two
// atomicAdd, and no value comes back.
__device__ __forceinline__ void red_add_v2(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}

// Keeps registers that a running wgmma reads (its A operand) from being reused before the wait that ends it.
template <int NREG>
__device__ __forceinline__ void hold(const u32* r) {
#pragma unroll
    for (int i = 0; i < NREG; ++i) asm volatile("" ::"r"(r[i]) : "memory");
}

// The copy engine (TMA) adds `bytes` (a multiple of 16) of fp32 values from shared memory into global memory (both
// 16-byte aligned), as one bulk operation of the issuing thread; commit closes the thread's group of them.
__device__ __forceinline__ void bulk_reduce_add(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most N of this thread's groups are still reading shared memory (.read: their sources may be
// written again) or, for bulk_wait, still running at all.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// The last kernel of the bulk-dQ kernels (bwd_h3, bwd_h4; BR query rows a tile): dQ = scale dQ_acc, rounded.
// Thread p reads the p-th 16 bytes of the tiled buffer (consecutive threads, consecutive bytes), the main kernel's
// accumulator block j of thread i of warpgroup w in tile T, and writes its four values where they belong: rows
// 16 warp + g and + 8 of the tile, columns w D / 2 + 8 j + 2 t and + 1.
template <class Ty, int D, int BR>
__device__ void bwd_dq_tiles(const float* __restrict__ acc, u16* __restrict__ dq, float scale, int n,
                             long long blocks) {
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= blocks) return;
    constexpr int NQ = D / 2;
    const int i = (int)(p % 128), j = (int)(p / 128 % (NQ / 8)), w = (int)(p / (128 * (NQ / 8)) % 2);
    const long long tile = p / (128 * (NQ / 8) * 2);  // (b H + h) ntiles + q0 / BR
    const int ntiles = (n + BR - 1) / BR;
    const long long bh = tile / ntiles;
    const int r = (int)(tile % ntiles) * BR + 16 * (i / 32) + (i % 32) / 4, c = w * NQ + 8 * j + 2 * (i % 4);
    const float4 x = *(const float4*)(acc + 4 * p);
    if (r < n) *(u32*)(dq + (bh * n + r) * D + c) = Ty::pack(scale * x.x, scale * x.y);
    if (r + 8 < n) *(u32*)(dq + (bh * n + r + 8) * D + c) = Ty::pack(scale * x.z, scale * x.w);
}
