// Hopper rung 2 -- tiles copied by the tensor memory accelerator (TMA). Needs sm_90a (H100, H200).
//
// Change from rung 1: Q, K and V no longer come in by cp.async, 16 bytes per thread per instruction, each thread
// computing its own addresses, swizzle and bounds (at d = 128 a 64-key tile of K and V is 2048 copies, 16 per
// thread). One thread asks the copy engine for each 64-column panel of a tile with one instruction,
// cp.async.bulk.tensor, naming only the panel's coordinates in a tensor map the host built once: the engine
// computes the addresses, writes the 128-byte swizzle that wgmma reads, and fills rows past the end of the
// sequence with zeros. An mbarrier per stage says when a tile's bytes have all landed; the threads wait on its
// phase (stage t % 2, parity (t / 2) % 2) instead of on cp.async groups, and no fence.proxy.async is needed: the
// copy engine and the tensor cores are both the async proxy. Everything else is rung 1.
//
// Inputs fp16 or bf16, given by tensor maps (flashlab.gpu.hopper.tensor_map): q as (B * H, n, D), k and v as
// (B * Hk, m, D), boxes of 64 columns by 64 (q) or BC (k, v) rows, 128-byte swizzle. o (B, H, n, D) like q,
// lse (B, H, n) fp32. Grid: (ceil(n / 64), H, B); block: 128 threads; dynamic shared memory:
// (64 + 4 * BC) * D * 2 + 1024 + 64 bytes.
#include "wgmma.cuh"
#include "tma.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 64
#define NTHREADS 128
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

template <class Ty, int D, int BC>
__device__ void attn_tma(const TensorMap* qmap, const TensorMap* kmap, const TensorMap* vmap, u16* __restrict__ o,
                         float* __restrict__ lse, int n, int m, int H, int Hk, float scale, int causal) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 qs = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms start on 1024-byte boundaries
    const u32 kbuf = qs + BR * D * 2;                     // two stages of [BC][D]
    const u32 vbuf = kbuf + 2 * BC * D * 2;               // two stages of [BC][D]
    const u32 qbar = vbuf + 2 * BC * D * 2, full = qbar + 8;  // mbarriers: Q's, and one per stage

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;  // causal: longest blocks first
    // This thread holds rows 16 warp + g and + 8 of the block; the first may see keys below kbase (causal).
    const int kbase = causal ? q0 + 16 * warp + g + (m - n) + 1 : m;
    const int block_kend = causal ? min(m, min(q0 + BR, n) + (m - n)) : m;
    const int ntiles = block_kend > 0 ? (block_kend + BC - 1) / BC : 0;
    const int mask_from = causal ? min(q0 + (m - n) + 2 - BC, m - BC + 1) : m - BC + 1;
    const float scale2 = scale * LOG2E;

    // One thread issues every copy; each 64-column panel of a tile is one box.
    auto load_kv = [&](int t) {
        const u32 stage = (t & 1) * BC * D * 2, bar = full + (t & 1) * 8;
        mbar_expect_tx(bar, 2 * BC * D * 2);
#pragma unroll
        for (int p = 0; p < D / 64; ++p) {
            tma_load_3d(kbuf + stage + p * BC * 128, kmap, 64 * p, t * BC, b * Hk + hk, bar);
            tma_load_3d(vbuf + stage + p * BC * 128, vmap, 64 * p, t * BC, b * Hk + hk, bar);
        }
    };
    if (threadIdx.x == 0) {
        mbar_init(qbar, 1);
        mbar_init(full, 1);
        mbar_init(full + 8, 1);
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_expect_tx(qbar, BR * D * 2);
#pragma unroll
        for (int p = 0; p < D / 64; ++p) tma_load_3d(qs + p * BR * 128, qmap, 64 * p, q0, b * H + h, qbar);
        if (ntiles > 0) load_kv(0);
    }

    float oacc[D / 2], s[BC / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) oacc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) s[i] = 0.f;
    float mx0 = NEG_INF, mx1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    for (int t = 0; t < ntiles; ++t) {
        const int k0 = t * BC;
        const u32 ks = kbuf + (t & 1) * BC * D * 2, vs = vbuf + (t & 1) * BC * D * 2;
        // The other stage was released by the barrier that ended the last iteration: refill it.
        if (threadIdx.x == 0 && t + 1 < ntiles) load_kv(t + 1);
        if (t == 0)
            while (!mbar_try_wait(qbar, 0)) {
            }
        while (!mbar_try_wait(full + (t & 1) * 8, (t >> 1) & 1)) {
        }

        // S = Q K^T: one wgmma per 16 columns of d; the k16 step kk is 32 bytes along the 128-byte rows of
        // panel kk / 4.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 qa = qs + (kk / 4) * BR * 128 + (kk % 4) * 32, ka = ks + (kk / 4) * BC * 128 + (kk % 4) * 32;
            Wgmma<BC>::template ss<Ty::bf16>(s, descriptor(qa, 16, 1024), descriptor(ka, 16, 1024), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin<BC / 2>(s);

        // Online softmax in base 2 on this thread's two rows; mask only where needed.
        const bool need_mask = k0 >= mask_from;
        float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[4 * j + e] * scale2;
                if (need_mask) {
                    const int lim = causal ? min(m, kbase + (e >> 1) * 8) : m;
                    if (k0 + 8 * j + 2 * tg + (e & 1) >= lim) x = NEG_INF;
                }
                s[4 * j + e] = x;
            }
            t0 = fmaxf(t0, fmaxf(s[4 * j], s[4 * j + 1]));
            t1 = fmaxf(t1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        const float mn0 = fmaxf(mx0, quad_max(t0)), mn1 = fmaxf(mx1, quad_max(t1));
        const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;
        const float c0 = ex2(mx0 - ms0), c1 = ex2(mx1 - ms1);
        float r0 = 0.f, r1 = 0.f;
        u32 pa[BC / 16][4];  // P in the A fragment layout: k16 step kk takes the 8-key blocks 2 kk and 2 kk + 1
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) {
            const float p0 = ex2(s[4 * j] - ms0), p1 = ex2(s[4 * j + 1] - ms0);
            const float p2 = ex2(s[4 * j + 2] - ms1), p3 = ex2(s[4 * j + 3] - ms1);
            r0 += p0 + p1;
            r1 += p2 + p3;
            pa[j / 2][(j & 1) * 2] = Ty::pack(p0, p1);
            pa[j / 2][(j & 1) * 2 + 1] = Ty::pack(p2, p3);
        }
        l0 = l0 * c0 + r0;
        l1 = l1 * c1 + r1;
        mx0 = mn0;
        mx1 = mn1;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            oacc[4 * j] *= c0;
            oacc[4 * j + 1] *= c0;
            oacc[4 * j + 2] *= c1;
            oacc[4 * j + 3] *= c1;
        }

        // O += P V: one wgmma per 16 keys; the k16 step kk is 16 rows (2048 bytes) down V's panels, and the
        // panels of d (64 columns each) are BC * 128 bytes apart.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            Wgmma<D>::template rs<Ty::bf16>(oacc, pa[kk], descriptor(vs + kk * 2048, BC * 128, 1024), 1);
        wgmma_commit();
        wgmma_wait<0>();
        pin<D / 2>(oacc);
        __syncthreads();  // every warp is done with this buffer before the next iteration refills it
    }
    if (ntiles == 0)  // no key tile: Q's copy must still land before the block may exit
        while (!mbar_try_wait(qbar, 0)) {
        }

    u16* ob = o + ((size_t)b * H + h) * n * D;
    float* lb = lse + ((size_t)b * H + h) * n;
    const int row0 = q0 + 16 * warp + g, row1 = row0 + 8;
    const float s0 = quad_sum(l0), s1 = quad_sum(l1);
    const float i0 = s0 > 0.f ? 1.f / s0 : 0.f, i1 = s1 > 0.f ? 1.f / s1 : 0.f;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        const int c = 8 * j + 2 * tg;
        if (row0 < n) *(u32*)(ob + (size_t)row0 * D + c) = Ty::pack(oacc[4 * j] * i0, oacc[4 * j + 1] * i0);
        if (row1 < n) *(u32*)(ob + (size_t)row1 * D + c) = Ty::pack(oacc[4 * j + 2] * i1, oacc[4 * j + 3] * i1);
    }
    if (tg == 0) {
        if (row0 < n) lb[row0] = s0 > 0.f ? (mx0 + __log2f(s0)) * LN2 : NEG_INF;
        if (row1 < n) lb[row1] = s1 > 0.f ? (mx1 + __log2f(s1)) * LN2 : NEG_INF;
    }
}

// Keys per tile as in rung 1.
#define DEFINE_KERNEL(NAME, TY, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(NTHREADS)                                                    \
        NAME(const __grid_constant__ TensorMap qmap, const __grid_constant__ TensorMap kmap,                  \
             const __grid_constant__ TensorMap vmap, u16* o, float* lse, int n, int m, int H, int Hk,         \
             float scale, int causal) {                                                                       \
        attn_tma<TY, D, (D == 128 ? 64 : 128)>(&qmap, &kmap, &vmap, o, lse, n, m, H, Hk, scale, causal);     \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
