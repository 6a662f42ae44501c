// Rung 2 -- K/V tiles in shared memory: chapter 3's tiling, one block of 64 query rows at a time.
//
// Change from rung 1: the 64 threads of a block (one query row each) load a tile of BC keys and values into
// shared memory together, once, and then all 64 rows read it from there. Global traffic for K and V drops by
// the number of rows that share a tile (64x); reading ks[j][c] is a broadcast (every thread reads the same
// word), so the inner loops hit no bank conflicts. The query tile sits in shared memory too, stored transposed
// (qs[c][row]) so that the 64 threads read 64 consecutive words. The softmax update is now per tile: compute
// BC scores, take their max, rescale acc once per tile instead of once per key (chapter 3's block update).
//
// Works on every GPU (sm_75 and up); 40 KB of shared memory at D = 128.
// Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q, lse (B, H, n) fp32.
// Grid: (ceil(n / 64), H, B); block: 64 threads; dynamic shared memory: (64 + 2 * BC) * D * 4 bytes (40 KB at D = 128).

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 64  // query rows per block = threads per block
#define BC 8  // keys per tile (small: the score loop is unrolled over it, and s[BC] lives in registers)

struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(T x) { return x; }
    static __device__ __forceinline__ T store(float x) { return x; }
};
struct F16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(T x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
    static __device__ __forceinline__ T store(float x) {
        T h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
    }
};
struct BF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(T x) { return __uint_as_float(((unsigned)x) << 16); }
    static __device__ __forceinline__ T store(float x) {
        unsigned u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (T)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (T)(u >> 16);
    }
};

template <class Ty, int D>
__device__ void attn_tile(const typename Ty::T* __restrict__ q, const typename Ty::T* __restrict__ k,
                          const typename Ty::T* __restrict__ v, typename Ty::T* __restrict__ o,
                          float* __restrict__ lse, int n, int m, int H, int Hk, float scale, int causal) {
    typedef typename Ty::T T;
    extern __shared__ float smem[];
    float* qs = smem;               // [D][BR], transposed
    float* ks = qs + D * BR;        // [BC][D]
    float* vs = ks + BC * D;        // [BC][D]

    const int t = threadIdx.x;
    const int q0 = blockIdx.x * BR;
    const int i = q0 + t;
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (H / Hk);
    const T* qb = q + ((size_t)b * H + h) * n * D;
    const T* kb = k + ((size_t)b * Hk + hk) * m * D;
    const T* vb = v + ((size_t)b * Hk + hk) * m * D;

    // Load the query tile (coalesced: consecutive threads read consecutive elements), zero past row n.
    for (int e = t; e < BR * D; e += BR) {
        const int r = e / D, c = e % D;
        qs[c * BR + r] = (q0 + r < n) ? Ty::load(qb[(size_t)(q0 + r) * D + c]) * scale : 0.f;
    }

    // Keys this row may see, and the last key any row of the block may see (rows past n count as row n-1).
    const int shift = m - n;
    const int kend = causal ? min(m, i + shift + 1) : m;
    const int block_kend = causal ? min(m, min(q0 + BR, n) - 1 + shift + 1) : m;

    float acc[D];
#pragma unroll
    for (int c = 0; c < D; ++c) acc[c] = 0.f;
    float mx = NEG_INF, l = 0.f;

    for (int k0 = 0; k0 < block_kend; k0 += BC) {
        __syncthreads();  // everyone is done with the previous tile (and the query tile is written)
        for (int e = t; e < BC * D; e += BR) {
            const int r = e / D, c = e % D;
            const bool in = k0 + r < m;
            ks[e] = in ? Ty::load(kb[(size_t)(k0 + r) * D + c]) : 0.f;
            vs[e] = in ? Ty::load(vb[(size_t)(k0 + r) * D + c]) : 0.f;
        }
        __syncthreads();

        float s[BC];
        float tmax = NEG_INF;
#pragma unroll
        for (int j = 0; j < BC; ++j) {
            float x = 0.f;
#pragma unroll 16
            for (int c = 0; c < D; ++c) x += qs[c * BR + t] * ks[j * D + c];
            s[j] = (k0 + j < kend) ? x : NEG_INF;  // masked keys, and keys past m
            tmax = fmaxf(tmax, s[j]);
        }
        const float mnew = fmaxf(mx, tmax);
        if (mnew != NEG_INF) {  // a row with nothing visible yet has nothing to add (and would make nan)
            const float corr = expf(mx - mnew);
            float psum = 0.f;
#pragma unroll
            for (int j = 0; j < BC; ++j) {
                s[j] = expf(s[j] - mnew);
                psum += s[j];
            }
            l = l * corr + psum;
#pragma unroll
            for (int c = 0; c < D; ++c) {
                float x = acc[c] * corr;
#pragma unroll
                for (int j = 0; j < BC; ++j) x += s[j] * vs[j * D + c];
                acc[c] = x;
            }
            mx = mnew;
        }
    }

    if (i < n) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* oi = o + (((size_t)b * H + h) * n + i) * D;
#pragma unroll
        for (int c = 0; c < D; ++c) oi[c] = Ty::store(acc[c] * inv);
        lse[((size_t)b * H + h) * n + i] = l > 0.f ? mx + logf(l) : NEG_INF;
    }
}

#define DEFINE_KERNEL(NAME, TY, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(BR) NAME(                                               \
        const TY::T* q, const TY::T* k, const TY::T* v, TY::T* o, float* lse, int n, int m, int H, int Hk, \
        float scale, int causal) {                                                                        \
        attn_tile<TY, D>(q, k, v, o, lse, n, m, H, Hk, scale, causal);                                    \
    }

DEFINE_KERNEL(attn_fwd_f32_d64, F32, 64)
DEFINE_KERNEL(attn_fwd_f32_d128, F32, 128)
DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
