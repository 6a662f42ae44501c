// Block-sparse attention on Hopper rung 8: the key tiles a pattern leaves empty are never loaded or computed.
// Needs sm_90a (H100, H200).
//
// Rung 8's persistent blocks, producer warpgroup and two consumers taking turns at the tensor cores, with two changes.
// First, an output tile (128 query rows of one head) no longer walks every key tile up to the causal edge but only
// the computed tiles of its pattern, and its softmax masks element by element only the tiles the pattern cuts
// (PARTIAL); FULL tiles take rung 8's unmasked path. The producer asks TMA for key tile j instead of tile t.
// Second, the turns run across output tiles. A window of 256 keys gives an output tile three key tiles; in rung 8's
// loop such a tile took a turn for its first S alone and one for its last P V alone, asked for the next tile's Q only
// once its own last S had read Q, and stored O after its last product: at three key tiles that fixed cost was
// nearly as long as the tiles' own products. Here one turn issues the next tile's first S and this tile's last P V together
// (FlashAttention-3's persistent order), O is stored between the two waits, under the other consumer's products, and
// Q has two buffers, so that the next tile's Q is loaded while this one computes. K and V have "empty" barriers of
// their own: a stage's K is free once its S has read it, a turn before its V. Two Q buffers leave room for two
// stages of K and V at d = 128 (three at d = 64). O goes out through shared memory in 16-byte stores (epilogue.cuh,
// as rung 11): stored straight from the accumulators, 4 bytes at a time, it filled the queue of global stores at every
// output tile. Persistence matters more here than for dense attention: rung 7's
// one block per tile would leave the SM idle for the launch, Q's copy and the first S of every tile; here they run
// under the last products of the tile before. Two ways to say which tiles an output tile computes, one kernel for
// each, as the sm_80 kernel (sparse_r9_window.cu):
// * attn_window_*: a sliding window with an optional dilation, as three numbers: query i sees key j when
//   -left <= delta <= right and delta % stride == 0, delta = j - (i + m - n) ("no limit" is passed as n + m). The
//   key range of a block, the kind of each tile and the mask of an element follow from the formula: nothing is read
//   from memory (inside the range, a dilated tile with no visible key is skipped).
// * attn_blocks_*: any pattern, as a compressed list per query block (CSR): row_ptr[b] .. row_ptr[b + 1] index
//   tiles[] (the computed key tiles, in order) and slots[] (-1 for FULL, else the PARTIAL tile's slot in bits[]);
//   bits[((slot * 2 + c) * 2 + w) * 128 + t] is word w of consumer c's thread t: bit 4 (jj % 8) + e of word jj / 8
//   is the visibility of its accumulator s[4 jj + e] (row 16 warp + g + 8 (e / 2) of the consumer's 64, key
//   8 jj + 2 tg + e % 2 of the tile; flashlab.gpu.pack_wgmma_bits). Two coalesced loads a thread per partial tile.
// A short last key tile is PARTIAL in both kernels: TMA fills the keys past m with zeros, and the mask removes them.
// A dilated window whose n and m are multiples of its stride r is not masked element by element at all: query
// i = c + r a sees only keys j = c + r b of its own residue class c (when r divides m - n), and within a class the
// pattern is a plain window of floor(left / r) and floor(right / r) positions. So the launcher passes the problem of
// one class (n / r queries, m / r keys, that window, stride 1) with `classes` = r and B r "batch entries" b' = b r + c:
// the tensor maps are then 4-D (column, class, position in the class, head; flashlab.gpu.hopper._layout), so that a
// box holds rows r apart and positions past a class's end are zeros, and O and lse are stored r rows apart. The
// element mask of the dilation, 3/4 of whose scores it throws away at r = 4, becomes r dense windows of a quarter
// the tiles.
// The order of the output tiles is given by the launcher (flashlab.gpu.sparse_order): slot i holds output tile
// order[i] = qb + nqb * (b * H + h), ranked by its computed tiles, most first, as rung 9 ranks causal tiles, and dealt
// to the persistent blocks in a snake (round j: slot j * gridDim.x + k to block k when j is even, to block
// gridDim.x - 1 - k when odd). Tiles with as many key tiles stay in rung 8's order (the query blocks of one head,
// then the next head), so that neighbouring query blocks, whose windows share most keys, run together and find
// those keys in L2.
//
// Inputs fp16 or bf16 by tensor maps (boxes of 64 rows for q, 128 for k and v). Grid: (min(tiles, SMs), 1, 1)
// with tiles = ceil(n / 128) * H * B, B and classes passed last (classes = 1 but for the residue classes above, where
// n, m and B are those of the classes); block: 384 threads; dynamic shared memory:
// (2 * 128 + 2 * STAGES * BC + 128) * D * 2 + 1024 + 128 bytes (flashlab.gpu.HOPPER_SPARSE_SHARED). Tiles are
// 128 x 128 at both head dimensions (the block mask's tile size). Needs scale > 0, as rung 6. Rows that see no key get o = 0 and lse = -inf.
#include "wgmma.cuh"
#include "tma.cuh"
#include "epilogue.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 128  // query rows per block: 64 per consumer warpgroup
#define BC 128  // keys per tile
#define NTHREADS 384  // a producer warpgroup and two consumers
// Stages of the K/V ring: two Q buffers and three stages would need 256 KB at d = 128, past the 227 KB a block may have.
// The host reserves 128 bytes of barriers (flashlab.gpu.HOPPER_SPARSE_SHARED: 4 + 4 * STAGES of 8 bytes).
template <int D>
__host__ __device__ constexpr int sparse_stages() { return D == 128 ? 2 : 3; }
static_assert(8 * (4 + 4 * 3) <= 128, "the barriers must fit the 128 bytes the host reserves");
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// floor(a / b) for b > 0 and any sign of a (C++ division truncates toward zero).
__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((b - 1 - a) / b); }

// Window mode: does key tile j hold no visible key for query rows q0 .. qlast (a dilated window's gap)?
__device__ __forceinline__ bool window_tile_empty(int j, int q0, int qlast, int off, int m, int left, int right,
                                                  int stride) {
    const int lo = j * BC - qlast - off, hi = min(j * BC + BC, m) - 1 - q0 - off;
    const int first = max(lo, -left), last = min(hi, right);
    return floor_div(last, stride) * stride < first;
}

template <class Ty, int D, bool LIST>
__device__ void attn_sparse(const TensorMap* qmap, const TensorMap* kmap, const TensorMap* vmap, u16* __restrict__ o,
                            float* __restrict__ lse, int n, int m, int H, int Hk, float scale, int left, int right,
                            int stride, const int* __restrict__ order, const int* __restrict__ row_ptr,
                            const int* __restrict__ tiles,
                            const int* __restrict__ slots, const u32* __restrict__ bits, int B, int classes) {
    constexpr int STAGES = sparse_stages<D>();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 qs0 = (smem_u32(smem_raw) + 1023) & ~1023u;  // two buffers of Q, each two 64-row tiles (a consumer's)
    const u32 kbuf = qs0 + 2 * BR * D * 2;                  // STAGES stages of [BC][D]
    const u32 vbuf = kbuf + STAGES * BC * D * 2;
    // mbarriers: Q's "full" and "empty" per buffer, then per stage K's and V's "full" and K's and V's "empty"
    const u32 qfull = vbuf + STAGES * BC * D * 2, qempty = qfull + 16, fullk = qempty + 16, fullv = fullk + 8 * STAGES,
              emptyk = fullv + 8 * STAGES, emptyv = emptyk + 8 * STAGES;
    const u32 ostage = qfull + 128;  // O's staging tiles (epilogue.cuh): 16 rows of D a warp, 8 warps
    const int nqb = (n + BR - 1) / BR, ntiles_all = nqb * H * B;
    const int off = m - n;  // query i stands at position i + off
    const int role = threadIdx.x / 128;  // 0: the producer, 1 and 2: the consumers

    // This block's j-th output tile: a slot in the order of all of them (past the last: none left), dealt in a snake.
    auto slot_of = [&](int j) {
        const int G = gridDim.x, k = blockIdx.x;
        return j * G + ((j & 1) ? G - 1 - k : k);
    };
    // Order entry -> output tile: its head, batch entry, first query row and its computed key tiles: positions
    // pbeg .. pend - 1 of the list (LIST), or key tiles pbeg .. pend - 1 of the window's range, of which ntiles are
    // computed.
    struct Tile {
        int h, b, q0, pbeg, pend, ntiles;
    };
    // The output tile of order entry v = order[slot]. Both roles load the next slot's entry while they work on this
    // one (order_at), so the walk to the next output tile does not start with a load from global memory.
    auto order_at = [&](int i) { return i < ntiles_all ? __ldg(order + i) : 0; };
    auto tile_of = [&](int v) {
        Tile w;
        const int qb = v % nqb, hb = v / nqb;
        w.h = hb % H;
        w.b = hb / H;
        w.q0 = qb * BR;
        if (LIST) {
            w.pbeg = __ldg(row_ptr + qb);
            w.pend = __ldg(row_ptr + qb + 1);
            w.ntiles = w.pend - w.pbeg;
        } else {
            const int qlast = min(w.q0 + BR, n) - 1;
            const int jlo = max(0, w.q0 + off - left), jhi = min(m - 1, qlast + off + right);
            w.pbeg = jlo / BC;
            w.pend = jhi >= jlo ? jhi / BC + 1 : w.pbeg;
            w.ntiles = w.pend - w.pbeg;
            if (stride > 1)
                for (int p = w.pbeg; p < w.pend; ++p) w.ntiles -= window_tile_empty(p, w.q0, qlast, off, m, left,
                                                                                    right, stride);
        }
        return w;
    };
    // The position of the next computed tile from p on (window mode steps over a dilation's empty tiles), and the key
    // tile at a position.
    auto next_from = [&](const Tile& w, int p) {
        if (!LIST && stride > 1)
            while (p < w.pend && window_tile_empty(p, w.q0, min(w.q0 + BR, n) - 1, off, m, left, right, stride)) ++p;
        return p;
    };
    auto key_tile = [&](int p) { return LIST ? __ldg(tiles + p) : p; };

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
            // The producer runs ahead of the consumers by what its barriers allow, and two orders buy it time.
            // K of ring entry e goes out before V of entry e - 1: a K stage is free once its S has read it, a turn
            // before its V, and issued behind V, K would wait for that V's product as well. The next output tile's
            // Q goes out as soon as its buffer is free (that tile's Q is polled for during every wait) rather than
            // after this tile's last K and V: at a window of 256 keys an output tile has three key tiles, and Q,
            // read from DRAM once, arrived late behind them.
            int it = 0, qi = 0;  // K tiles and Q tiles loaded by this block so far
            // a pending V load (entry it - 1), and the next computed output tile, whose Q may go out early
            struct Pending {
                int st, k0, z, cls, ph;
            } pv{};
            bool qnext_out = false;
            Tile nxt{};
            int j_next = 0;  // the slot index of nxt; past the end: none
            // output tile w's 128 rows of Q into buffer qb
            auto load_q = [&](const Tile& w, int qb) {
                const int bb = w.b / classes, cls = w.b % classes;
                mbar_expect_tx(qfull + 8 * qb, BR * D * 2);
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int p = 0; p < D / 64; ++p)
                        if (classes > 1)
                            tma_load_4d(qs0 + qb * BR * D * 2 + c * 64 * D * 2 + p * 64 * 128, qmap, 64 * p, cls,
                                        w.q0 + 64 * c, bb * H + w.h, qfull + 8 * qb);
                        else
                            tma_load_3d(qs0 + qb * BR * D * 2 + c * 64 * D * 2 + p * 64 * 128, qmap, 64 * p,
                                        w.q0 + 64 * c, w.b * H + w.h, qfull + 8 * qb);
            };
            // Q of output tile qi (qi >= 2: both consumers' last S of output tile qi - 2, which read this buffer, has
            // completed), without waiting: false if the buffer is still in use
            auto q_free = [&](int q) { return q < 2 || mbar_try_wait(qempty + 8 * (q & 1), ((q >> 1) + 1) & 1); };
            auto poll_q = [&]() {
                if (!qnext_out && j_next >= 0 && q_free(qi)) {
                    load_q(nxt, qi & 1);
                    qnext_out = true;
                }
            };
            auto wait_polling = [&](u32 bar, int ph) {
                while (!mbar_try_wait(bar, ph)) poll_q();
            };
            // the first output tile from slot index j on with a computed key tile (-1: none)
            auto next_computed = [&](int j, Tile& w) {
                for (; slot_of(j) < ntiles_all; ++j) {
                    w = tile_of(order_at(slot_of(j)));
                    if (w.ntiles > 0) return j;
                }
                return -1;
            };
            // keys k0 .. k0 + BC - 1 of K or V into stage st of its ring, counted on that stage's barrier
            auto load_keys = [&](u32 ring, const TensorMap* map, u32 full, int st, int k0, int z, int cls) {
#pragma unroll
                for (int q = 0; q < D / 64; ++q)
                    if (classes > 1)
                        tma_load_4d(ring + st * BC * D * 2 + q * BC * 128, map, 64 * q, cls, k0, z, full + 8 * st);
                    else
                        tma_load_3d(ring + st * BC * D * 2 + q * BC * 128, map, 64 * q, k0, z, full + 8 * st);
            };
            auto issue_v = [&]() {
                if (pv.ph >= 0)  // P V of ring entry it - 1 - STAGES has read this stage's V
                    wait_polling(emptyv + 8 * pv.st, pv.ph);
                mbar_expect_tx(fullv + 8 * pv.st, BC * D * 2);
                load_keys(vbuf, vmap, fullv, pv.st, pv.k0, pv.z, pv.cls);
            };
            j_next = next_computed(0, nxt);
            while (j_next >= 0) {
                const Tile w = nxt;
                if (!qnext_out) {  // not sent early: wait for its buffer
                    while (!q_free(qi)) {
                    }
                    load_q(w, qi & 1);
                }
                ++qi;
                j_next = next_computed(j_next + 1, nxt);
                qnext_out = false;
                const int hk = w.h / (H / Hk);
                // with residue classes, batch entry b' = b classes + c: class c of head-and-batch entry (b, h)
                const int bb = w.b / classes, cls = w.b % classes, z = bb * Hk + hk;
                for (int t = 0, p = next_from(w, w.pbeg); t < w.ntiles; ++t, ++it, p = next_from(w, p + 1)) {
                    const int st = it % STAGES, k0 = key_tile(p) * BC, ph = ((it / STAGES) + 1) & 1;
                    if (it >= STAGES)  // S of ring entry it - STAGES has read this stage's K
                        wait_polling(emptyk + 8 * st, ph);
                    mbar_expect_tx(fullk + 8 * st, BC * D * 2);
                    load_keys(kbuf, kmap, fullk, st, k0, z, cls);
                    if (it > 0) issue_v();  // V of entry it - 1
                    pv = Pending{st, k0, z, cls, it >= STAGES ? ph : -1};
                }
            }
            if (it > 0) issue_v();
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

    // The ring entry a turn's S reads (it) and the output tile it belongs to (w, its Q buffer qi & 1, the position ps
    // of the tile the next softmax masks); done: the output tile before w, whose last P V may still be pending.
    Tile w{}, done{};
    int it = 0, qi = 0, ps = 0;

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
    // The pattern's mask on this consumer's part of the tile at position ps of output tile w (then ps moves to the
    // next computed tile). A FULL tile costs one uniform branch; in a PARTIAL one each element is a bit test (list) or
    // its position against the window (window mode: a row sees an interval of keys, so its bounds are taken once per
    // row and each element is two compares with its compile-time offset 8 jj + e % 2; a dilation adds a residue of
    // delta mod stride carried from one 8-key block to the next, never an integer division per element).
    auto mask = [&]() {
        const int k0 = key_tile(ps) * BC;
        const int r0 = w.q0 + 64 * c, rlast = min(r0 + 64, n) - 1, row0 = r0 + 16 * warp + g;
        if (LIST) {
            const int slot = __ldg(slots + ps);
            if (slot >= 0) {
                const u32* wb = bits + (size_t)(slot * 2 + c) * 2 * 128 + tid;
                const u32 w0 = __ldg(wb), w1 = __ldg(wb + 128);
#pragma unroll
                for (int jj = 0; jj < BC / 8; ++jj)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!(((jj < 8 ? w0 : w1) >> (4 * (jj % 8) + e)) & 1u)) s[4 * jj + e] = NEG_INF;
            }
        } else {
            const bool partial = stride > 1 || k0 - rlast - off < -left || min(k0 + BC, m) - 1 - r0 - off > right ||
                                 k0 + BC > m;
            if (partial) {
                const int cc0 = k0 + 2 * tg;  // this thread's first key of the tile
                if (stride == 1) {
#pragma unroll
                    for (int e2 = 0; e2 < 2; ++e2) {
                        const int i = row0 + 8 * e2 + off;  // the row's position
                        const int lo = i - left - cc0, hi = min(i + right, m - 1) - cc0;  // key offsets seen
#pragma unroll
                        for (int jj = 0; jj < BC / 8; ++jj)
#pragma unroll
                            for (int e1 = 0; e1 < 2; ++e1)
                                if (8 * jj + e1 < lo || 8 * jj + e1 > hi) s[4 * jj + 2 * e2 + e1] = NEG_INF;
                    }
                } else {  // a dilation: the interval, and the stride dividing delta, tracked as a residue
                    const int step = 8 % stride;  // the residue's change from one 8-key block to the next
#pragma unroll
                    for (int e2 = 0; e2 < 2; ++e2) {
                        const int i = row0 + 8 * e2 + off;
                        const int lo = i - left - cc0, hi = min(i + right, m - 1) - cc0;
                        int r = (cc0 - i) % stride;  // delta mod stride of the thread's first key, in [0, stride)
                        r += r < 0 ? stride : 0;
#pragma unroll
                        for (int jj = 0; jj < BC / 8; ++jj) {
                            const int r1 = r + 1 == stride ? 0 : r + 1;
                            if (r != 0 || 8 * jj < lo || 8 * jj > hi) s[4 * jj + 2 * e2] = NEG_INF;
                            if (r1 != 0 || 8 * jj + 1 < lo || 8 * jj + 1 > hi) s[4 * jj + 2 * e2 + 1] = NEG_INF;
                            r += step;
                            r -= r >= stride ? stride : 0;
                        }
                    }
                }
            }
        }
        ps = next_from(w, ps + 1);
    };
    // Online softmax in base 2 of S on this thread's two rows, as rung 6, after the pattern's mask.
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
        // row r of the tile's head and class: row c + classes r of the head (classes = 1: row r)
        const size_t first = ((size_t)(t.b / classes) * H + t.h) * n * classes + t.b % classes;
        u16* ob = o + first * D;
        float* lb = lse + first;
        const int row0 = t.q0 + 64 * c + 16 * warp + g, row1 = row0 + 8;
        const float i0 = !empty && r.s0 > 0.f ? 1.f / r.s0 : 0.f, i1 = !empty && r.s1 > 0.f ? 1.f / r.s1 : 0.f;
        store_rows<Ty, D>(oacc, i0, i1, empty, ostage + (4 * c + warp) * 16 * D * 2, ob, row0 - g, n, lane,
                          classes * D);
        if (tg == 0) {
            if (row0 < n) lb[(size_t)row0 * classes] = !empty && r.s0 > 0.f ? (r.m0 + __log2f(r.s0)) * LN2 : NEG_INF;
            if (row1 < n) lb[(size_t)row1 * classes] = !empty && r.s1 > 0.f ? (r.m1 + __log2f(r.s1)) * LN2 : NEG_INF;
        }
    };

    if (c == 1) named_bar_arrive(1, 256);  // consumer 0 takes the first turn

    // The turns run over the block's computed tiles as one stream, across output tiles: a turn issues S of ring entry
    // it and, behind it, P V of entry it - 1, so that the first S of an output tile shares its turn with the last
    // P V of the one before (FlashAttention-3's order). That tile's O is stored between the two waits, under the other
    // consumer's turn; Q is double-buffered so that the next tile's Q has landed by then. The first P V of a tile
    // starts its O afresh (the wgmma's scale-d of 0: no instruction writes the accumulators between products).
    int fresh = 1;  // the next P V starts a new O
    int v = order_at(slot_of(0));
    for (int j = 0, i = slot_of(0); i < ntiles_all; i = slot_of(++j)) {
        const Tile nw = tile_of(v);
        v = order_at(slot_of(j + 1));
        if (nw.ntiles == 0) {  // no key is computed: the rows are written at once, no turn is taken
            store(nw, Rows{}, true);
            continue;
        }
        w = nw;
        ps = next_from(w, w.pbeg);
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

#define DEFINE_KERNEL(NAME, TY, D, LIST)                                                                         \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                   \
        NAME(const __grid_constant__ TensorMap qmap, const __grid_constant__ TensorMap kmap,                    \
             const __grid_constant__ TensorMap vmap, u16* o, float* lse, int n, int m, int H, int Hk, float scale, \
             int left, int right, int stride, const int* order, const int* row_ptr, const int* tiles,            \
             const int* slots, const u32* bits, int B, int classes) {                                           \
        attn_sparse<TY, D, LIST>(&qmap, &kmap, &vmap, o, lse, n, m, H, Hk, scale, left, right, stride, order,    \
                                 row_ptr, tiles, slots, bits, B, classes);                                      \
    }

DEFINE_KERNEL(attn_window_f16_d64, F16, 64, false)
DEFINE_KERNEL(attn_window_f16_d128, F16, 128, false)
DEFINE_KERNEL(attn_window_bf16_d64, BF16, 64, false)
DEFINE_KERNEL(attn_window_bf16_d128, BF16, 128, false)
DEFINE_KERNEL(attn_blocks_f16_d64, F16, 64, true)
DEFINE_KERNEL(attn_blocks_f16_d128, F16, 128, true)
DEFINE_KERNEL(attn_blocks_bf16_d64, BF16, 64, true)
DEFINE_KERNEL(attn_blocks_bf16_d128, BF16, 128, true)
