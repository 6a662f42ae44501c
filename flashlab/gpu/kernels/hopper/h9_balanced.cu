// Hopper rung 9 -- a balanced causal schedule. Needs sm_90a (H100, H200).
//
// Change from rung 8: the order in which the persistent blocks take the output tiles when the mask is causal.
// Rung 8 walked each head's query blocks longest first, gridDim.x apart; with the mask, a query block's key tiles
// grow with its index, so a block's share depended on which query blocks its stride happened to hit: on an H200
// (132 SMs) at n = 16384 the busiest block had 1.57x an even share, and the grid waited for it. Here the causal
// tiles are ranked over all heads and batch entries at once, longest first (the head and batch entry vary fastest
// within a rank), and dealt out as cards in a snake: round r gives slot r * gridDim.x + k to block k when r is
// even and to block gridDim.x - 1 - k when r is odd, so the block that took the longest tile of one round takes
// the shortest of the next. The tiles of one rank have the same length and the next rank's are one key tile
// shorter, so the busiest block is within a few percent of an even share. Without the mask every tile has the same length and the order is
// rung 8's (which keeps a head's blocks together, and its K and V in L2).
//
// Inputs fp16 or bf16 by tensor maps as in rung 2 (boxes of 64 rows for q, BC = 128 for k and v). Grid:
// (min(tiles, SMs), 1, 1) with tiles = ceil(n / 128) * H * B, B passed last; block: 384 threads; dynamic shared
// memory: (128 + 2 * STAGES * BC) * D * 2 + 1024 + 128 bytes. Needs scale > 0, as rung 6.
#include "wgmma.cuh"
#include "tma.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 128  // query rows per block: 64 per consumer warpgroup
#define BC 128  // keys per tile
#define NTHREADS 384  // a producer warpgroup and two consumers
#define STAGES 3
// The host reserves 128 bytes of barriers (flashlab.gpu.HOPPER_RUNGS: 2 + 3 * STAGES of 8 bytes) and 3 stages.
static_assert(8 * (2 + 3 * STAGES) <= 128, "the barriers must fit the 128 bytes the host reserves");
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

template <class Ty, int D>
__device__ void attn_balanced(const TensorMap* qmap, const TensorMap* kmap, const TensorMap* vmap,
                                u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk, float scale,
                                int causal, int B) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 qs0 = (smem_u32(smem_raw) + 1023) & ~1023u;  // two 64-row tiles of Q, one per consumer
    const u32 kbuf = qs0 + BR * D * 2;                      // STAGES stages of [BC][D]
    const u32 vbuf = kbuf + STAGES * BC * D * 2;
    // mbarriers: Q's "full" and "empty", then per stage K's "full", V's "full" and the stage's "empty"
    const u32 qbar = vbuf + STAGES * BC * D * 2, qempty = qbar + 8, fullk = qempty + 8, fullv = fullk + 8 * STAGES,
              empty = fullv + 8 * STAGES;
    const int nqb = (n + BR - 1) / BR, tiles = nqb * H * B;
    const int role = threadIdx.x / 128;  // 0: the producer, 1 and 2: the consumers

    // This block's j-th output tile: a slot in the order of all tiles (past the last tile: none left).
    auto slot_of = [&](int j) {  // round j of the deal
        const int G = gridDim.x, k = blockIdx.x;
        return j * G + (causal && (j & 1) ? G - 1 - k : k);
    };
    // Slot -> output tile: its head, batch entry, first query row and number of key tiles. Causal: rank x (longest
    // first) of every head and batch entry, then rank x + 1; no mask: query blocks of a head, then heads, then
    // batch entries, as rung 8.
    struct Tile {
        int h, b, q0, ntiles;
    };
    auto tile_of = [&](int i) {
        Tile w;
        const int x = causal ? i / (H * B) : i % nqb, hb = causal ? i % (H * B) : i / nqb;
        w.h = hb % H;
        w.b = hb / H;
        w.q0 = (causal ? nqb - 1 - x : x) * BR;
        const int kend = causal ? min(m, min(w.q0 + BR, n) + (m - n)) : m;
        w.ntiles = kend > 0 ? (kend + BC - 1) / BC : 0;
        return w;
    };

    if (threadIdx.x == 0) {
        mbar_init(qbar, 1);
        mbar_init(qempty, 2 * 128);
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
            int it = 0;  // K/V tiles loaded by this block so far: ring stage it % STAGES
            for (int j = 0, i = slot_of(0); i < tiles; i = slot_of(++j)) {
                const Tile w = tile_of(i);
                const int hk = w.h / (H / Hk);
                if (j > 0)  // both consumers have issued their last S of the previous tile
                    while (!mbar_try_wait(qempty, (j - 1) & 1)) {
                    }
                mbar_expect_tx(qbar, BR * D * 2);
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int p = 0; p < D / 64; ++p)
                        tma_load_3d(qs0 + c * 64 * D * 2 + p * 64 * 128, qmap, 64 * p, w.q0 + 64 * c, w.b * H + w.h,
                                    qbar);
                for (int t = 0; t < w.ntiles; ++t, ++it) {
                    const int st = it % STAGES;
                    if (it >= STAGES)  // the consumers' release of this stage's last tile, it - STAGES
                        while (!mbar_try_wait(empty + 8 * st, ((it / STAGES) + 1) & 1)) {
                        }
                    const u32 kb = fullk + 8 * st, vb = fullv + 8 * st;
                    mbar_expect_tx(kb, BC * D * 2);
#pragma unroll
                    for (int p = 0; p < D / 64; ++p)
                        tma_load_3d(kbuf + st * BC * D * 2 + p * BC * 128, kmap, 64 * p, t * BC, w.b * Hk + hk, kb);
                    mbar_expect_tx(vb, BC * D * 2);
#pragma unroll
                    for (int p = 0; p < D / 64; ++p)
                        tma_load_3d(vbuf + st * BC * D * 2 + p * BC * 128, vmap, 64 * p, t * BC, w.b * Hk + hk, vb);
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
    const u32 qs = qs0 + c * 64 * D * 2;
    const float scale2 = scale * LOG2E;
    const int mine = 1 + c, other = 2 - c;  // named barriers: "consumer c may issue" is barrier 1 + c

    float oacc[D / 2], s[BC / 2];
    u32 pa[BC / 16][4];  // P_{t-1} in the A fragment layout: k16 step kk takes the 8-key blocks 2 kk and 2 kk + 1
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) s[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BC / 16; ++i) pa[i][0] = pa[i][1] = pa[i][2] = pa[i][3] = 0u;

    if (c == 1) named_bar_arrive(1, 256);  // consumer 0 takes the first turn of the first tile

    int it0 = 0;  // K/V tiles of this block's earlier output tiles: tile t of this one is ring entry it0 + t
    for (int j = 0, i = slot_of(0); i < tiles; i = slot_of(++j)) {
        const Tile w = tile_of(i);
        const int ntiles = w.ntiles;
        const bool last_tile = slot_of(j + 1) >= tiles;
        const int r0 = w.q0 + 64 * c;  // this warpgroup's first row
        // This thread holds rows 16 warp + g and + 8 of the warpgroup; the first may see keys below kbase (causal).
        const int kbase = causal ? r0 + 16 * warp + g + (m - n) + 1 : m;
        const int my_kend = causal ? min(m, min(r0 + 64, n) + (m - n)) : m;
        const int my_tiles = my_kend > 0 ? (my_kend + BC - 1) / BC : 0;  // past these, every key is masked
        const int mask_from = causal ? min(r0 + (m - n) + 2 - BC, m - BC + 1) : m - BC + 1;
#pragma unroll
        for (int e = 0; e < D / 2; ++e) oacc[e] = 0.f;
        float mx0 = NEG_INF, mx1 = NEG_INF, l0 = 0.f, l1 = 0.f;

        while (!mbar_try_wait(qbar, j & 1)) {  // this tile's Q
        }

        auto wait_tiles = [&](int t) {
            if (t < ntiles)
                while (!mbar_try_wait(fullk + 8 * ((it0 + t) % STAGES), ((it0 + t) / STAGES) & 1)) {
                }
            if (t > 0)
                while (!mbar_try_wait(fullv + 8 * ((it0 + t - 1) % STAGES), ((it0 + t - 1) / STAGES) & 1)) {
                }
        };
        auto hand_over = [&](int t) {  // the other consumer's turn (none after consumer 1's very last)
            if (!(c == 1 && t == ntiles && last_tile)) named_bar_arrive(other, 256);
        };
        auto release = [&](int t) {  // tile t - 1's stage: K read by S_{t-1}, V by P_{t-1} V_{t-1}
            if (t > 0) mbar_arrive(empty + 8 * ((it0 + t - 1) % STAGES));
        };
        // S_t = Q K_t^T: one wgmma per 16 columns of d (32 bytes along the 128-byte rows of panel kk / 4).
        auto issue_s = [&](int t) {
            const u32 ks = kbuf + ((it0 + t) % STAGES) * BC * D * 2;
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
            const u32 vs = vbuf + ((it0 + t - 1) % STAGES) * BC * D * 2;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk)
                Wgmma<D>::template rs<Ty::bf16>(oacc, pa[kk], descriptor(vs + kk * 2048, BC * 128, 1024), 1);
            wgmma_commit();
        };
        // Online softmax in base 2 of S_t on this thread's two rows, as rung 6.
        auto softmax = [&](int t, float& c0, float& c1) {
            const int k0 = t * BC;
            const bool need_mask = k0 >= mask_from;
            float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
            for (int jj = 0; jj < BC / 8; ++jj) {
                if (need_mask) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int lim = causal ? min(m, kbase + (e >> 1) * 8) : m;
                        if (k0 + 8 * jj + 2 * tg + (e & 1) >= lim) s[4 * jj + e] = NEG_INF;
                    }
                }
                t0 = fmaxf(t0, fmaxf(s[4 * jj], s[4 * jj + 1]));
                t1 = fmaxf(t1, fmaxf(s[4 * jj + 2], s[4 * jj + 3]));
            }
            const float mn0 = fmaxf(mx0, quad_max(t0) * scale2), mn1 = fmaxf(mx1, quad_max(t1) * scale2);
            const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;
            c0 = ex2(mx0 - ms0);
            c1 = ex2(mx1 - ms1);
            float u0 = 0.f, u1 = 0.f;
#pragma unroll
            for (int jj = 0; jj < BC / 8; ++jj) {
                s[4 * jj] = ex2(fmaf(s[4 * jj], scale2, -ms0));
                s[4 * jj + 1] = ex2(fmaf(s[4 * jj + 1], scale2, -ms0));
                s[4 * jj + 2] = ex2(fmaf(s[4 * jj + 2], scale2, -ms1));
                s[4 * jj + 3] = ex2(fmaf(s[4 * jj + 3], scale2, -ms1));
                u0 += s[4 * jj] + s[4 * jj + 1];
                u1 += s[4 * jj + 2] + s[4 * jj + 3];
            }
            l0 = l0 * c0 + u0;
            l1 = l1 * c1 + u1;
            mx0 = mn0;
            mx1 = mn1;
        };
        // O holds the sum through tile t - 2 (its product has finished): bring it to tile t - 1's maxima, under S_t.
        auto rescale = [&](float c0, float c1) {
#pragma unroll
            for (int jj = 0; jj < D / 8; ++jj) {
                oacc[4 * jj] *= c0;
                oacc[4 * jj + 1] *= c0;
                oacc[4 * jj + 2] *= c1;
                oacc[4 * jj + 3] *= c1;
            }
        };
        auto pack = [&]() {  // P_t into the A layout for turn t + 1
#pragma unroll
            for (int jj = 0; jj < BC / 8; ++jj) {
                pa[jj / 2][(jj & 1) * 2] = Ty::pack(s[4 * jj], s[4 * jj + 1]);
                pa[jj / 2][(jj & 1) * 2 + 1] = Ty::pack(s[4 * jj + 2], s[4 * jj + 3]);
            }
        };

        // The turns of rung 8; the arrival on "Q empty" follows this consumer's last S.
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
            pack();
            for (t = 1; t < my_tiles; ++t) {  // turns 1 .. my_tiles - 1: S_t, O rescaled, then P_{t-1} V_{t-1}
                wait_tiles(t);
                named_bar_sync(mine, 256);
                issue_s(t);
                rescale(c0, c1);
                issue_pv(t);
                hand_over(t);
                wgmma_wait<1>();
                pin<BC / 2>(s);
                softmax(t, c0, c1);
                wgmma_wait<0>();
                pin<D / 2>(oacc);
                release(t);
                pack();
            }
            mbar_arrive(qempty);  // every S of this tile has completed: Q may be overwritten
            // turn my_tiles: the last product
            wait_tiles(t);
            named_bar_sync(mine, 256);
            rescale(c0, c1);
            issue_pv(t);
            hand_over(t);
            wgmma_wait<0>();
            pin<D / 2>(oacc);
            release(t);
            ++t;
        } else {
            mbar_arrive(qempty);
        }
        for (; t <= ntiles; ++t) {  // turns past this consumer's causal end: nothing to compute, the turn still taken
            wait_tiles(t);
            named_bar_sync(mine, 256);
            hand_over(t);
            release(t);
        }

        u16* ob = o + ((size_t)w.b * H + w.h) * n * D;
        float* lb = lse + ((size_t)w.b * H + w.h) * n;
        const int row0 = r0 + 16 * warp + g, row1 = row0 + 8;
        const float s0 = quad_sum(l0), s1 = quad_sum(l1);
        const float i0 = s0 > 0.f ? 1.f / s0 : 0.f, i1 = s1 > 0.f ? 1.f / s1 : 0.f;
#pragma unroll
        for (int jj = 0; jj < D / 8; ++jj) {
            const int col = 8 * jj + 2 * tg;
            if (row0 < n) *(u32*)(ob + (size_t)row0 * D + col) = Ty::pack(oacc[4 * jj] * i0, oacc[4 * jj + 1] * i0);
            if (row1 < n) *(u32*)(ob + (size_t)row1 * D + col) = Ty::pack(oacc[4 * jj + 2] * i1, oacc[4 * jj + 3] * i1);
        }
        if (tg == 0) {
            if (row0 < n) lb[row0] = s0 > 0.f ? (mx0 + __log2f(s0)) * LN2 : NEG_INF;
            if (row1 < n) lb[row1] = s1 > 0.f ? (mx1 + __log2f(s1)) * LN2 : NEG_INF;
        }
        it0 += ntiles;
    }
}

#define DEFINE_KERNEL(NAME, TY, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                 \
        NAME(const __grid_constant__ TensorMap qmap, const __grid_constant__ TensorMap kmap,                  \
             const __grid_constant__ TensorMap vmap, u16* o, float* lse, int n, int m, int H, int Hk,         \
             float scale, int causal, int B) {                                                                \
        attn_balanced<TY, D>(&qmap, &kmap, &vmap, o, lse, n, m, H, Hk, scale, causal, B);                    \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
