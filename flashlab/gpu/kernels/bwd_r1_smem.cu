// Backward pass, first version: FlashAttention-2's scheme with scalar fp32 FMAs on shared-memory tiles.
// Correctness first; the tensor-core ladder of the forward (mma.sync, ldmatrix, cp.async) is the next step.
//
// Three kernels, launched in this order by flashlab.gpu.attention_backward:
//
// 1. bwd_dot_<dt>_d<D>: D_i = rowsum(dO_i * O_i), one warp per query row. It equals rowsum(P_i * dP_i), the
//    softmax backward's correction term, at O(n d) instead of O(n m d).
// 2. bwd_main_<dt>_d<D>: grid (ceil(m / BC), Hk, B), NT threads. A block owns BC keys of one K/V head and keeps
//    their dK, dV in registers for the whole pass; for every query head of the group (GQA: the group's gradients
//    add up here, no atomics needed) and every query tile that can see one of its keys (causal: earlier, fully
//    masked tiles are skipped), it recomputes the tile's probabilities from the saved logsumexp,
//        P = exp(scale * Q K^T - L)             (already normalised: no row max, no row sum)
//        dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dK += dS^T Q,   dQ += dS K
//    and adds its share of dQ to an fp32 buffer with atomicAdd (several key blocks write the same dQ rows).
// 3. bwd_dq_<dt>: dQ = scale * (fp32 buffer), rounded to the input type.
//
// dQ by atomics rather than a second pass: a separate dQ kernel (parallel over query blocks) would recompute S and
// P a second time, 7 tile products instead of 5 (1.4x the FLOPs); the atomics cost one fp32 add per dQ element per
// key block, in L2. The price is a run-to-run order of the fp32 additions (results differ in the last bits).
//
// Phase A (scores): warp w takes rows w, w + 8, w + 16, w + 24 of the query tile and lane j takes key j, so the
// K and V rows each lane reads are 16-byte loads from rows 272 (or 144) bytes apart: conflict-free. Phases B
// (dK, dV) and C (dQ) give each thread fixed (key, column) / (row, column) elements; a warp shares one key or
// row, so P and dS are broadcast reads and Q, dO, K columns are consecutive.
//
// Layout: q, do, o (B, H, n, D); k, v, dk, dv (B, Hk, m, D); lse, D (B, H, n) fp32 (lse natural log, -inf for a
// row that sees no key); dq_acc (B, H, n, D) fp32, zeroed by the caller. causal: row i sees keys j <= i + m - n.
// Inputs fp16 or bf16 bit patterns. Needs sm_80 (bf16 conversion instruction).

#define NEG_INF (-__int_as_float(0x7f800000))
#define POS_INF (__int_as_float(0x7f800000))
#define NT 256
#define NWARPS (NT / 32)
#define BR 32  // query rows per tile
#define BC 32  // keys per block: one per lane in phase A
#define RPW (BR / NWARPS)  // query rows per warp in phase A
#define LOG2E 1.4426950408889634f

typedef unsigned short u16;
typedef unsigned int u32;

struct F16 {
    static __device__ __forceinline__ float load(u16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
    static __device__ __forceinline__ u16 store(float f) {
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
};
struct BF16 {
    static __device__ __forceinline__ float load(u16 x) { return __uint_as_float((u32)x << 16); }
    static __device__ __forceinline__ u16 store(float f) {
#if __CUDA_ARCH__ >= 800
        u16 h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
#else
        // sm_75 has no bf16 conversion: round to nearest even by hand (a NaN stays a quiet NaN), so that the
        // file's fp16 kernels also build for Turing
        const u32 b = __float_as_uint(f);
        if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
        return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
#endif
    }
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Eight 16-bit values (one 16-byte chunk) to fp32.
template <class Ty>
__device__ __forceinline__ void unpack8(uint4 x, float* f) {
    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        f[2 * t] = Ty::load((u16)(w[t] & 0xffffu));
        f[2 * t + 1] = Ty::load((u16)(w[t] >> 16));
    }
}

template <class Ty, int D>
__device__ void bwd_dot(const u16* __restrict__ o, const u16* __restrict__ dout, float* __restrict__ dvec,
                        int rows) {
    const int row = blockIdx.x * NWARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;  // whole warps leave together
    const size_t base = (size_t)row * D;
    float x = 0.f;
#pragma unroll
    for (int c = lane; c < D; c += 32) x = fmaf(Ty::load(o[base + c]), Ty::load(dout[base + c]), x);
    x = warp_sum(x);
    if (lane == 0) dvec[row] = x;
}

template <class Ty, int D>
__device__ void bwd_main(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                         const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dvec,
                         float* __restrict__ dq_acc, u16* __restrict__ dk, u16* __restrict__ dv, int n, int m, int H,
                         int Hk, float scale, int causal) {
    constexpr int S = D + 8;           // staged row stride in halves (16-byte aligned, 4 banks between rows)
    constexpr int CH = D / 8;          // 16-byte chunks per row
    constexpr int PER = BC * D / NT;   // dK and dV elements per thread
    constexpr int PERQ = BR * D / NT;  // dQ elements per thread per tile
    __shared__ __align__(16) u16 ks[BC][S];
    __shared__ __align__(16) u16 vs[BC][S];
    __shared__ __align__(16) u16 qs[BR][S];
    __shared__ __align__(16) u16 dos[BR][S];
    __shared__ float ps[BR][BC];   // P of the tile
    __shared__ float dss[BR][BC];  // dS of the tile
    __shared__ float lrow[BR];     // L of each row in log2 units (+inf: the row sees no key, so P = 0)
    __shared__ float drow[BR];     // D of each row

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k0 = blockIdx.x * BC, hk = blockIdx.y, b = blockIdx.z, G = H / Hk;
    const int off = m - n;
    const float scale2 = scale * LOG2E;
    const size_t kvbase = ((size_t)b * Hk + hk) * m;  // first key row of this (batch, K/V head)

    for (int i = threadIdx.x; i < BC * CH; i += NT) {
        const int j = i / CH, c = (i % CH) * 8;
        uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
        if (k0 + j < m) {  // keys past m are zeros (finite), and their P is set to 0 below
            kx = *(const uint4*)(k + (kvbase + k0 + j) * D + c);
            vx = *(const uint4*)(v + (kvbase + k0 + j) * D + c);
        }
        *(uint4*)&ks[j][c] = kx;
        *(uint4*)&vs[j][c] = vx;
    }

    float dk_acc[PER], dv_acc[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) dk_acc[e] = dv_acc[e] = 0.f;

    // Causal: row i sees key k0 iff i >= k0 - off, so query tiles before the one holding that row are fully
    // masked for every key of this block and are skipped (FlashAttention-2's causal saving in the backward).
    const int qstart = causal ? (max(0, k0 - off) / BR) * BR : 0;

    for (int g = 0; g < G; ++g) {
        const size_t hrow = ((size_t)b * H + (size_t)hk * G + g) * n;  // first query row of head hk * G + g
        for (int q0 = qstart; q0 < n; q0 += BR) {
            __syncthreads();  // the previous tile's readers are done (first pass: ks, vs are written)
            for (int i = threadIdx.x; i < BR * CH; i += NT) {
                const int r = i / CH, c = (i % CH) * 8;
                uint4 qx = make_uint4(0, 0, 0, 0), dx = make_uint4(0, 0, 0, 0);
                if (q0 + r < n) {
                    qx = *(const uint4*)(q + (hrow + q0 + r) * D + c);
                    dx = *(const uint4*)(dout + (hrow + q0 + r) * D + c);
                }
                *(uint4*)&qs[r][c] = qx;
                *(uint4*)&dos[r][c] = dx;
            }
            if (threadIdx.x < BR) {
                const int r = threadIdx.x;
                float L = NEG_INF, dd = 0.f;
                if (q0 + r < n) {
                    L = lse[hrow + q0 + r];
                    dd = dvec[hrow + q0 + r];
                }
                lrow[r] = L == NEG_INF ? POS_INF : L * LOG2E;
                drow[r] = dd;
            }
            __syncthreads();

            // Phase A: S and dP for rows warp + NWARPS * e, key k0 + lane; then P and dS to shared memory.
            float s[RPW], dp[RPW];
#pragma unroll
            for (int e = 0; e < RPW; ++e) s[e] = dp[e] = 0.f;
#pragma unroll 1
            for (int c = 0; c < D; c += 8) {
                float kf[8], vf[8];
                unpack8<Ty>(*(const uint4*)&ks[lane][c], kf);
                unpack8<Ty>(*(const uint4*)&vs[lane][c], vf);
#pragma unroll
                for (int e = 0; e < RPW; ++e) {
                    float qf[8], df[8];
                    unpack8<Ty>(*(const uint4*)&qs[warp + NWARPS * e][c], qf);
                    unpack8<Ty>(*(const uint4*)&dos[warp + NWARPS * e][c], df);
#pragma unroll
                    for (int t = 0; t < 8; ++t) {
                        s[e] = fmaf(qf[t], kf[t], s[e]);
                        dp[e] = fmaf(df[t], vf[t], dp[e]);
                    }
                }
            }
            const int key = k0 + lane;
#pragma unroll
            for (int e = 0; e < RPW; ++e) {
                const int r = warp + NWARPS * e, row = q0 + r;
                const bool ok = row < n && key < m && (!causal || key <= row + off);
                const float p = ok ? exp2f(fmaf(s[e], scale2, -lrow[r])) : 0.f;
                ps[r][lane] = p;
                dss[r][lane] = p * (dp[e] - drow[r]);
            }
            __syncthreads();

            // Phase B: dV[j][c] += sum_r P[r][j] dO[r][c];  dK[j][c] += sum_r dS[r][j] Q[r][c] (scale at the end).
#pragma unroll
            for (int e = 0; e < PER; ++e) {
                const int idx = threadIdx.x + NT * e, j = idx / D, c = idx % D;
                float av = dv_acc[e], ak = dk_acc[e];
#pragma unroll 8
                for (int r = 0; r < BR; ++r) {
                    av = fmaf(ps[r][j], Ty::load(dos[r][c]), av);
                    ak = fmaf(dss[r][j], Ty::load(qs[r][c]), ak);
                }
                dv_acc[e] = av;
                dk_acc[e] = ak;
            }
            // Phase C: dQ[r][c] += sum_j dS[r][j] K[j][c] into the fp32 buffer (scale applied by bwd_dq).
#pragma unroll
            for (int e = 0; e < PERQ; ++e) {
                const int idx = threadIdx.x + NT * e, r = idx / D, c = idx % D;
                if (q0 + r < n) {  // uniform in a warp (a warp shares r)
                    float x = 0.f;
#pragma unroll 8
                    for (int j = 0; j < BC; ++j) x = fmaf(dss[r][j], Ty::load(ks[j][c]), x);
                    atomicAdd(dq_acc + (hrow + q0 + r) * D + c, x);
                }
            }
        }
    }

#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const int idx = threadIdx.x + NT * e, j = idx / D, c = idx % D;
        if (k0 + j < m) {
            dk[(kvbase + k0 + j) * D + c] = Ty::store(scale * dk_acc[e]);
            dv[(kvbase + k0 + j) * D + c] = Ty::store(dv_acc[e]);
        }
    }
}

template <class Ty>
__device__ void bwd_dq(const float* __restrict__ dq_acc, u16* __restrict__ dq, float scale, long long total) {
    const long long i = (long long)blockIdx.x * NT + threadIdx.x;
    if (i < total) dq[i] = Ty::store(scale * dq_acc[i]);
}

// bwd_main declares one block per SM as its minimum: without it ptxas for sm_90 aims at 128 registers (two
// blocks) and spills at d = 128.
#define DEFINE_KERNELS(DT, TY, D)                                                                                 \
    extern "C" __global__ void __launch_bounds__(NT)                                                              \
        bwd_dot_##DT##_d##D(const u16* o, const u16* dout, float* dvec, int rows) {                               \
        bwd_dot<TY, D>(o, dout, dvec, rows);                                                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(NT, 1)                                                           \
        bwd_main_##DT##_d##D(const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,          \
                             const float* dvec, float* dq_acc, u16* dk, u16* dv, int n, int m, int H, int Hk,     \
                             float scale, int causal) {                                                           \
        bwd_main<TY, D>(q, k, v, dout, lse, dvec, dq_acc, dk, dv, n, m, H, Hk, scale, causal);                    \
    }

DEFINE_KERNELS(f16, F16, 64)
DEFINE_KERNELS(f16, F16, 128)
DEFINE_KERNELS(bf16, BF16, 64)
DEFINE_KERNELS(bf16, BF16, 128)

extern "C" __global__ void __launch_bounds__(NT) bwd_dq_f16(const float* dq_acc, u16* dq, float scale,
                                                            long long total) {
    bwd_dq<F16>(dq_acc, dq, scale, total);
}
extern "C" __global__ void __launch_bounds__(NT) bwd_dq_bf16(const float* dq_acc, u16* dq, float scale,
                                                             long long total) {
    bwd_dq<BF16>(dq_acc, dq, scale, total);
}
