// Hopper rung 11 -- O stored through shared memory. Needs sm_90a (H100, H200).
//
// Change from rung 10: the epilogue. A consumer held O in the accumulator layout and stored it straight from there:
// 32 stores of 4 bytes a thread at d = 128, each warp instruction writing 16 bytes into each of 8 rows, half of every
// 32-byte sector it touched. Measured on the block-sparse kernel with the same loop, at output tiles of three key tiles,
// those stores took the largest share of the consumers' stall samples, waiting on the queue of global accesses. Here
// each warp writes its 16 rows into a staging tile in shared memory with stmatrix and stores them back out in 16-byte
// pieces, a row's bytes contiguous across the warp (epilogue.cuh): 8 stores a thread at d = 128, each warp instruction
// writing 512 contiguous bytes. The staging tiles take 8 * 16 * D * 2 bytes (32 KB at d = 128, which fits beside two
// Q buffers and two K/V stages). Everything else is rung 10's: turns across output tiles, Q double-buffered, K and V
// "empty" barriers of their own, rung 9's order of the tiles.
//
// Inputs fp16 or bf16 by tensor maps as in rung 2 (boxes of 64 rows for q, BC = 128 for k and v). Grid:
// (min(tiles, SMs), 1, 1) with tiles = ceil(n / 128) * H * B, B passed last; block: 384 threads; dynamic shared
// memory: (2 * 128 + 2 * STAGES * BC + 128) * D * 2 + 1024 + 128 bytes (flashlab.gpu.HOPPER_RUNGS). Needs scale > 0,
// as rung 6. Rows that see no key get o = 0 and lse = -inf.
#include "wgmma.cuh"
#include "tma.cuh"
#include "epilogue.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 128  // query rows per block: 64 per consumer warpgroup
#define BC 128  // keys per tile
#define NTHREADS 384  // a producer warpgroup and two consumers
// Stages of the K/V ring: two Q buffers and three stages would need 256 KB at d = 128, past the 227 KB a block may have.
// The host reserves 128 bytes of barriers (4 + 4 * STAGES of 8 bytes).
template <int D>
__host__ __device__ constexpr int merged_stages() { return D == 128 ? 2 : 3; }
static_assert(8 * (4 + 4 * 3) <= 128, "the barriers must fit the 128 bytes the host reserves");
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

template <class Ty, int D>
__device__ void attn_staged(const TensorMap* qmap, const TensorMap* kmap, const TensorMap* vmap, u16* __restrict__ o,
                            float* __restrict__ lse, int n, int m, int H, int Hk, float scale, int causal, int B) {
    constexpr int STAGES = merged_stages<D>();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 qs0 = (smem_u32(smem_raw) + 1023) & ~1023u;  // two buffers of Q, each two 64-row tiles (a consumer's)
    const u32 kbuf = qs0 + 2 * BR * D * 2;                  // STAGES stages of [BC][D]
    const u32 vbuf = kbuf + STAGES * BC * D * 2;
    // mbarriers: Q's "full" and "empty" per buffer, then per stage K's and V's "full" and K's and V's "empty"
    const u32 qfull = vbuf + STAGES * BC * D * 2, qempty = qfull + 16, fullk = qempty + 16, fullv = fullk + 8 * STAGES,
              emptyk = fullv + 8 * STAGES, emptyv = emptyk + 8 * STAGES;
    const u32 ostage = qfull + 128;  // O's staging tiles (epilogue.cuh): 16 rows of D a warp, 8 warps
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
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            mbar_init(qfull + 8 * b, 1);
            mbar_init(qempty + 8 * b, 2 * 128);
        }
#pragma unroll
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(fullk + 8 * st, 1);
            mbar_init(fullv + 8 * st, 1);
            mbar_init(emptyk + 8 * st, 2 * 128);
            mbar_init(emptyv + 8 * st, 2 * 128);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (role == 0) {  // ---------------------------------------------------------------- the producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            int it = 0, qi = 0;  // K/V tiles and output tiles with a computed tile, loaded by this block so far
            for (int j = 0, i = slot_of(0); i < tiles; i = slot_of(++j)) {
                const Tile w = tile_of(i);
                if (w.ntiles == 0) continue;  // no S reads its Q
                const int hk = w.h / (H / Hk), qb = qi & 1;
                if (qi >= 2)  // both consumers' last S of output tile qi - 2, which read this buffer, has completed
                    while (!mbar_try_wait(qempty + 8 * qb, ((qi >> 1) + 1) & 1)) {
                    }
                mbar_expect_tx(qfull + 8 * qb, BR * D * 2);
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int p = 0; p < D / 64; ++p)
                        tma_load_3d(qs0 + qb * BR * D * 2 + c * 64 * D * 2 + p * 64 * 128, qmap, 64 * p,
                                    w.q0 + 64 * c, w.b * H + w.h, qfull + 8 * qb);
                ++qi;
                for (int t = 0; t < w.ntiles; ++t, ++it) {
                    const int st = it % STAGES, k0 = t * BC, ph = ((it / STAGES) + 1) & 1;
                    if (it >= STAGES)  // S of ring entry it - STAGES has read this stage's K
                        while (!mbar_try_wait(emptyk + 8 * st, ph)) {
                        }
                    mbar_expect_tx(fullk + 8 * st, BC * D * 2);
#pragma unroll
                    for (int q = 0; q < D / 64; ++q)
                        tma_load_3d(kbuf + st * BC * D * 2 + q * BC * 128, kmap, 64 * q, k0, w.b * Hk + hk,
                                    fullk + 8 * st);
                    if (it >= STAGES)  // P V of ring entry it - STAGES has read this stage's V
                        while (!mbar_try_wait(emptyv + 8 * st, ph)) {
                        }
                    mbar_expect_tx(fullv + 8 * st, BC * D * 2);
#pragma unroll
                    for (int q = 0; q < D / 64; ++q)
                        tma_load_3d(vbuf + st * BC * D * 2 + q * BC * 128, vmap, 64 * q, k0, w.b * Hk + hk,
                                    fullv + 8 * st);
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
    const float scale2 = scale * LOG2E;
    const int mine = 1 + c, other = 2 - c;  // named barriers: "consumer c may issue" is barrier 1 + c

    float oacc[D / 2], s[BC / 2];
    u32 pa[BC / 16][4];  // P of the last S in the A fragment layout: k16 step kk takes the 8-key blocks 2 kk, 2 kk + 1
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) s[i] = 0.f;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) oacc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BC / 16; ++i) pa[i][0] = pa[i][1] = pa[i][2] = pa[i][3] = 0u;
    float mx0 = NEG_INF, mx1 = NEG_INF, l0 = 0.f, l1 = 0.f, c0 = 1.f, c1 = 1.f;

    // The ring entry a turn's S reads (it) and the output tile it belongs to (w, its Q buffer qi & 1, the key tile kt
    // the next softmax masks); done: the output tile before w, whose last P V may still be pending.
    Tile w{}, done{};
    int it = 0, qi = 0, kt = 0;

    auto wait_k = [&](int e) {
        while (!mbar_try_wait(fullk + 8 * (e % STAGES), (e / STAGES) & 1)) {
        }
    };
    auto wait_v = [&](int e) {
        while (!mbar_try_wait(fullv + 8 * (e % STAGES), (e / STAGES) & 1)) {
        }
    };
    // S = Q K^T of ring entry e: one wgmma per 16 columns of d (32 bytes along the 128-byte rows of panel kk / 4).
    auto issue_s = [&](int e, u32 qs) {
        const u32 ks = kbuf + (e % STAGES) * BC * D * 2;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 qa = qs + (kk / 4) * 64 * 128 + (kk % 4) * 32;
            const u32 ka = ks + (kk / 4) * BC * 128 + (kk % 4) * 32;
            Wgmma<BC>::template ss<Ty::bf16>(s, descriptor(qa, 16, 1024), descriptor(ka, 16, 1024), kk > 0);
        }
        wgmma_commit();
    };
    // O += P V of ring entry e: one wgmma per 16 keys (16 rows, 2048 bytes, down V's panels, BC * 128 bytes apart).
    auto issue_pv = [&](int e, int fresh) {
        const u32 vs = vbuf + (e % STAGES) * BC * D * 2;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            Wgmma<D>::template rs<Ty::bf16>(oacc, pa[kk], descriptor(vs + kk * 2048, BC * 128, 1024), kk > 0 || !fresh);
        wgmma_commit();
    };
    // Rung 9's causal mask on the tile of S that the next softmax takes (key tile kt of output tile w): only the tiles
    // that reach the diagonal (or the end of the keys) compare positions.
    auto mask = [&]() {
        const int k0 = kt * BC, r0 = w.q0 + 64 * c;
        const int mask_from = causal ? min(r0 + (m - n) + 2 - BC, m - BC + 1) : m - BC + 1;
        if (k0 >= mask_from) {
            const int kbase = causal ? r0 + 16 * warp + g + (m - n) + 1 : m;  // row 16 warp + g sees keys below
#pragma unroll
            for (int jj = 0; jj < BC / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int lim = causal ? min(m, kbase + (e >> 1) * 8) : m;
                    if (k0 + 8 * jj + 2 * tg + (e & 1) >= lim) s[4 * jj + e] = NEG_INF;
                }
        }
        ++kt;
    };
    // Online softmax in base 2 of S on this thread's two rows, as rung 6, after the causal mask.
    auto softmax = [&]() {
        mask();
        float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
        for (int jj = 0; jj < BC / 8; ++jj) {
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
    // O holds the sum through the P before the pending one (its product has finished): bring it to the pending P's
    // maxima, under S.
    auto rescale = [&]() {
#pragma unroll
        for (int jj = 0; jj < D / 8; ++jj) {
            oacc[4 * jj] *= c0;
            oacc[4 * jj + 1] *= c0;
            oacc[4 * jj + 2] *= c1;
            oacc[4 * jj + 3] *= c1;
        }
    };
    auto pack = [&]() {  // P into the A layout for the next turn's P V
#pragma unroll
        for (int jj = 0; jj < BC / 8; ++jj) {
            pa[jj / 2][(jj & 1) * 2] = Ty::pack(s[4 * jj], s[4 * jj + 1]);
            pa[jj / 2][(jj & 1) * 2 + 1] = Ty::pack(s[4 * jj + 2], s[4 * jj + 3]);
        }
    };
    // The row sums and maxima of the finished tile, taken before the next tile's first softmax resets them.
    struct Rows {
        float s0, s1, m0, m1;
    };
    auto finish = [&]() {
        Rows r{quad_sum(l0), quad_sum(l1), mx0, mx1};
        mx0 = mx1 = NEG_INF;
        l0 = l1 = 0.f;
        return r;
    };
    // This consumer's 64 rows of output tile t: O / l and the log-sum-exp (zero and -inf for rows that see no key, and
    // for every row of a tile with no computed tile: empty).
    auto store = [&](const Tile& t, const Rows& r, bool empty) {
        u16* ob = o + ((size_t)t.b * H + t.h) * n * D;
        float* lb = lse + ((size_t)t.b * H + t.h) * n;
        const int row0 = t.q0 + 64 * c + 16 * warp + g, row1 = row0 + 8;
        const float i0 = !empty && r.s0 > 0.f ? 1.f / r.s0 : 0.f, i1 = !empty && r.s1 > 0.f ? 1.f / r.s1 : 0.f;
        store_rows<Ty, D>(oacc, i0, i1, empty, ostage + (4 * c + warp) * 16 * D * 2, ob, row0 - g, n, lane);
        if (tg == 0) {
            if (row0 < n) lb[row0] = !empty && r.s0 > 0.f ? (r.m0 + __log2f(r.s0)) * LN2 : NEG_INF;
            if (row1 < n) lb[row1] = !empty && r.s1 > 0.f ? (r.m1 + __log2f(r.s1)) * LN2 : NEG_INF;
        }
    };

    if (c == 1) named_bar_arrive(1, 256);  // consumer 0 takes the first turn

    // The turns run over the block's computed tiles as one stream, across output tiles: a turn issues S of ring entry
    // it and, behind it, P V of entry it - 1, so that the first S of an output tile shares its turn with the last
    // P V of the one before (FlashAttention-3's order). That tile's O is stored between the two waits, under the other
    // consumer's turn; Q is double-buffered so that the next tile's Q has landed by then. The first P V of a tile
    // starts its O afresh (the wgmma's scale-d of 0: no instruction writes the accumulators between products).
    int fresh = 1;  // the next P V starts a new O
    for (int j = 0, i = slot_of(0); i < tiles; i = slot_of(++j)) {
        const Tile nw = tile_of(i);
        if (nw.ntiles == 0) {  // no key is computed: the rows are written at once, no turn is taken
            store(nw, Rows{}, true);
            continue;
        }
        w = nw;
        kt = 0;
        const u32 qs = qs0 + (qi & 1) * BR * D * 2 + c * 64 * D * 2;
        while (!mbar_try_wait(qfull + 8 * (qi & 1), (qi >> 1) & 1)) {  // this tile's Q
        }
        int t = 0;
        if (it == 0) {  // the block's first turn: S alone
            wait_k(0);
            named_bar_sync(mine, 256);
            issue_s(0, qs);
            named_bar_arrive(other, 256);
            wgmma_wait<0>();
            pin<BC / 2>(s);
            mbar_arrive(emptyk);
            if (w.ntiles == 1) mbar_arrive(qempty + 8 * (qi & 1));
            softmax();
            pack();
            t = it = 1;
        }
        for (; t < w.ntiles; ++t, ++it) {  // S of entry it, O rescaled, P V of entry it - 1
            wait_k(it);
            wait_v(it - 1);
            named_bar_sync(mine, 256);
            issue_s(it, qs);
            rescale();
            issue_pv(it - 1, fresh);
            named_bar_arrive(other, 256);  // the other consumer's turn
            fresh = 0;
            wgmma_wait<1>();
            pin<BC / 2>(s);
            mbar_arrive(emptyk + 8 * (it % STAGES));  // S has read K
            if (t + 1 == w.ntiles) mbar_arrive(qempty + 8 * (qi & 1));  // and, the tile's last, Q
            Rows r{};
            if (t == 0) r = finish();  // the P V in flight is the last of output tile done
            softmax();
            wgmma_wait<0>();
            pin<D / 2>(oacc);
            mbar_arrive(emptyv + 8 * ((it - 1) % STAGES));  // P V has read V
            if (t == 0) {
                store(done, r, false);
                fresh = 1;
            }
            pack();
        }
        done = w;
        ++qi;
    }
    if (it > 0) {  // the last turn: the last P V alone, then the last tile's O
        wait_v(it - 1);
        named_bar_sync(mine, 256);
        rescale();
        issue_pv(it - 1, fresh);
        if (c == 0) named_bar_arrive(other, 256);  // consumer 1's last turn is the block's last: no hand-over
        wgmma_wait<0>();
        pin<D / 2>(oacc);
        mbar_arrive(emptyv + 8 * ((it - 1) % STAGES));
        store(done, finish(), false);
    } else if (c == 0) {
        named_bar_sync(mine, 256);  // no turn was taken: consume consumer 1's opening arrival
    }
}

#define DEFINE_KERNEL(NAME, TY, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                 \
        NAME(const __grid_constant__ TensorMap qmap, const __grid_constant__ TensorMap kmap,                  \
             const __grid_constant__ TensorMap vmap, u16* o, float* lse, int n, int m, int H, int Hk,         \
             float scale, int causal, int B) {                                                                \
        attn_staged<TY, D>(&qmap, &kmap, &vmap, o, lse, n, m, H, Hk, scale, causal, B);                      \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
