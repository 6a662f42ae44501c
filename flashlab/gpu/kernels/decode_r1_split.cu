// Split-KV decoding (FlashDecoding), first version: a few query tokens against a long KV cache.
//
// Why splits: at decoding time n (new query tokens) is 1..16, so one thread block per (batch, K/V head) has a
// whole cache of m keys to stream through alone, and at batch 1 with 32 heads the GPU (132 SMs) gets 32 blocks:
// most SMs idle and the few busy ones cannot keep enough loads in flight to reach the memory bandwidth. Splitting
// the keys into S ranges gives S times more blocks; each writes a partial (o_s, lse_s) over its range, and a
// second kernel merges them with chapter 1's rule: lse = log sum_s e^lse_s, o = sum_s e^(lse_s - lse) o_s.
//
// Kernel 1, decode_split_<dt>_d<D>: grid (num_splits, Hk * row_chunks, B), NT threads. One block takes the query
// rows of one K/V head -- all G = H / Hk query heads of the group times the n query tokens, ROWS of them at a
// time (GQA: every K/V tile read from memory serves the whole group) -- against keys [s * split_len, (s + 1) *
// split_len) of its batch element, clipped to that element's cache length. Per BC-key tile: K and V go to shared
// memory (16-byte loads), a warp owns ROWS / NWARPS rows and lane j scores key j (BC = 32 = a warp, so a row's
// max and sum are warp shuffles), then every thread updates its share of the ROWS x D accumulator with P V.
// Scores are kept in log2 units (log2(e) folded into the scale, exp2), as in rung 6 of the forward ladder.
//
// Kernel 2, decode_merge_<dt>_d<D>: grid (B * H * n), MT = 1024 threads, one row of the output per block.
//
// Layout: q (B, H, n, D), k and v (B, Hk, m, D) fp16 or bf16 bits; lens (B) int32 cache lengths (<= m) or null;
// partial o (B, H, n, S, D) fp32, partial lse (B, H, n, S) fp32; o like q; lse (B, H, n) fp32 (natural log).
// causal: query token i sees keys j <= i + len - n (the n new tokens are the last n entries of the cache).
// Needs sm_80 (bf16 conversion instruction).

#define NEG_INF (-__int_as_float(0x7f800000))
#define NWARPS 4
#define NT (32 * NWARPS)
#define BC 32    // keys per tile: one per lane
#define ROWS 32  // query rows per block (heads of a group x query tokens)
#define RPW (ROWS / NWARPS)  // rows per warp
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

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

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <class Ty, int D>
__device__ void decode_split(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                             const int* __restrict__ lens, float* __restrict__ opart, float* __restrict__ lpart,
                             int n, int m, int H, int Hk, int split_len, float scale, int causal) {
    constexpr int KS = D + 8;             // K row stride in halves: 16-byte rows offsets 4 banks apart, so the 8
                                          // lanes of a 16-byte load phase hit 8 different bank quads
    constexpr int PER_THREAD = ROWS * D / NT;  // accumulator elements per thread
    __shared__ __align__(16) float qs[ROWS][D];  // query rows, pre-multiplied by scale * log2(e)
    __shared__ __align__(16) u16 ks[BC][KS];
    __shared__ __align__(16) u16 vs[BC][D];
    __shared__ float ps[ROWS][BC];  // this tile's probabilities (unnormalised, against the running max)
    __shared__ float alpha[ROWS];   // this tile's rescale factor of each row's accumulator
    __shared__ float mfin[ROWS], lfin[ROWS];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int G = H / Hk, rows_total = G * n, chunks = (rows_total + ROWS - 1) / ROWS;
    const int hk = blockIdx.y / chunks, r0 = (blockIdx.y % chunks) * ROWS, b = blockIdx.z;
    const int nrows = min(ROWS, rows_total - r0);
    const int len = lens ? lens[b] : m;  // the launcher checked 0 <= lens[b] <= m
    const int kbeg = blockIdx.x * split_len, kend = min(len, kbeg + split_len);
    const int nsplit = gridDim.x;
    // The group's query rows are contiguous: head hk * G + g, token i is row g * n + i from the group's first row.
    const size_t row_base = ((size_t)b * H + (size_t)hk * G) * n + r0;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const float scale2 = scale * LOG2E;

    for (int i = threadIdx.x; i < ROWS * D; i += NT) {
        const int r = i / D, c = i % D;
        qs[r][c] = r < nrows ? Ty::load(q[(row_base + r) * D + c]) * scale2 : 0.f;
    }
    // This warp's rows are warp + NWARPS * rr; every lane keeps the same copy of their running max and sum.
    float mrow[RPW], lrow[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) mrow[rr] = NEG_INF, lrow[rr] = 0.f;
    float acc[PER_THREAD];
#pragma unroll
    for (int e = 0; e < PER_THREAD; ++e) acc[e] = 0.f;

    for (int k0 = kbeg; k0 < kend; k0 += BC) {
        __syncthreads();  // the previous tile's readers are done (first pass: qs is written)
        for (int i = threadIdx.x; i < BC * D / 8; i += NT) {
            const int j = i / (D / 8), c = (i % (D / 8)) * 8;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
            if (k0 + j < kend) {  // keys past this split / this cache's length read nothing and score -inf
                kx = *(const uint4*)(kb + (size_t)(k0 + j) * D + c);
                vx = *(const uint4*)(vb + (size_t)(k0 + j) * D + c);
            }
            *(uint4*)&ks[j][c] = kx;
            *(uint4*)&vs[j][c] = vx;
        }
        __syncthreads();

        // Scores of this warp's rows against key k0 + lane, then the online-softmax step of each row.
        const int key = k0 + lane;
        float s[RPW];
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) s[rr] = 0.f;
#pragma unroll 4
        for (int c = 0; c < D; c += 8) {
            const uint4 kx = *(const uint4*)&ks[lane][c];
            const u32 kw[4] = {kx.x, kx.y, kx.z, kx.w};
            float kf[8];
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                kf[2 * t] = Ty::load((u16)(kw[t] & 0xffffu));
                kf[2 * t + 1] = Ty::load((u16)(kw[t] >> 16));
            }
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr) {
                const float4 qa = *(const float4*)&qs[warp + NWARPS * rr][c];
                const float4 qb = *(const float4*)&qs[warp + NWARPS * rr][c + 4];
                s[rr] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                         qb.z * kf[6] + qb.w * kf[7];
            }
        }
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) {
            const int r = warp + NWARPS * rr;
            if (r >= nrows) break;  // uniform in the warp; rows past nrows are never used
            const int tok = (r0 + r) % n;
            const bool ok = key < kend && (!causal || key <= tok + len - n);
            const float sv = ok ? s[rr] : NEG_INF;
            const float mnew = fmaxf(mrow[rr], warp_max(sv));
            const float msafe = mnew == NEG_INF ? 0.f : mnew;  // nothing seen yet: exponents of -inf give 0, not nan
            const float p = exp2f(sv - msafe);
            const float a = exp2f(mrow[rr] - msafe);
            lrow[rr] = lrow[rr] * a + warp_sum(p);
            mrow[rr] = mnew;
            ps[r][lane] = p;
            if (lane == 0) alpha[r] = a;
        }
        __syncthreads();

        // acc (r, c) = alpha_r acc + sum_j p_rj v_jc. Element e of this thread is row (tid + NT e) / D, column
        // (tid + NT e) % D: a warp shares one row (D >= 32), so the row test is uniform and ps/alpha broadcast.
#pragma unroll
        for (int e = 0; e < PER_THREAD; ++e) {
            const int idx = threadIdx.x + NT * e, r = idx / D, c = idx % D;
            if (r < nrows) {
                float x = acc[e] * alpha[r];
#pragma unroll 8
                for (int j = 0; j < BC; ++j) x = fmaf(ps[r][j], Ty::load(vs[j][c]), x);
                acc[e] = x;
            }
        }
    }

    // Partial results of this split: o_s = acc / l, lse_s = (m + log2 l) ln 2; an empty split gives 0 and -inf.
    if (lane == 0) {
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) {
            mfin[warp + NWARPS * rr] = mrow[rr];
            lfin[warp + NWARPS * rr] = lrow[rr];
        }
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < PER_THREAD; ++e) {
        const int idx = threadIdx.x + NT * e, r = idx / D, c = idx % D;
        if (r < nrows) {
            const float l = lfin[r];
            const size_t row = row_base + r;
            opart[(row * nsplit + blockIdx.x) * D + c] = l > 0.f ? acc[e] / l : 0.f;
            if (c == 0) lpart[row * nsplit + blockIdx.x] = l > 0.f ? (mfin[r] + log2f(l)) * LN2 : NEG_INF;
        }
    }
}

// One query row per block: the logsumexp-weighted sum of the S partials. MT = 1024 threads; thread t owns column
// t % D for the splits s = t / D, t / D + MT / D, ... (8 groups of splits at D = 128, 16 at D = 64). Each thread
// merges its splits as it reads them, chapter 1's rule kept online (a running maximum, the sum of the weights and
// the weighted sum of its column, rescaled when the maximum grows), so that its loads of lse and o are all
// independent and in flight together; the groups meet once in shared memory at the end. History, measured with
// Nsight Compute on an H200 at S = 66 (a GQA step): one thread per column walking all S splits, a chain of S
// dependent loads, took 17 us; a share of the splits per thread but the maximum and the weight sum first, as two
// block reductions each after its own pass over lse, took 7.1 us (data/raw/ncu/ncu_decode_mma_gqa.txt).
#define MT 1024

// Launched as a programmatic dependent of the split kernel (decode(..., dependent_merge=True), sm_90 on), the merge
// kernel's blocks may be resident before the split grid ends, and wait here until that grid has ended and its
// partials are visible in global memory. After an ordinary launch the wait returns at once.
__device__ __forceinline__ void wait_for_split_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <class Ty, int D>
__device__ void decode_merge(const float* __restrict__ opart, const float* __restrict__ lpart, u16* __restrict__ o,
                             float* __restrict__ lse, int nsplit) {
    constexpr int GROUPS = MT / D;  // splits walked side by side, one group of D threads each
    __shared__ float part[GROUPS][D];
    __shared__ float gmax[GROUPS], gsum[GROUPS];
    const size_t row = blockIdx.x;
    const int t = threadIdx.x, c = t % D, grp = t / D;
    const float* lp = lpart + row * nsplit;
    const float* op = opart + row * nsplit * D;
    wait_for_split_grid();
    // This group's splits: mx its largest lse, w = sum of exp(lse_s - mx), x = sum of exp(lse_s - mx) o_s[c]. A
    // split that saw no key (lse -inf, o zeros) weighs 0; until a group has seen a key, mx stays -inf.
    float mx = NEG_INF, w = 0.f, x = 0.f;
    constexpr int BATCH = 8;  // splits whose loads are issued before the first of them is used
    for (int s0 = grp; s0 < nsplit; s0 += BATCH * GROUPS) {
        float ls[BATCH], os[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int s = s0 + j * GROUPS;
            ls[j] = s < nsplit ? lp[s] : NEG_INF;
            os[j] = s < nsplit ? op[(size_t)s * D + c] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const float nm = fmaxf(mx, ls[j]), ns = nm == NEG_INF ? 0.f : nm;  // no (-inf) - (-inf)
            const float a = expf(mx - ns);     // the old terms, rescaled to the new maximum (0 while mx is -inf)
            const float e = expf(ls[j] - ns);  // this split's weight (0 for an empty split)
            w = fmaf(w, a, e);
            x = fmaf(x, a, e * os[j]);
            mx = nm;
        }
    }
    part[grp][c] = x;
    if (c == 0) {  // every thread of a group walked the same splits: one writes the group's maximum and sum
        gmax[grp] = mx;
        gsum[grp] = w;
    }
    __syncthreads();
    if (t < D) {
        float m = NEG_INF;
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) m = fmaxf(m, gmax[g]);
        if (m == NEG_INF) {  // no split saw a key: the row's output is 0 and its lse -inf, as in the reference
            o[row * D + c] = Ty::store(0.f);
            if (c == 0) lse[row] = NEG_INF;
            return;
        }
        float wsum = 0.f, acc = 0.f;
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            const float a = expf(gmax[g] - m);  // 0 for a group that saw no key
            wsum = fmaf(gsum[g], a, wsum);
            acc = fmaf(part[g][c], a, acc);
        }
        o[row * D + c] = Ty::store(acc / wsum);
        if (c == 0) lse[row] = m + logf(wsum);
    }
}

#define DEFINE_KERNELS(DT, TY, D)                                                                                 \
    extern "C" __global__ void __launch_bounds__(NT)                                                              \
        decode_split_##DT##_d##D(const u16* q, const u16* k, const u16* v, const int* lens, float* opart,         \
                                 float* lpart, int n, int m, int H, int Hk, int split_len, float scale,           \
                                 int causal) {                                                                    \
        decode_split<TY, D>(q, k, v, lens, opart, lpart, n, m, H, Hk, split_len, scale, causal);                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(MT)                                                              \
        decode_merge_##DT##_d##D(const float* opart, const float* lpart, u16* o, float* lse, int nsplit) {        \
        decode_merge<TY, D>(opart, lpart, o, lse, nsplit);                                                        \
    }

DEFINE_KERNELS(f16, F16, 64)
DEFINE_KERNELS(f16, F16, 128)
DEFINE_KERNELS(bf16, BF16, 64)
DEFINE_KERNELS(bf16, BF16, 128)
