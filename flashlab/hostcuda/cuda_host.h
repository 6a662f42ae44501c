// CUDA for the host: what the course's kernels use of CUDA, mapped to C++20 so that g++ can compile a .cu file
// and run its kernels on a CPU. flashlab/hostcuda (this header's package) puts this text in front of a kernel's and
// exports a launcher per kernel; tools/hostemu/README.md says what it emulates and what it cannot.
//
// A thread block runs as one std::thread per CUDA thread, blocks one after another; __syncthreads is a block-wide
// std::barrier; warp-level operations exchange values through per-warp buffers between two warp barriers. Built
// with -DHOSTCUDA_SERIAL, a block's threads run one after another on the calling thread instead: much faster, for
// kernels whose threads never wait for each other (a barrier or warp operation then stops the program with a message).
#include <algorithm>
#include <barrier>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
using std::isfinite;
using std::isinf;
using std::isnan;
using std::max;
using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx;
inline dim3 blockIdx, gridDim, blockDim;
#define __global__
#define __device__
#define __host__
#define __noinline__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __grid_constant__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
// The fast-math intrinsics, computed exactly here (the GPU's are a few ulp off; graders allow for fp32 rounding).
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
template <class T>
inline T __ldg(const T* p) { return *p; }
inline void __threadfence() {}
constexpr int warpSize = 32;
inline std::barrier<>* g_block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> g_warp_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> g_wg_bar;  // one per warpgroup (4 warps): Hopper's wgmma
inline float g_shfl[32][32];
[[noreturn]] inline void hostcuda_needs_threads(const char* what) {
    std::fprintf(stderr, "%s: this kernel was launched one thread after another (HOSTCUDA_SERIAL), where threads "
                 "cannot wait for each other\n", what);
    std::abort();
}
inline void __syncthreads() {
    if (!g_block_bar) hostcuda_needs_threads("__syncthreads");
    g_block_bar->arrive_and_wait();
}
inline float __shfl_xor_sync(unsigned, float x, int o) {
    if (g_warp_bar.empty()) hostcuda_needs_threads("__shfl_xor_sync");
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
inline int atomicAdd(int* p, int v) {
    std::lock_guard<std::mutex> g(g_atomic);
    int o = *p;
    *p = o + v;
    return o;
}
inline int arrive_acq_rel(int* p) { return atomicAdd(p, 1); }  // atom.acq_rel.gpu.add: the lock orders memory
// griddepcontrol: kernels run here one after another, so a dependent grid never starts before its primary ends
inline void let_dependents_launch() {}
inline void wait_for_split_grid() {}
inline void red_add_v2(float* p, float a, float b) {  // red.global.add.v2.f32
    std::lock_guard<std::mutex> g(g_atomic);
    p[0] += a;
    p[1] += b;
}
// A load past this SM's L1 (ld.global.cg): memory is one here.
template <class T>
inline T __ldcg(const T* p) { return *p; }
// fp16 conversions in integer arithmetic, rounding to nearest even as cvt.rn.f16.f32 does (g++ before 12 has no
// _Float16 in C++ on x86).
inline std::uint16_t f16_bits(float f) {
    unsigned x; std::memcpy(&x, &f, 4);
    const unsigned sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (std::uint16_t)(sign | 0x7e00u);     // NaN
    if (ax >= 0x477ff000u) return (std::uint16_t)(sign | 0x7c00u);    // 65520 and above round to inf
    if (ax < 0x38800000u) {                                            // below 2^-14: a subnormal half, units 2^-24
        float a; std::memcpy(&a, &ax, 4);
        return (std::uint16_t)(sign | (unsigned)std::nearbyint(a * 16777216.f));
    }
    const unsigned r = ax - 0x38000000u;                              // exponent bias 127 -> 15
    return (std::uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}
inline float f16_val(std::uint16_t h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    unsigned x;
    if (e == 0) {
        const float a = (float)m * (1.f / 16777216.f);                 // exact: m < 2^10
        std::memcpy(&x, &a, 4);
    } else {
        x = (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
    }
    x |= sign;
    float f; std::memcpy(&f, &x, 4);
    return f;
}
inline std::uint16_t bf16_bits(float f) {
    unsigned u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (std::uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// --- warp-level PTX of the tensor-core kernels: ldmatrix, mma.sync m16n8k16, cp.async, vote
alignas(16) inline unsigned char g_arena[232448];  // dynamic shared memory ("extern __shared__")
inline unsigned g_xa[32][32][4], g_xb[32][32][2];
inline void warp_sync() {
    if (g_warp_bar.empty()) hostcuda_needs_threads("a warp-level operation");
    g_warp_bar[threadIdx.x / 32]->arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) { warp_sync(); }
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
// A shared-memory address is a 32-bit offset from the arena, signed: the static __shared__ arrays (function statics
// here) lie outside the arena but within 2 GB of it, in the program's data.
inline unsigned smem_addr(const void* p) { return (unsigned)((std::uintptr_t)p - (std::uintptr_t)g_arena); }
inline unsigned char* smem_ptr(unsigned addr) {
    return (unsigned char*)((std::uintptr_t)g_arena + (std::intptr_t)(std::int32_t)addr);
}
inline std::size_t __cvta_generic_to_shared(const void* p) { return smem_addr(p); }
// lanes 8j..8j+7 give the row addresses of 8x8 block j; lane l gets row l/4, columns 2(l%4), +1 of each block
inline void ldsm_x4(unsigned* r, unsigned addr) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xa[w][l][0] = addr;
    warp_sync();
    for (int j = 0; j < 4; ++j) std::memcpy(&r[j], smem_ptr(g_xa[w][8 * j + l / 4][0]) + 4 * (l % 4), 4);
    warp_sync();
}
// transposed: lane l gets rows 2(l%4), +1 at column l/4
inline void ldsm_x4_t(unsigned* r, unsigned addr) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xa[w][l][0] = addr;
    warp_sync();
    for (int j = 0; j < 4; ++j) {
        std::uint16_t lo, hi;
        std::memcpy(&lo, smem_ptr(g_xa[w][8 * j + 2 * (l % 4)][0]) + 2 * (l / 4), 2);
        std::memcpy(&hi, smem_ptr(g_xa[w][8 * j + 2 * (l % 4) + 1][0]) + 2 * (l / 4), 2);
        r[j] = lo | ((unsigned)hi << 16);
    }
    warp_sync();
}
inline void cp_async16(unsigned dst, const void* src, bool valid) {  // synchronous here: a copy, or 16 zeros
    if (valid) std::memcpy(smem_ptr(dst), src, 16); else std::memset(smem_ptr(dst), 0, 16);
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
// The calls that inline asm statements become (flashlab/hostcuda/ptx.py): outputs by reference, inputs by value,
// so that every input is read before any output is written, as the instruction does.
inline void hostcuda_ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr, bool trans) {
    unsigned r[4];
    if (trans) ldsm_x4_t(r, addr); else ldsm_x4(r, addr);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
// stmatrix x4 (kernels/hopper/epilogue.cuh), ldmatrix's inverse: lane l writes row l % 8 of block l / 8, the words
// that lanes 4 (l % 8) .. 4 (l % 8) + 3 hold in their register l / 8.
inline void stsm_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xa[w][l][0] = r0, g_xa[w][l][1] = r1, g_xa[w][l][2] = r2, g_xa[w][l][3] = r3;
    warp_sync();
    for (int t = 0; t < 4; ++t) std::memcpy(smem_ptr(addr) + 4 * t, &g_xa[w][4 * (l % 8) + t][l / 8], 4);
    warp_sync();
}
inline uint4 lds_v4(unsigned addr) {
    uint4 v;
    std::memcpy(&v, smem_ptr(addr), 16);
    return v;
}
inline void stg_v4(void* p, uint4 v) { std::memcpy(p, &v, 16); }
template <float (*CV)(std::uint16_t)>
inline void hostcuda_mma_m16n8k16(float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1, unsigned a2,
                                  unsigned a3, unsigned b0, unsigned b1, float c0, float c1, float c2, float c3) {
    float c[4] = {c0, c1, c2, c3};
    const unsigned a[4] = {a0, a1, a2, a3};
    mma_emul<CV>(c, a, b0, b1);
    d0 = c[0], d1 = c[1], d2 = c[2], d3 = c[3];
}
// m16n8k8 is the k = 0..7 half of m16n8k16: its a0, a1 and b0 are m16n8k16's, the k = 8..15 half zero.
inline void hostcuda_mma_m16n8k8(float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1, unsigned b0,
                                 float c0, float c1, float c2, float c3) {
    hostcuda_mma_m16n8k16<f16_val>(d0, d1, d2, d3, a0, a1, 0u, 0u, b0, 0u, c0, c1, c2, c3);
}

// --- Hopper's warpgroup MMA (kernels/hopper/wgmma.cuh), synchronous here: the instruction is done when the call
// returns, so fences, commits and waits have nothing to do. Operands in shared memory are read through their
// descriptors with the 128-byte swizzle as the hardware applies it, to the address: bits 4-6 ^= bits 7-9.
typedef unsigned long long u64;
inline unsigned smem_u32(const void* p) { return smem_addr(p); }
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int N>
inline void wgmma_wait() {}
template <int NREG>
inline void pin(float*) {}
template <int NREG>
inline void hold(const unsigned*) {}
inline void fence_to_tensor_cores() {}
// The copy engine's bulk reduction (cp.reduce.async.bulk .add.f32), done when the call returns: a missing wait
// before its staging tile is written again does not show here (compute-sanitizer racecheck on a GPU).
inline void bulk_reduce_add(float* dst, unsigned src, unsigned bytes) {
    std::lock_guard<std::mutex> g(g_atomic);
    const float* from = (const float*)smem_ptr(src);
    for (unsigned i = 0; i < bytes / 4; ++i) dst[i] += from[i];
}
inline void bulk_commit() {}
template <int N>
inline void bulk_wait_read() {}
template <int N>
inline void bulk_wait() {}
inline unsigned g_wg_a[8][128][4];  // the A fragments of each warpgroup's threads (register-A wgmma)
inline void warpgroup_sync() {
    if (g_wg_bar.empty()) hostcuda_needs_threads("a warpgroup operation (wgmma)");
    g_wg_bar[threadIdx.x / 128]->arrive_and_wait();
}
struct WgmmaDesc {
    unsigned start, leading, stride;
    explicit WgmmaDesc(u64 d)
        : start((unsigned)(d & 0x3fffu) << 4), leading((unsigned)((d >> 16) & 0x3fffu) << 4),
          stride((unsigned)((d >> 32) & 0x3fffu) << 4) {
        if ((d >> 62) != 1) { std::fprintf(stderr, "hostcuda: only the 128-byte swizzle is emulated\n"); std::abort(); }
    }
    static std::uint16_t at(unsigned addr) {
        addr ^= ((addr >> 7) & 7u) << 4;
        std::uint16_t x; std::memcpy(&x, smem_ptr(addr), 2);
        return x;
    }
    // K-major: element (row r, k) of a 16-wide k slice; the next 8 rows are `stride` bytes on
    std::uint16_t kmajor(int r, int k) const { return at(start + (r / 8) * stride + (r % 8) * 128 + 2 * k); }
    // MN-major (transposed B): element (k, column c); the next 8 k are `stride` on, the next 64 columns `leading`
    std::uint16_t mnmajor(int k, int c) const {
        return at(start + (c / 64) * leading + (k / 8) * stride + (k % 8) * 128 + 2 * (c % 64));
    }
};
template <int N>
struct Wgmma {
    // d (64 x N) = A B^T (+ d): A (64 x 16) and B (N x 16) both K-major (MN false) or both MN-major (MN true, both
    // transpose flags set: WgmmaT) in shared memory
    template <bool BF16, bool MN = false>
    static void ss(float* d, u64 da, u64 db, int scale_d) {
        const WgmmaDesc A(da), B(db);
        auto at = [](const WgmmaDesc& x, int i, int k) { return val<BF16>(MN ? x.mnmajor(k, i) : x.kmajor(i, k)); };
        const int w = (threadIdx.x % 128) / 32, l = threadIdx.x % 32, g = l / 4, t = l % 4;
        for (int j = 0; j < N / 8; ++j)
            for (int e = 0; e < 4; ++e) {
                const int row = 16 * w + g + 8 * (e / 2), col = 8 * j + 2 * t + e % 2;
                float x = scale_d ? d[4 * j + e] : 0.f;
                for (int k = 0; k < 16; ++k) x += at(A, row, k) * at(B, col, k);
                d[4 * j + e] = x;
            }
    }
    // d = A B (+ d): A (64 x 16) from the warpgroup's registers (mma.sync's A layout per warp), B (16 x N)
    // MN-major in shared memory
    template <bool BF16>
    static void rs(float* d, const unsigned* a, u64 db, int scale_d) {
        const WgmmaDesc B(db);
        const int wg = threadIdx.x / 128, me = threadIdx.x % 128;
        const int w = me / 32, l = me % 32, g = l / 4, t = l % 4;
        for (int i = 0; i < 4; ++i) g_wg_a[wg][me][i] = a[i];
        warpgroup_sync();
        auto A = [&](int row, int k) {
            const unsigned x = g_wg_a[wg][32 * (row / 16) + 4 * (row % 8) + (k % 8) / 2][(row % 16 >= 8) + 2 * (k >= 8)];
            return val<BF16>((std::uint16_t)(k % 2 ? x >> 16 : x & 0xffffu));
        };
        float out[N / 2];
        for (int j = 0; j < N / 8; ++j)
            for (int e = 0; e < 4; ++e) {
                const int row = 16 * w + g + 8 * (e / 2), col = 8 * j + 2 * t + e % 2;
                float x = scale_d ? d[4 * j + e] : 0.f;
                for (int k = 0; k < 16; ++k) x += A(row, k) * val<BF16>(B.mnmajor(k, col));
                out[4 * j + e] = x;
            }
        warpgroup_sync();
        for (int i = 0; i < N / 2; ++i) d[i] = out[i];
    }
    template <bool BF16>
    static float val(std::uint16_t x) { return BF16 ? bf16_val(x) : f16_val(x); }
};

// d = A B (+ d) with A (64 x 16) and B (16 x N) both MN-major in shared memory (both transpose flags set)
template <int N>
struct WgmmaT {
    template <bool BF16>
    static void ss(float* d, u64 da, u64 db, int scale_d) { Wgmma<N>::template ss<BF16, true>(d, da, db, scale_d); }
};

// --- the TMA rungs (kernels/hopper/tma.cuh): mbarriers and tensor copies, synchronous here. An mbarrier's 8 bytes
// hold {pending arrivals (bits 0-14), expected arrivals (15-29), phase (31)} and the bytes still owed (signed).
// A tensor map is the host emulation's own 16 words (flashlab.gpu.hopper.host_tensor_map), not the driver's.
inline std::mutex g_mbar_mutex;
inline std::condition_variable g_mbar_done;  // told when any barrier completes a phase
inline void mbar_init(unsigned bar, unsigned count) {
    std::lock_guard<std::mutex> lock(g_mbar_mutex);
    const unsigned w = count | (count << 15);
    const int tx = 0;
    std::memcpy(smem_ptr(bar), &w, 4);
    std::memcpy(smem_ptr(bar) + 4, &tx, 4);
}
inline void fence_barrier_init() {}
inline void mbar_update(unsigned bar, int arrivals, int bytes) {  // caller holds g_mbar_mutex
    unsigned w; int tx;
    std::memcpy(&w, smem_ptr(bar), 4);
    std::memcpy(&tx, smem_ptr(bar) + 4, 4);
    unsigned pending = (w & 0x7fffu) - arrivals;
    tx += bytes;
    const unsigned count = (w >> 15) & 0x7fffu;
    unsigned phase = w >> 31;
    if (pending == 0 && tx == 0) { phase ^= 1u; pending = count; g_mbar_done.notify_all(); }
    w = pending | (count << 15) | (phase << 31);
    std::memcpy(smem_ptr(bar), &w, 4);
    std::memcpy(smem_ptr(bar) + 4, &tx, 4);
}
inline void mbar_expect_tx(unsigned bar, unsigned bytes) {
    std::lock_guard<std::mutex> lock(g_mbar_mutex);
    mbar_update(bar, 1, (int)bytes);
}
inline void mbar_arrive(unsigned bar) {
    std::lock_guard<std::mutex> lock(g_mbar_mutex);
    mbar_update(bar, 1, 0);
}
template <int N>
inline void setmaxnreg_dec() {}  // registers are not counted here
template <int N>
inline void setmaxnreg_inc() {}
// As on the GPU, a bounded wait (here until a phase completes, or 10 ms): the kernel loops on it. A thread that
// has waited a minute without a phase completing waits for one that never will (a wrong parity, a missing
// arrival): the program stops and says so rather than hang.
inline thread_local int g_mbar_misses = 0;
inline bool mbar_try_wait(unsigned bar, unsigned parity) {
    std::unique_lock<std::mutex> lock(g_mbar_mutex);
    const bool done = g_mbar_done.wait_for(lock, std::chrono::milliseconds(10), [&] {
        unsigned w; std::memcpy(&w, smem_ptr(bar), 4);
        return (w >> 31) != (parity & 1u);
    });
    g_mbar_misses = done ? 0 : g_mbar_misses + 1;
    if (g_mbar_misses > 6000) {
        std::fprintf(stderr, "hostcuda: thread %u of block (%u, %u, %u) waited 60 s for parity %u of the mbarrier at "
                     "shared byte %u: a deadlock\n", threadIdx.x, blockIdx.x, blockIdx.y, blockIdx.z, parity, bar);
        std::abort();
    }
    return done;
}
// Named barriers (bar.sync / bar.arrive id, count): a phase completes when `count` threads have reached barrier
// `id`; bar.sync waits for that, bar.arrive does not. Reset for each block; a block that ends with arrivals still
// pending on one (a bar.arrive no bar.sync matched) is reported, as is a minute's wait.
struct HostNamedBar { unsigned arrived = 0, phase = 0; };
inline HostNamedBar g_named[16];
inline std::mutex g_named_mutex;
inline std::condition_variable g_named_done;
inline bool named_bar_reach(int id, int count) {  // with g_named_mutex held; true if this arrival completed it
    if (id < 0 || id > 15 || count <= 0 || count % 32) {
        std::fprintf(stderr, "hostcuda: named barrier %d for %d threads (ids are 0-15, counts multiples of 32)\n", id,
                     count);
        std::abort();
    }
    HostNamedBar& b = g_named[id];
    if (++b.arrived < (unsigned)count) return false;
    b.arrived = 0;
    ++b.phase;
    g_named_done.notify_all();
    return true;
}
inline void named_bar_arrive(int id, int count) {
    std::lock_guard<std::mutex> lock(g_named_mutex);
    named_bar_reach(id, count);
}
inline void named_bar_sync(int id, int count) {
    std::unique_lock<std::mutex> lock(g_named_mutex);
    const unsigned phase = g_named[id].phase;
    if (named_bar_reach(id, count)) return;
    if (!g_named_done.wait_for(lock, std::chrono::seconds(60), [&] { return g_named[id].phase != phase; })) {
        std::fprintf(stderr, "hostcuda: thread %u of block (%u, %u, %u) waited 60 s at named barrier %d: a deadlock\n",
                     threadIdx.x, blockIdx.x, blockIdx.y, blockIdx.z, id);
        std::abort();
    }
}
inline void named_bars_check_clear() {
    for (int id = 0; id < 16; ++id)
        if (g_named[id].arrived) {
            std::fprintf(stderr, "hostcuda: block (%u, %u, %u) ended with %u arrivals pending at named barrier %d "
                         "(a bar.arrive that no bar.sync matched)\n", blockIdx.x, blockIdx.y, blockIdx.z,
                         g_named[id].arrived, id);
            std::abort();
        }
    for (auto& b : g_named) b = HostNamedBar{};
}
// A 3-D map's box at (x, y, z): box_rows rows from y of head z. A 4-D map (words 8 and 9: the size and byte stride
// of the dimension between the columns and the rows; 0 in a 3-D map's words) at (x, y, z, w): one y and one w,
// box_rows values of z from z, as the sparse kernel's residue classes use it.
template <class Map>
inline void tma_load_4d(unsigned dst, const Map* map, int x, int y, int z, int w, unsigned bar) {
    const unsigned long long* m = (const unsigned long long*)map;
    const unsigned char* base = (const unsigned char*)(std::uintptr_t)m[0];
    const long long d = m[1], rows = m[2], heads = m[3], row_stride = m[4], head_stride = m[5];
    const int box_cols = (int)m[6], box_rows = (int)m[7];
    const long long mid = m[8] ? (long long)m[8] : 1, mid_stride = m[9];
    for (int r = 0; r < box_rows; ++r)
        for (int c = 0; c < box_cols; ++c) {
            const long long gr = z + r, gc = x + c;
            std::uint16_t v = 0;
            if (gr < rows && gc < d && y < mid && w < heads)
                std::memcpy(&v, base + w * head_stride + y * mid_stride + gr * row_stride + 2 * gc, 2);
            unsigned a = dst + r * 2 * box_cols + 2 * c;
            a ^= ((a >> 7) & 7u) << 4;  // the 128-byte swizzle, on the address
            std::memcpy(smem_ptr(a), &v, 2);
        }
    std::lock_guard<std::mutex> lock(g_mbar_mutex);
    mbar_update(bar, 0, -2 * box_rows * box_cols);
}
template <class Map>
inline void tma_load_3d(unsigned dst, const Map* map, int x, int y, int z, unsigned bar) {
    tma_load_4d(dst, map, x, 0, y, z, bar);
}

// Host versions of the kernel files' conversion structs, whose PTX bodies (cvt, mma.sync) cannot run here: the
// emulation replaces each file's `struct F16 { ... };` and `struct BF16 { ... };` by `using F16 = HostF16;` etc.
struct HostF16 {
    static constexpr bool bf16 = false;
    static inline float load(std::uint16_t x) { return f16_val(x); }
    static inline std::uint16_t store(float f) { return f16_bits(f); }
    static inline unsigned pack(float lo, float hi) { return f16_bits(lo) | ((unsigned)f16_bits(hi) << 16); }
    static inline void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) { mma_emul<f16_val>(c, a, b0, b1); }
};
struct HostBF16 {
    static constexpr bool bf16 = true;
    static inline float load(std::uint16_t x) { return bf16_val(x); }
    static inline std::uint16_t store(float f) { return bf16_bits(f); }
    static inline unsigned pack(float lo, float hi) { return bf16_bits(lo) | ((unsigned)bf16_bits(hi) << 16); }
    static inline void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) { mma_emul<bf16_val>(c, a, b0, b1); }
};

template <class... A, std::size_t... I>
void call_unpacked(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*(std::remove_cv_t<std::remove_reference_t<A>>*)args[I]...);
}
template <class... A>
constexpr unsigned arity(void (*)(A...)) { return sizeof...(A); }
template <class... A>
void launch(void (*k)(A...), unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** args) {
    gridDim = dim3{gx, gy, gz};
    blockDim = dim3{bx, 1, 1};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = dim3{x, y, z};
#ifdef HOSTCUDA_SERIAL
                for (unsigned t = 0; t < bx; ++t) {
                    threadIdx = dim3{t, 0, 0};
                    call_unpacked(k, args, std::index_sequence_for<A...>{});
                }
#else
                std::barrier<> bar(bx);
                g_block_bar = &bar;
                g_warp_bar.clear();
                for (unsigned w = 0; w < (bx + 31) / 32; ++w) g_warp_bar.emplace_back(new std::barrier<>(32));
                g_wg_bar.clear();
                for (unsigned w = 0; w < (bx + 127) / 128; ++w)
                    g_wg_bar.emplace_back(new std::barrier<>(std::min(128u, bx - 128 * w)));
                std::vector<std::thread> ts;
                for (unsigned t = 0; t < bx; ++t)
                    ts.emplace_back([=] {
                        threadIdx = dim3{t, 0, 0};
                        call_unpacked(k, args, std::index_sequence_for<A...>{});
                        // An exited thread no longer holds back a barrier, as on the GPU.
                        g_block_bar->arrive_and_drop();
                        g_warp_bar[t / 32]->arrive_and_drop();
                        g_wg_bar[t / 128]->arrive_and_drop();
                    });
                for (auto& th : ts) th.join();
                named_bars_check_clear();
#endif
            }
}
