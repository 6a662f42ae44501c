// CUDA for the host: what the course's kernel files use of CUDA, mapped to C++20 threads so that g++ can compile
// a .cu file and run its kernels on a CPU. tools/hostemu/hostemu.py puts this text in front of a kernel file's, after
// removing the file's inline-PTX helpers in favour of the host versions below; see tools/hostemu/README.md.
//
// A thread block runs as one std::thread per CUDA thread, blocks one after another; __syncthreads is a block-wide
// std::barrier; warp-level operations exchange values through per-warp buffers between two warp barriers.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
using std::max;
using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx;
inline dim3 blockIdx, gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline std::barrier<>* g_block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> g_warp_bar;
inline float g_shfl[32][32];
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
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
inline std::uint16_t f16_bits(float f) { _Float16 h = (_Float16)f; std::uint16_t x; std::memcpy(&x, &h, 2); return x; }
inline float f16_val(std::uint16_t x) { _Float16 h; std::memcpy(&h, &x, 2); return (float)h; }
inline std::uint16_t bf16_bits(float f) {
    unsigned u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (std::uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// --- warp-level PTX of the tensor-core kernels: ldmatrix, mma.sync m16n8k16, cp.async, vote
alignas(16) inline unsigned char g_arena[232448];  // dynamic shared memory ("extern __shared__")
inline unsigned g_xa[32][32][4], g_xb[32][32][2];
inline void warp_sync() { g_warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
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
inline unsigned smem_addr(const void* p) { return (unsigned)((const unsigned char*)p - g_arena); }
// lanes 8j..8j+7 give the row addresses of 8x8 block j; lane l gets row l/4, columns 2(l%4), +1 of each block
inline void ldsm_x4(unsigned* r, unsigned addr) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xa[w][l][0] = addr;
    warp_sync();
    for (int j = 0; j < 4; ++j) std::memcpy(&r[j], g_arena + g_xa[w][8 * j + l / 4][0] + 4 * (l % 4), 4);
    warp_sync();
}
// transposed: lane l gets rows 2(l%4), +1 at column l/4
inline void ldsm_x4_t(unsigned* r, unsigned addr) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_xa[w][l][0] = addr;
    warp_sync();
    for (int j = 0; j < 4; ++j) {
        std::uint16_t lo, hi;
        std::memcpy(&lo, g_arena + g_xa[w][8 * j + 2 * (l % 4)][0] + 2 * (l / 4), 2);
        std::memcpy(&hi, g_arena + g_xa[w][8 * j + 2 * (l % 4) + 1][0] + 2 * (l / 4), 2);
        r[j] = lo | ((unsigned)hi << 16);
    }
    warp_sync();
}
inline void cp_async16(unsigned dst, const void* src, bool valid) {  // synchronous here: a copy, or 16 zeros
    if (valid) std::memcpy(g_arena + dst, src, 16); else std::memset(g_arena + dst, 0, 16);
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

// Host versions of the kernel files' conversion structs, whose PTX bodies (cvt, mma.sync) cannot run here: the
// emulation replaces each file's `struct F16 { ... };` and `struct BF16 { ... };` by `using F16 = HostF16;` etc.
struct HostF16 {
    static inline float load(std::uint16_t x) { return f16_val(x); }
    static inline std::uint16_t store(float f) { return f16_bits(f); }
    static inline unsigned pack(float lo, float hi) { return f16_bits(lo) | ((unsigned)f16_bits(hi) << 16); }
    static inline void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) { mma_emul<f16_val>(c, a, b0, b1); }
};
struct HostBF16 {
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
void launch(void (*k)(A...), unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** args) {
    gridDim = dim3{gx, gy, gz};
    blockDim = dim3{bx, 1, 1};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = dim3{x, y, z};
                std::barrier<> bar(bx);
                g_block_bar = &bar;
                g_warp_bar.clear();
                for (unsigned w = 0; w < (bx + 31) / 32; ++w) g_warp_bar.emplace_back(new std::barrier<>(32));
                std::vector<std::thread> ts;
                for (unsigned t = 0; t < bx; ++t)
                    ts.emplace_back([=] {
                        threadIdx = dim3{t, 0, 0};
                        call_unpacked(k, args, std::index_sequence_for<A...>{});
                    });
                for (auto& th : ts) th.join();
            }
}
