// The tensor-core ceiling of wgmma on Hopper, and the two forms of wgmma the attention kernels use, checked.
//
// wgmma_peak_*: each warpgroup issues wgmma m64n256k16 after wgmma (fp16 or bf16 inputs, fp32 accumulators)
// with both operands in shared memory, four per batch, keeping up to two batches in flight. No global memory is
// touched in the loop; the accumulators are summed and stored once at the end so that the work stays.
// FLOP per wgmma: 2 * 64 * 256 * 16 = 524288. Grid: any number of blocks of 128 threads (one warpgroup);
// dynamic shared memory PEAK_SMEM bytes.
//
// wgmma_check_ss_*_k{K}_n{N}: C (64 x N, fp32) = A (64 x K) B^T with B (N x K): both operands K-major in shared
// memory -- S = Q K^T of the attention kernels (K = d).
// wgmma_check_rs_*_k{K}_n{N}: C (64 x N) = A (64 x K) B with B (K x N): A from registers, B MN-major in shared
// memory -- O += P V (K = keys of a tile, N = d).
// Inputs row-major 16-bit, C row-major fp32. One block of 128 threads; dynamic shared memory
// (64 + N) * K * 2 + 1024 bytes.
#include "wgmma.cuh"

#define PEAK_N 256
#define PEAK_SMEM ((64 + PEAK_N) * 64 * 2 + 1024)

__device__ __forceinline__ u32 hash(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

template <bool BF16>
__device__ void peak(float* out, int iters, u32 seed) {
    extern __shared__ __align__(16) unsigned char raw[];
    const u32 base = (smem_u32(raw) + 1023) & ~1023u;
    unsigned char* gen = raw + (base - smem_u32(raw));
    // A (64 x 64) and B (256 x 64) with values in [0.5, 1): their layout does not matter to the rate.
    for (int i = threadIdx.x; i < (64 + PEAK_N) * 64; i += blockDim.x) {
        const u32 h = hash(seed + i);
        ((u16*)gen)[i] = BF16 ? (u16)(0x3f00u | (h & 0x7fu)) : (u16)(0x3800u | (h & 0x3ffu));
    }
    fence_to_tensor_cores();
    __syncthreads();
    float d[PEAK_N / 2];
#pragma unroll
    for (int i = 0; i < PEAK_N / 2; ++i) d[i] = 0.f;
    const u64 da = descriptor(base, 16, 1024), db = descriptor(base + 64 * 128, 16, 1024);
    pin<PEAK_N / 2>(d);
    for (int it = 0; it < iters; ++it) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wgmma<PEAK_N>::template ss<BF16>(d, da + 2 * kk, db + 2 * kk, 1);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    pin<PEAK_N / 2>(d);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PEAK_N / 2; ++i) s += d[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(128) wgmma_peak_f16(float* out, int iters, unsigned seed) {
    peak<false>(out, iters, seed);
}
extern "C" __global__ void __launch_bounds__(128) wgmma_peak_bf16(float* out, int iters, unsigned seed) {
    peak<true>(out, iters, seed);
}

// Copy a row-major [ROWS][COLS] tile of 16-bit elements into the swizzled layout at dst (plain loads and stores).
template <int ROWS, int COLS>
__device__ void stage(unsigned char* dst, const u16* src) {
    for (int e = threadIdx.x; e < ROWS * COLS / 8; e += blockDim.x) {
        const int r = e / (COLS / 8), c = e % (COLS / 8);
        *(uint4*)(dst + tile_offset<ROWS>(r, c)) = *(const uint4*)(src + r * COLS + c * 8);
    }
}

template <int N>
__device__ void store_acc(float* c, const float* d) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        c[(16 * w + g) * N + 8 * j + 2 * t] = d[4 * j];
        c[(16 * w + g) * N + 8 * j + 2 * t + 1] = d[4 * j + 1];
        c[(16 * w + g + 8) * N + 8 * j + 2 * t] = d[4 * j + 2];
        c[(16 * w + g + 8) * N + 8 * j + 2 * t + 1] = d[4 * j + 3];
    }
}

template <bool BF16, int K, int N>
__device__ void check_ss(const u16* a, const u16* b, float* c) {
    extern __shared__ __align__(16) unsigned char raw[];
    const u32 base = (smem_u32(raw) + 1023) & ~1023u;
    unsigned char* at = raw + (base - smem_u32(raw));  // the same place as a generic pointer
    const u32 as = base, bs = base + 64 * K * 2;
    stage<64, K>(at, a);
    stage<N, K>(at + 64 * K * 2, b);
    fence_to_tensor_cores();
    __syncthreads();
    float d[N / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        // k16 step kk: panel kk / 4, 32 bytes per step inside the panel's 128-byte rows
        const u32 off_a = (kk / 4) * 64 * 128 + (kk % 4) * 32, off_b = (kk / 4) * N * 128 + (kk % 4) * 32;
        Wgmma<N>::template ss<BF16>(d, descriptor(as + off_a, 16, 1024), descriptor(bs + off_b, 16, 1024), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin<N / 2>(d);
    store_acc<N>(c, d);
}

template <bool BF16, int K, int N>
__device__ void check_rs(const u16* a, const u16* b, float* c) {
    extern __shared__ __align__(16) unsigned char raw[];
    const u32 base = (smem_u32(raw) + 1023) & ~1023u;
    stage<K, N>(raw + (base - smem_u32(raw)), b);  // B's rows are the K dimension: panels of 64 of its N columns
    fence_to_tensor_cores();
    __syncthreads();
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float d[N / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        const u16* r0 = a + (16 * w + g) * K + 16 * kk + 2 * t;
        const u16* r1 = r0 + 8 * K;
        const u32 f[4] = {*(const u32*)r0, *(const u32*)r1, *(const u32*)(r0 + 8), *(const u32*)(r1 + 8)};
        Wgmma<N>::template rs<BF16>(d, f, descriptor(base + kk * 2048, K * 128, 1024), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin<N / 2>(d);
    store_acc<N>(c, d);
}

#define CHECKS(TY, BF, K, N)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                                           \
        wgmma_check_ss_##TY##_k##K##_n##N(const u16* a, const u16* b, float* c) { check_ss<BF, K, N>(a, b, c); } \
    extern "C" __global__ void __launch_bounds__(128)                                                           \
        wgmma_check_rs_##TY##_k##K##_n##N(const u16* a, const u16* b, float* c) { check_rs<BF, K, N>(a, b, c); }

// The shapes of the attention kernels: d = 64 with 128-key tiles, d = 128 with 64-key tiles.
CHECKS(f16, false, 64, 128)
CHECKS(f16, false, 128, 64)
CHECKS(f16, false, 128, 128)
CHECKS(f16, false, 64, 64)
CHECKS(bf16, true, 64, 128)
CHECKS(bf16, true, 128, 64)
CHECKS(bf16, true, 128, 128)
CHECKS(bf16, true, 64, 64)
