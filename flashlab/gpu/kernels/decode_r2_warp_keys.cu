// Split-KV decoding, second version: every warp streams its own keys, straight from global memory.
//
// What was wrong with decode_r1_split.cu at batch 1: its block gave each warp a share of the *query rows* and
// had every lane score one key of a shared 32-key tile. With one new token per head (n = 1, no GQA) a block has
// one row, so three warps of four scored rows of zeros and the fourth scored one row on its own; each 16 KB
// tile went through shared memory between three barriers, so a block had one tile in flight at a time. Measured
// on an H200: 6.6x the time to read the cache once (data/ch8/decode.json).
//
// Here the *keys* are shared out. A warp takes chunks of KW keys (a block's four warps take interleaved chunks of
// its split) and a key's D halves are spread over LPK = D / 8 lanes, 16 bytes each, so one 16-byte load per lane
// brings KPS = 32 / LPK keys per warp. Before it uses any of them a lane issues all U loads of K and all U of V
// for its chunk: 256 bytes per lane in flight, with no shared memory and no barrier until the split is done. The
// R query rows of the block (heads of a GQA group x query tokens; R = 1 at batch-1 decoding without GQA) live in
// registers: a lane keeps its 8 columns of each row, scaled by scale * log2(e). Per chunk:
//     s[r][u]  = dot over the key's LPK lanes (8 FMAs, then log2(LPK) xor-shuffles)
//     running max m[r] over the whole warp (the same in every lane), p = exp2(s - m), the accumulator and the
//     lane's partial sum l[r] rescaled by exp2(m_old - m) as in chapter 1
//     acc[r][0..7] += p[r][u] * v[u][0..7]  (a lane's 8 columns, summed over its own keys only)
// At the end the lanes that hold the same columns for different keys add up (xor-shuffles), the four warps merge
// their (m, l, acc) through shared memory with the same rule, and the block writes its split's partial (o_s,
// lse_s) exactly as decode_r1_split.cu does, so the merge kernel there (decode_merge_*) finishes the job.
//
// Grid: (row_chunks, num_splits, B * Hk), NW warps. Row chunks of one K/V head are neighbours in the launch
// order, so when a group has more than R rows the chunks read the same keys at about the same time (L2 hits).
// Layout and arguments as decode_split_* in decode_r1_split.cu. Builds for sm_75 and newer: plain CUDA, bf16 read
// by shifting its bits (flashlab.gpu.decoding.MIN_CC).

#define NEG_INF (-__int_as_float(0x7f800000))
#define NW 4
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
};
struct BF16 {
    static __device__ __forceinline__ float load(u16 x) { return __uint_as_float((u32)x << 16); }
};

template <class Ty>
__device__ __forceinline__ void unpack8(const uint4& x, float* f) {
    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        f[2 * t] = Ty::load((u16)(w[t] & 0xffffu));
        f[2 * t + 1] = Ty::load((u16)(w[t] >> 16));
    }
}

// R: query rows per block (registers for R rows are always there; rows >= nrows are skipped, warp-uniformly).
// U: 16-byte loads of K (and of V) per lane in flight, i.e. KW = U * KPS keys per warp chunk.
template <class Ty, int D, int R, int U>
__device__ void decode_keys(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                            const int* __restrict__ lens, float* __restrict__ opart, float* __restrict__ lpart,
                            int n, int m, int H, int Hk, int split_len, float scale, int causal) {
    constexpr int LPK = D / 8;        // lanes per key
    constexpr int KPS = 32 / LPK;     // keys per warp-wide load
    constexpr int KW = U * KPS;       // keys per warp chunk
    __shared__ float wm[NW][R], wl[NW][R];
    __shared__ __align__(16) float wacc[NW][R][D];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int sub = lane / LPK, col = (lane % LPK) * 8;  // which key of a load, which 8 columns
    const int G = H / Hk, rows_total = G * n;
    const int r0 = blockIdx.x * R, split = blockIdx.y, nsplit = gridDim.y;
    const int b = blockIdx.z / Hk, hk = blockIdx.z % Hk;
    const int nrows = min(R, rows_total - r0);
    const int len = lens ? lens[b] : m;  // the launcher checked 0 <= lens[b] <= m
    const int kbeg = split * split_len, kend = min(len, kbeg + split_len);
    const size_t row_base = ((size_t)b * H + (size_t)hk * G) * n + r0;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D + col;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D + col;
    const float scale2 = scale * LOG2E;

    float qr[R][8], acc[R][8], mrow[R], lrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        mrow[r] = NEG_INF, lrow[r] = 0.f;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (r < nrows) x = *(const uint4*)(q + (row_base + r) * D + col);
        unpack8<Ty>(x, qr[r]);
#pragma unroll
        for (int c = 0; c < 8; ++c) qr[r][c] *= scale2, acc[r][c] = 0.f;
    }

    for (int c0 = kbeg + warp * KW; c0 < kend; c0 += NW * KW) {
        uint4 kx[U], vx[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // every load of the chunk is issued before any is used
            const int key = c0 + u * KPS + sub;
            kx[u] = vx[u] = make_uint4(0, 0, 0, 0);
            if (key < kend) {
                kx[u] = *(const uint4*)(kb + (size_t)key * D);
                vx[u] = *(const uint4*)(vb + (size_t)key * D);
            }
        }
        float s[R][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            unpack8<Ty>(kx[u], kf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float x = 0.f;
#pragma unroll
                for (int c = 0; c < 8; ++c) x = fmaf(qr[r][c], kf[c], x);
                s[r][u] = x;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r >= nrows) break;  // uniform in the block
            const int last = causal ? (r0 + r) % n + len - n : kend;  // the last key row r may see
            float mx = NEG_INF;
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) s[r][u] += __shfl_xor_sync(0xffffffffu, s[r][u], o);
                const int key = c0 + u * KPS + sub;
                if (key >= kend || key > last) s[r][u] = NEG_INF;
                mx = fmaxf(mx, s[r][u]);
            }
#pragma unroll
            for (int o = LPK; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mnew = fmaxf(mrow[r], mx);
            const float msafe = mnew == NEG_INF ? 0.f : mnew;  // nothing seen yet: exponents of -inf give 0, not nan
            const float a = exp2f(mrow[r] - msafe);
            mrow[r] = mnew;
            float lsum = 0.f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                s[r][u] = exp2f(s[r][u] - msafe);
                lsum += s[r][u];
            }
            lrow[r] = lrow[r] * a + lsum;
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[r][c] *= a;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float vf[8];
            unpack8<Ty>(vx[u], vf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r >= nrows) break;
#pragma unroll
                for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(s[r][u], vf[c], acc[r][c]);
            }
        }
    }

    // Lanes with the same columns hold different keys: add them up (m is already the same in every lane).
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int o = LPK; o < 32; o <<= 1) {
            lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], o);
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], o);
        }
        if (sub == 0) {
#pragma unroll
            for (int c = 0; c < 8; ++c) wacc[warp][r][col + c] = acc[r][c];
        }
        if (lane == 0) wm[warp][r] = mrow[r], wl[warp][r] = lrow[r];
    }
    __syncthreads();

    // The warps' states merged with chapter 1's rule; thread i writes columns i, i + NT.. of every row.
    for (int i = threadIdx.x; i < nrows * D; i += NW * 32) {
        const int r = i / D, c = i % D;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) mx = fmaxf(mx, wm[w][r]);
        const float msafe = mx == NEG_INF ? 0.f : mx;
        float l = 0.f, x = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float e = exp2f(wm[w][r] - msafe);  // a warp that saw nothing: exp2(-inf) = 0
            l += e * wl[w][r];
            x += e * wacc[w][r][c];
        }
        const size_t row = row_base + r;
        opart[(row * nsplit + split) * D + c] = l > 0.f ? x / l : 0.f;
        if (c == 0) lpart[row * nsplit + split] = l > 0.f ? (mx + log2f(l)) * LN2 : NEG_INF;
    }
}

// MINB (blocks per SM) sets ptxas' register cap: without it the R = 4 kernels were held to 168 registers and
// spilled; R = 1 within 102 registers keeps five blocks (20 warps, 40 KB of loads in flight) on an SM.
#define DEFINE_KERNEL(DT, TY, D, R, U, MINB)                                                                      \
    extern "C" __global__ void __launch_bounds__(NW * 32, MINB)                                                   \
        decode_keys_##DT##_d##D##_r##R(const u16* q, const u16* k, const u16* v, const int* lens, float* opart,   \
                                       float* lpart, int n, int m, int H, int Hk, int split_len, float scale,     \
                                       int causal) {                                                              \
        decode_keys<TY, D, R, U>(q, k, v, lens, opart, lpart, n, m, H, Hk, split_len, scale, causal);            \
    }
// Loads in flight (U) and blocks per SM (MINB) of the R = 2, 4 and 8 kernels (the GQA groups) are defines, so that
// a sweep can build other pairs beside the defaults (flashlab.gpu.kernel_function(..., defines=...)).
#ifndef U_R2
#define U_R2 8
#endif
#ifndef MINB_R2
#define MINB_R2 4
#endif
// R = 4 (a GQA group of 4 heads at n = 1): on sm_90 half the loads in flight and twice the blocks, 128 registers,
// measured faster on the H200 (docs/kernels.md, "Split-KV decoding"); elsewhere that pair spills 4 bytes (sm_80,
// sm_86), so the first choice stays there.
#if !defined(U_R4) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define U_R4 4
#define MINB_R4 4
#endif
#ifndef U_R4
#define U_R4 8
#endif
#ifndef MINB_R4
#define MINB_R4 2
#endif
#ifndef U_R8
#define U_R8 4
#endif
#ifndef MINB_R8
#define MINB_R8 2
#endif
#define DEFINE_ROWS(DT, TY, D) \
    DEFINE_KERNEL(DT, TY, D, 1, 8, 5) \
    DEFINE_KERNEL(DT, TY, D, 2, U_R2, MINB_R2) \
    DEFINE_KERNEL(DT, TY, D, 4, U_R4, MINB_R4) \
    DEFINE_KERNEL(DT, TY, D, 8, U_R8, MINB_R8)

DEFINE_ROWS(f16, F16, 64)
DEFINE_ROWS(f16, F16, 128)
DEFINE_ROWS(bf16, BF16, 64)
DEFINE_ROWS(bf16, BF16, 128)
