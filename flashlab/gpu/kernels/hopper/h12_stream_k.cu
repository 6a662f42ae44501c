// Hopper rung 12 -- the last round shared out by key tiles (stream-K). Needs sm_90a (H100, H200).
//
// Change from rung 11: the schedule without a mask. A persistent block deals itself the output tiles gridDim.x apart,
// so T tiles on G blocks take ceil(T / G) rounds: at 16k tokens of 16 heads, 2048 tiles of 128 rows on the H200's 132
// SMs are 15.5 rounds' work done in 16, the last round's second half idle. Here every whole round but the last is
// dealt as before, and the tiles that remain (G to 2 G - 1 of them) are cut by key tiles into G equal runs, one a
// block: a run covers one to two tiles' key tiles and may start or end inside a tile. A tile cut at a run's end is computed
// in two pieces, by blocks k and k + 1 (boundary k); each piece is an online softmax over its key tiles, so the two
// merge as two blocks of chapter 1's example do: m = max(m1, m2), O = O1 2^(m1 - m) + O2 2^(m2 - m), l likewise.
// Each warp writes its piece's unnormalised O, row maxima and row sums to a workspace, fences, and counts itself in
// on the boundary's counter; the warp that counts second reads the other piece, merges and stores the rows (and sets
// the counter back to zero for the next call). Neither block waits for the other. At 2048 tiles the makespan goes
// from 16 rounds to 14 + 200 / 132 = 15.52. With a causal mask the tiles differ in length and rung 9's longest-first
// deal stays as it was.
//
// Inputs fp16 or bf16 by tensor maps as in rung 2 (boxes of 64 rows for q, BC = 128 for k and v). Grid:
// (min(tiles, SMs), 1, 1) with tiles = ceil(n / 128) * H * B; the arguments after B: the workspace, G - 1 boundaries
// of 2 pieces of 8 warps of 32 * (D / 2 + 4) floats (flashlab.gpu.hopper.stream_k_workspace), and 8 counters a
// boundary, zero before the call and left at zero after it. Block: 384 threads; dynamic shared memory as rung 11.
// Needs scale > 0, as rung 6. Rows that see no key get o = 0 and lse = -inf.
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

// SK: the stream-K deal (no mask, at least one key: causal is 0 there, a constant, so the mask's code folds away);
// otherwise rung 11's deal, its code free of the pieces and their merge.
template <class Ty, int D, bool SK>
__device__ void attn_stream_k(const TensorMap* qmap, const TensorMap* kmap, const TensorMap* vmap, u16* __restrict__ o,
                              float* __restrict__ lse, int n, int m, int H, int Hk, float scale, int causal, int B,
                              float* __restrict__ ws, int* cnt) {
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
    // batch entries, as rung 8. A piece of an output tile (no mask only): key tiles t0 .. t0 + ntiles - 1 of it, the
    // first (piece 0) or second (piece 1) of the two cut at boundary bnd; piece -1: the whole tile.
    struct Tile {
        int h, b, q0, ntiles, t0, bnd, piece;
    };
    auto tile_of = [&](int i) {
        Tile w;
        const int x = causal ? i / (H * B) : i % nqb, hb = causal ? i % (H * B) : i / nqb;
        w.h = hb % H;
        w.b = hb / H;
        w.q0 = (causal ? nqb - 1 - x : x) * BR;
        const int kend = causal ? min(m, min(w.q0 + BR, n) + (m - n)) : m;
        w.ntiles = kend > 0 ? (kend + BC - 1) / BC : 0;
        w.t0 = 0;
        w.bnd = w.piece = -1;
        return w;
    };
    // The stream-K deal (no mask, at least one key): whole rounds 0 .. F - 2 as above, then the last R = T - (F - 1) G
    // tiles' R * nkt key tiles cut into G runs, block k's run from R nkt k / G to R nkt (k + 1) / G. R nkt / G >= nkt,
    // so a run is at least a tile long and a tile is cut at most once.
    const int G = gridDim.x, nkt = (m + BC - 1) / BC;
    const int whole = tiles / G - 1;  // rounds dealt whole (F - 1)
    // left < 2 G nkt: 32 bits hold it for any m that fits in memory; the products take 64
    const int left = (tiles - whole * G) * nkt;
    const int run0 = (int)((long long)left * blockIdx.x / G), run1 = (int)((long long)left * (blockIdx.x + 1) / G);
    // The block's j-th piece of work: false past its last.
    auto item_of = [&](int j, Tile& w) {
        if (!SK || j < whole) {
            const int i = slot_of(j);
            if (i >= tiles) return false;
            w = tile_of(i);
            return true;
        }
        const int i = run0 / nkt + (j - whole), a = i * nkt;  // the tile's first key tile in the stream
        if (a >= run1) return false;
        w = tile_of(whole * G + i);
        w.t0 = max(run0 - a, 0);
        w.ntiles = min(run1 - a, nkt) - w.t0;
        if (w.t0 > 0) {  // the tile's second piece: the first ended block k - 1's run
            w.bnd = blockIdx.x - 1;
            w.piece = 1;
        } else if (w.ntiles < nkt) {  // the first: the second starts block k + 1's run
            w.bnd = blockIdx.x;
            w.piece = 0;
        }
        return true;
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
            Tile w;
            for (int j = 0; item_of(j, w); ++j) {
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
                    const int st = it % STAGES, k0 = (w.t0 + t) * BC, ph = ((it / STAGES) + 1) & 1;
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

    // A finished output tile or piece: a whole tile is stored; a piece goes to the workspace, and the warp that counts
    // itself in second on the boundary merges the two and stores the rows. The workspace of a warp's piece: its
    // accumulators as D / 8 float4 a lane, lane-interleaved (each warp instruction writes 512 contiguous bytes), then
    // the lane's row sums and maxima.
    auto put = [&](const Tile& t, const Rows& r) {
        if (!SK || t.piece < 0) {
            store(t, r, false);
            return;
        }
        const int wi = 4 * c + warp;
        constexpr int PIECE = 32 * (D / 2 + 4);  // floats of a warp's piece
        float4* mine4 = reinterpret_cast<float4*>(ws + ((size_t)(2 * t.bnd + t.piece) * 8 + wi) * PIECE);
        const float4* theirs = reinterpret_cast<const float4*>(ws + ((size_t)(2 * t.bnd + 1 - t.piece) * 8 + wi) * PIECE);
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
            mine4[32 * i + lane] = make_float4(oacc[4 * i], oacc[4 * i + 1], oacc[4 * i + 2], oacc[4 * i + 3]);
        mine4[32 * (D / 8) + lane] = make_float4(r.s0, r.s1, r.m0, r.m1);
        __threadfence();  // this lane's piece is visible to the GPU before the warp counts itself in
        __syncwarp();
        int before = 0;
        if (lane == 0) before = atomicAdd(cnt + 8 * t.bnd + wi, 1);
        if (!__any_sync(0xffffffffu, lane == 0 && before == 1)) return;  // the other piece is still being computed
        // Lane 0 saw the count; __syncwarp orders that for every lane of the warp (a vote does not promise memory
        // order), and the fence orders this lane's reads of the other piece after it.
        __syncwarp();
        __threadfence();
        // Each term rounded on its own, then one addition (no FMA: the compiler would fuse one term into it): IEEE
        // addition commutes, so the merged rows have the same bits whichever block happened to finish second.
        const float4 x = __ldcg(theirs + 32 * (D / 8) + lane);  // L2, not this SM's L1: the other block wrote it
        const float mm0 = fmaxf(r.m0, x.z), mm1 = fmaxf(r.m1, x.w);
        const float ms0 = mm0 == NEG_INF ? 0.f : mm0, ms1 = mm1 == NEG_INF ? 0.f : mm1;
        const float a0 = ex2(r.m0 - ms0), b0 = ex2(x.z - ms0), a1 = ex2(r.m1 - ms1), b1 = ex2(x.w - ms1);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            const float4 y = __ldcg(theirs + 32 * i + lane);
            oacc[4 * i] = __fadd_rn(__fmul_rn(oacc[4 * i], a0), __fmul_rn(y.x, b0));
            oacc[4 * i + 1] = __fadd_rn(__fmul_rn(oacc[4 * i + 1], a0), __fmul_rn(y.y, b0));
            oacc[4 * i + 2] = __fadd_rn(__fmul_rn(oacc[4 * i + 2], a1), __fmul_rn(y.z, b1));
            oacc[4 * i + 3] = __fadd_rn(__fmul_rn(oacc[4 * i + 3], a1), __fmul_rn(y.w, b1));
        }
        store(t, Rows{__fadd_rn(__fmul_rn(r.s0, a0), __fmul_rn(x.x, b0)),
                      __fadd_rn(__fmul_rn(r.s1, a1), __fmul_rn(x.y, b1)), mm0, mm1}, false);
        if (lane == 0) cnt[8 * t.bnd + wi] = 0;  // both pieces are in: ready for the next call
    };

    if (c == 1) named_bar_arrive(1, 256);  // consumer 0 takes the first turn

    // The turns run over the block's computed tiles as one stream, across output tiles: a turn issues S of ring entry
    // it and, behind it, P V of entry it - 1, so that the first S of an output tile shares its turn with the last
    // P V of the one before (FlashAttention-3's order). That tile's O is stored between the two waits, under the other
    // consumer's turn; Q is double-buffered so that the next tile's Q has landed by then. The first P V of a tile
    // starts its O afresh (the wgmma's scale-d of 0: no instruction writes the accumulators between products).
    int fresh = 1;  // the next P V starts a new O
    Tile nw;
    for (int j = 0; item_of(j, nw); ++j) {
        if (nw.ntiles == 0) {  // no key is computed: the rows are written at once, no turn is taken
            store(nw, Rows{}, true);
            continue;
        }
        w = nw;
        kt = w.t0;
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
                put(done, r);
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
        put(done, finish());
    } else if (c == 0) {
        named_bar_sync(mine, 256);  // no turn was taken: consume consumer 1's opening arrival
    }
}

// Two kernels a dtype and d, each with one deal: in one kernel the two deals' code spilled at d = 128 (ptxas allocates
// one set of registers for both). attn_fwd_*: rung 11's deal, for a causal call (or no key at all), whose kernel
// ignores ws and cnt; attn_fwd_*_nomask: the stream-K deal, which the host launches for every other call.
#define DEFINE_KERNEL(NAME, TY, D, SK)                                                                        \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                 \
        NAME(const __grid_constant__ TensorMap qmap, const __grid_constant__ TensorMap kmap,                  \
             const __grid_constant__ TensorMap vmap, u16* o, float* lse, int n, int m, int H, int Hk,         \
             float scale, int causal, int B, float* ws, int* cnt) {                                           \
        attn_stream_k<TY, D, SK>(&qmap, &kmap, &vmap, o, lse, n, m, H, Hk, scale, SK ? 0 : causal, B, ws, cnt); \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64, false)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128, false)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64, false)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128, false)
DEFINE_KERNEL(attn_fwd_f16_d64_nomask, F16, 64, true)
DEFINE_KERNEL(attn_fwd_f16_d128_nomask, F16, 128, true)
DEFINE_KERNEL(attn_fwd_bf16_d64_nomask, BF16, 64, true)
DEFINE_KERNEL(attn_fwd_bf16_d128_nomask, BF16, 128, true)
