// Hopper rung 3 -- warp specialisation: a producer warpgroup and two consumers. Needs sm_90a (H100, H200).
//
// Change from rung 2: in rung 2 every warp both waited for copies and computed, and one barrier per tile held all
// of them together. Here the block has three warpgroups with one job each. The producer (warpgroup 0; one thread
// works) only issues TMA copies into a ring of STAGES stages; the two consumers (warpgroups 1 and 2, 64 query
// rows each) only compute. Two mbarriers per stage connect them: "full" (the copy engine's bytes have landed:
// consumers wait for parity (t / STAGES) % 2) and "empty" (all 256 consumer threads have arrived: the producer
// waits for parity (t / STAGES - 1) % 2 before refilling the stage with tile t). No __syncthreads after the
// start: each warpgroup runs ahead as far as the ring lets it. The producer needs few registers and gives them
// back (setmaxnreg.dec to 40); the consumers take them (setmaxnreg.inc to 232), under the block's 384-thread
// cap of 168. Everything in a consumer's tile is rung 2's.
//
// Inputs fp16 or bf16 by tensor maps as in rung 2 (boxes of 64 rows for q, BC for k and v). Grid:
// (ceil(n / 128), H, B); block: 384 threads; dynamic shared memory: (128 + 2 * STAGES * BC) * D * 2 + 1024 + 64
// bytes.
#include "wgmma.cuh"
#include "tma.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 128  // query rows per block: 64 per consumer warpgroup
#define NTHREADS 384  // a producer warpgroup and two consumers
#ifndef STAGES
#define STAGES 2
#endif
// The host reserves 64 bytes of barriers (flashlab.gpu.HOPPER_RUNGS) and 2 stages of K and V.
static_assert(STAGES == 2, "flashlab.gpu.HOPPER_RUNGS sizes shared memory for 2 stages");
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

template <class Ty, int D, int BC>
__device__ void attn_specialized(const TensorMap* qmap, const TensorMap* kmap, const TensorMap* vmap,
                                 u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk,
                                 float scale, int causal) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 qs0 = (smem_u32(smem_raw) + 1023) & ~1023u;  // two 64-row tiles of Q, one per consumer
    const u32 kbuf = qs0 + BR * D * 2;                      // STAGES stages of [BC][D]
    const u32 vbuf = kbuf + STAGES * BC * D * 2;
    const u32 qbar = vbuf + STAGES * BC * D * 2, full = qbar + 8, empty = full + 8 * STAGES;

    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;  // causal: longest blocks first
    const int block_kend = causal ? min(m, min(q0 + BR, n) + (m - n)) : m;
    const int ntiles = block_kend > 0 ? (block_kend + BC - 1) / BC : 0;
    const int role = threadIdx.x / 128;  // 0: the producer, 1 and 2: the consumers

    if (threadIdx.x == 0) {
        mbar_init(qbar, 1);
#pragma unroll
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(full + 8 * st, 1);
            mbar_init(empty + 8 * st, 2 * 128);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (role == 0) {  // ---------------------------------------------------------------- the producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            mbar_expect_tx(qbar, BR * D * 2);
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int p = 0; p < D / 64; ++p)
                    tma_load_3d(qs0 + c * 64 * D * 2 + p * 64 * 128, qmap, 64 * p, q0 + 64 * c, b * H + h, qbar);
            for (int t = 0; t < ntiles; ++t) {
                const int st = t % STAGES;
                if (t >= STAGES)  // the consumers' release of this stage's last tile, t - STAGES
                    while (!mbar_try_wait(empty + 8 * st, ((t / STAGES) + 1) & 1)) {
                    }
                const u32 bar = full + 8 * st;
                mbar_expect_tx(bar, 2 * BC * D * 2);
#pragma unroll
                for (int p = 0; p < D / 64; ++p) {
                    tma_load_3d(kbuf + st * BC * D * 2 + p * BC * 128, kmap, 64 * p, t * BC, b * Hk + hk, bar);
                    tma_load_3d(vbuf + st * BC * D * 2 + p * BC * 128, vmap, 64 * p, t * BC, b * Hk + hk, bar);
                }
            }
        }
        return;
    }
    // ----------------------------------------------------------------------------------------- a consumer
    setmaxnreg_inc<232>();
    const int c = role - 1, tid = threadIdx.x - 128 * role;
    const int warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, tg = lane & 3;
    const int r0 = q0 + 64 * c;  // this warpgroup's first row
    const u32 qs = qs0 + c * 64 * D * 2;
    // This thread holds rows 16 warp + g and + 8 of the warpgroup; the first may see keys below kbase (causal).
    const int kbase = causal ? r0 + 16 * warp + g + (m - n) + 1 : m;
    const int my_kend = causal ? min(m, min(r0 + 64, n) + (m - n)) : m;
    const int my_tiles = my_kend > 0 ? (my_kend + BC - 1) / BC : 0;  // past these, every key is masked
    const int mask_from = causal ? min(r0 + (m - n) + 2 - BC, m - BC + 1) : m - BC + 1;
    const float scale2 = scale * LOG2E;

    float oacc[D / 2], s[BC / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) oacc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) s[i] = 0.f;
    float mx0 = NEG_INF, mx1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    while (!mbar_try_wait(qbar, 0)) {  // (also when there is no tile: Q's copy must land before the block exits)
    }
    for (int t = 0; t < ntiles; ++t) {
        const int k0 = t * BC, st = t % STAGES;
        const u32 ks = kbuf + st * BC * D * 2, vs = vbuf + st * BC * D * 2;
        while (!mbar_try_wait(full + 8 * st, (t / STAGES) & 1)) {
        }
        if (t < my_tiles) {
            // S = Q K^T: one wgmma per 16 columns of d; the k16 step kk is 32 bytes along the 128-byte rows of
            // panel kk / 4.
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 qa = qs + (kk / 4) * 64 * 128 + (kk % 4) * 32;
                const u32 ka = ks + (kk / 4) * BC * 128 + (kk % 4) * 32;
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
        }
        mbar_arrive(empty + 8 * st);  // this thread is done with the stage (every consumer thread arrives)
    }

    u16* ob = o + ((size_t)b * H + h) * n * D;
    float* lb = lse + ((size_t)b * H + h) * n;
    const int row0 = r0 + 16 * warp + g, row1 = row0 + 8;
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

// Keys per tile as in rungs 1 and 2.
#define DEFINE_KERNEL(NAME, TY, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                 \
        NAME(const __grid_constant__ TensorMap qmap, const __grid_constant__ TensorMap kmap,                  \
             const __grid_constant__ TensorMap vmap, u16* o, float* lse, int n, int m, int H, int Hk,         \
             float scale, int causal) {                                                                       \
        attn_specialized<TY, D, (D == 128 ? 64 : 128)>(&qmap, &kmap, &vmap, o, lse, n, m, H, Hk, scale,      \
                                                        causal);                                              \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
