// Rung 1 -- one thread per query row: chapters 1-2's online softmax, written in C.
//
// Thread i owns query row i. It walks over the keys one at a time, keeping the running max m, the running
// sum l and the unnormalised output acc[D] in registers, exactly like flashlab.online.update with a block of
// one key. Everything comes straight from global memory; the L1 cache is the only thing that saves us from
// reading K and V once per query row. Nothing is shared between threads.
//
// Works on every GPU (sm_75 and up). Inputs are fp16, bf16 (raw 16-bit patterns) or fp32; arithmetic is fp32.
// Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q, lse (B, H, n) fp32; H is a multiple of Hk (GQA).
// Grid: (ceil(n / 128), H, B); block: 128 threads.

#define NEG_INF (-__int_as_float(0x7f800000))

// Self-contained conversions (NVRTC cannot be relied on to find cuda_fp16.h / cuda_bf16.h).
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
    // bf16 is the top half of an fp32: widening is a shift; narrowing rounds to nearest even by hand, so
    // that this file also builds for sm_75, which has no bf16 conversion instruction.
    static __device__ __forceinline__ float load(T x) { return __uint_as_float(((unsigned)x) << 16); }
    static __device__ __forceinline__ T store(float x) {
        unsigned u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (T)((u >> 16) | 0x40u);  // keep NaN a NaN
        u += 0x7fffu + ((u >> 16) & 1u);
        return (T)(u >> 16);
    }
};

template <class Ty, int D>
__device__ void attn_row(const typename Ty::T* __restrict__ q, const typename Ty::T* __restrict__ k,
                         const typename Ty::T* __restrict__ v, typename Ty::T* __restrict__ o,
                         float* __restrict__ lse, int n, int m, int H, int Hk, float scale, int causal) {
    typedef typename Ty::T T;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (H / Hk);  // grouped-query attention: H / Hk query heads share one K/V head
    const size_t row = ((size_t)b * H + h) * n + i;
    const T* qi = q + row * D;
    const T* kb = k + ((size_t)b * Hk + hk) * m * D;
    const T* vb = v + ((size_t)b * Hk + hk) * m * D;

    // Causal, aligned at the bottom right as in flashlab.reference: query i sees keys j <= i + (m - n).
    const int kend = causal ? min(m, i + (m - n) + 1) : m;

    float acc[D];
#pragma unroll
    for (int c = 0; c < D; ++c) acc[c] = 0.f;
    float mx = NEG_INF, l = 0.f;

    for (int j = 0; j < kend; ++j) {
        const T* kj = kb + (size_t)j * D;
        const T* vj = vb + (size_t)j * D;
        float s = 0.f;
#pragma unroll 16
        for (int c = 0; c < D; ++c) s += Ty::load(qi[c]) * Ty::load(kj[c]);
        s *= scale;
        // Online softmax with a block of one key: grow the max, rescale what we had, add the new term.
        const float mnew = fmaxf(mx, s);
        const float corr = expf(mx - mnew);  // exp(-inf) = 0 on the first key
        const float p = expf(s - mnew);
        l = l * corr + p;
#pragma unroll
        for (int c = 0; c < D; ++c) acc[c] = acc[c] * corr + p * Ty::load(vj[c]);
        mx = mnew;
    }

    // A row that sees no key (causal with n > m) has l = 0: its output is 0 and its logsumexp -inf.
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* oi = o + row * D;
#pragma unroll
    for (int c = 0; c < D; ++c) oi[c] = Ty::store(acc[c] * inv);
    lse[row] = l > 0.f ? mx + logf(l) : NEG_INF;
}

#define DEFINE_KERNEL(NAME, TY, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                              \
        const TY::T* q, const TY::T* k, const TY::T* v, TY::T* o, float* lse, int n, int m, int H, int Hk, \
        float scale, int causal) {                                                                        \
        attn_row<TY, D>(q, k, v, o, lse, n, m, H, Hk, scale, causal);                                     \
    }

DEFINE_KERNEL(attn_fwd_f32_d64, F32, 64)
DEFINE_KERNEL(attn_fwd_f32_d128, F32, 128)
DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
