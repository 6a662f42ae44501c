// Hopper rung 5 -- a third stage in the ring. Needs sm_90a (H100, H200).
//
// Change from rung 4: STAGES = 3. With two stages the producer may copy tile t + 1 only once tile t - 1's stage
// is released, at the end of turn t - 1 + 1 = t (its P V ran in turn t): the copy of the next tile then has one
// turn to land, and a late one stalls both consumers. A third stage gives each copy two turns. Shared memory:
// Q + 3 * (K + V) = 32 + 192 KB at d = 128 with 128-key tiles, inside the 227 KB a block may have on sm_90.
// Nothing else changes: the parities of every wait follow from the stage count (flashlab.pipeline.ring_schedule).
//
// Inputs fp16 or bf16 by tensor maps as in rung 2 (boxes of 64 rows for q, BC = 128 for k and v). Grid:
// (ceil(n / 128), H, B); block: 384 threads; dynamic shared memory: (128 + 2 * STAGES * BC) * D * 2 + 1024 + 128
// bytes.
#include "wgmma.cuh"
#include "tma.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 128  // query rows per block: 64 per consumer warpgroup
#define BC 128  // keys per tile
#define NTHREADS 384  // a producer warpgroup and two consumers
#define STAGES 3
// The host reserves 128 bytes of barriers (flashlab.gpu.HOPPER_RUNGS: 1 + 3 * STAGES of 8 bytes) and 3 stages.
static_assert(8 * (1 + 3 * STAGES) <= 128, "the barriers must fit the 128 bytes the host reserves");
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

template <class Ty, int D>
__device__ void attn_three_stages(const TensorMap* qmap, const TensorMap* kmap, const TensorMap* vmap,
                             u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk, float scale,
                             int causal) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 qs0 = (smem_u32(smem_raw) + 1023) & ~1023u;  // two 64-row tiles of Q, one per consumer
    const u32 kbuf = qs0 + BR * D * 2;                      // STAGES stages of [BC][D]
    const u32 vbuf = kbuf + STAGES * BC * D * 2;
    // mbarriers: Q's, then per stage K's "full", V's "full" and the stage's "empty"
    const u32 qbar = vbuf + STAGES * BC * D * 2, fullk = qbar + 8, fullv = fullk + 8 * STAGES,
              empty = fullv + 8 * STAGES;

    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;  // causal: longest blocks first
    const int block_kend = causal ? min(m, min(q0 + BR, n) + (m - n)) : m;
    const int ntiles = block_kend > 0 ? (block_kend + BC - 1) / BC : 0;
    const int role = threadIdx.x / 128;  // 0: the producer, 1 and 2: the consumers

    if (threadIdx.x == 0) {
        mbar_init(qbar, 1);
#pragma unroll
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(fullk + 8 * st, 1);
            mbar_init(fullv + 8 * st, 1);
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
                const u32 kb = fullk + 8 * st, vb = fullv + 8 * st;
                mbar_expect_tx(kb, BC * D * 2);
#pragma unroll
                for (int p = 0; p < D / 64; ++p)
                    tma_load_3d(kbuf + st * BC * D * 2 + p * BC * 128, kmap, 64 * p, t * BC, b * Hk + hk, kb);
                mbar_expect_tx(vb, BC * D * 2);
#pragma unroll
                for (int p = 0; p < D / 64; ++p)
                    tma_load_3d(vbuf + st * BC * D * 2 + p * BC * 128, vmap, 64 * p, t * BC, b * Hk + hk, vb);
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
    const int mine = 1 + c, other = 2 - c;  // named barriers: "consumer c may issue" is barrier 1 + c

    float oacc[D / 2], s[BC / 2];
    u32 pa[BC / 16][4];  // P_{t-1} in the A fragment layout: k16 step kk takes the 8-key blocks 2 kk and 2 kk + 1
#pragma unroll
    for (int i = 0; i < D / 2; ++i) oacc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) s[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BC / 16; ++i) pa[i][0] = pa[i][1] = pa[i][2] = pa[i][3] = 0u;
    float mx0 = NEG_INF, mx1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    while (!mbar_try_wait(qbar, 0)) {  // (also when there is no tile: Q's copy must land before the block exits)
    }
    if (c == 1) named_bar_arrive(1, 256);  // consumer 0 takes the first turn

    // Turn t issues S_t (t < ntiles) and P_{t-1} V_{t-1} (t > 0); both consumers take turns 0 .. ntiles. Before
    // its turn a consumer waits for the tiles the turn reads, so that it releases a stage only after its copies
    // have landed (a consumer with nothing to compute cannot run ahead and release a stage twice).
    auto wait_tiles = [&](int t) {
        if (t < ntiles)
            while (!mbar_try_wait(fullk + 8 * (t % STAGES), (t / STAGES) & 1)) {
            }
        if (t > 0)
            while (!mbar_try_wait(fullv + 8 * ((t - 1) % STAGES), ((t - 1) / STAGES) & 1)) {
            }
    };
    auto hand_over = [&](int t) {  // the other consumer's turn (consumer 1's last turn has no one to hand to)
        if (!(c == 1 && t == ntiles)) named_bar_arrive(other, 256);
    };
    auto release = [&](int t) {  // tile t - 1's stage: K read by S_{t-1}, V by P_{t-1} V_{t-1}
        if (t > 0) mbar_arrive(empty + 8 * ((t - 1) % STAGES));
    };
    // S_t = Q K_t^T: one wgmma per 16 columns of d (32 bytes along the 128-byte rows of panel kk / 4).
    auto issue_s = [&](int t) {
        const u32 ks = kbuf + (t % STAGES) * BC * D * 2;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 qa = qs + (kk / 4) * 64 * 128 + (kk % 4) * 32;
            const u32 ka = ks + (kk / 4) * BC * 128 + (kk % 4) * 32;
            Wgmma<BC>::template ss<Ty::bf16>(s, descriptor(qa, 16, 1024), descriptor(ka, 16, 1024), kk > 0);
        }
        wgmma_commit();
    };
    // O += P_{t-1} V_{t-1}: one wgmma per 16 keys (16 rows, 2048 bytes, down V's panels, BC * 128 bytes apart).
    auto issue_pv = [&](int t) {
        const u32 vs = vbuf + ((t - 1) % STAGES) * BC * D * 2;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            Wgmma<D>::template rs<Ty::bf16>(oacc, pa[kk], descriptor(vs + kk * 2048, BC * 128, 1024), 1);
        wgmma_commit();
    };
    // Online softmax in base 2 of S_t on this thread's two rows, written over S_t; mask only where needed.
    // Returns through c0, c1 the factors that bring O to the new maxima.
    auto softmax = [&](int t, float& c0, float& c1) {
        const int k0 = t * BC;
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
        c0 = ex2(mx0 - ms0);
        c1 = ex2(mx1 - ms1);
        float r0 = 0.f, r1 = 0.f;
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) {
            s[4 * j] = ex2(s[4 * j] - ms0);
            s[4 * j + 1] = ex2(s[4 * j + 1] - ms0);
            s[4 * j + 2] = ex2(s[4 * j + 2] - ms1);
            s[4 * j + 3] = ex2(s[4 * j + 3] - ms1);
            r0 += s[4 * j] + s[4 * j + 1];
            r1 += s[4 * j + 2] + s[4 * j + 3];
        }
        l0 = l0 * c0 + r0;
        l1 = l1 * c1 + r1;
        mx0 = mn0;
        mx1 = mn1;
    };
    // O holds the sum through tile t - 1: bring it to S_t's maxima, and P_t into the A layout for turn t + 1.
    auto rescale_and_pack = [&](float c0, float c1) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            oacc[4 * j] *= c0;
            oacc[4 * j + 1] *= c0;
            oacc[4 * j + 2] *= c1;
            oacc[4 * j + 3] *= c1;
        }
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) {
            pa[j / 2][(j & 1) * 2] = Ty::pack(s[4 * j], s[4 * j + 1]);
            pa[j / 2][(j & 1) * 2 + 1] = Ty::pack(s[4 * j + 2], s[4 * j + 3]);
        }
    };

    // Each kind of turn is straight-line code, so that every wgmma in flight is waited for on the path that issued
    // it (ptxas serialises wgmma whose completion it cannot follow through branches).
    int t = 0;
    if (my_tiles > 0) {  // turn 0: S_0 alone
        float c0, c1;
        wait_tiles(0);
        named_bar_sync(mine, 256);
        issue_s(0);
        hand_over(0);
        wgmma_wait<0>();
        pin<BC / 2>(s);
        softmax(0, c0, c1);
        rescale_and_pack(c0, c1);
        for (t = 1; t < my_tiles; ++t) {  // turns 1 .. my_tiles - 1: S_t, then P_{t-1} V_{t-1} under S_t's softmax
            wait_tiles(t);
            named_bar_sync(mine, 256);
            issue_s(t);
            issue_pv(t);
            hand_over(t);
            wgmma_wait<1>();  // S_t only; P_{t-1} V_{t-1} keeps running under this softmax
            pin<BC / 2>(s);
            softmax(t, c0, c1);
            wgmma_wait<0>();
            pin<D / 2>(oacc);
            release(t);
            rescale_and_pack(c0, c1);
        }
        // turn my_tiles: the last product
        wait_tiles(t);
        named_bar_sync(mine, 256);
        issue_pv(t);
        hand_over(t);
        wgmma_wait<0>();
        pin<D / 2>(oacc);
        release(t);
        ++t;
    }
    for (; t <= ntiles; ++t) {  // turns past this consumer's causal end: nothing to compute, the turn still taken
        wait_tiles(t);
        named_bar_sync(mine, 256);
        hand_over(t);
        release(t);
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

#define DEFINE_KERNEL(NAME, TY, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                 \
        NAME(const __grid_constant__ TensorMap qmap, const __grid_constant__ TensorMap kmap,                  \
             const __grid_constant__ TensorMap vmap, u16* o, float* lse, int n, int m, int H, int Hk,         \
             float scale, int causal) {                                                                       \
        attn_three_stages<TY, D>(&qmap, &kmap, &vmap, o, lse, n, m, H, Hk, scale, causal);                        \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
