// Block-sparse attention on Hopper rung 8: the key tiles a pattern leaves empty are never loaded or computed.
// Needs sm_90a (H100, H200).
//
// Rung 8's persistent blocks, producer warpgroup and two consumers taking turns at the tensor cores, with one change:
// an output tile (128 query rows of one head) no longer walks every key tile up to the causal edge but only the
// computed tiles of its pattern, and its softmax masks element by element only the tiles the pattern cuts (PARTIAL);
// FULL tiles take rung 8's unmasked path. The producer asks TMA for key tile j instead of tile t, and the rest of
// the ring (stages, phases, the "Q empty" barrier) is rung 8's. Persistence matters more here than for dense
// attention: a sliding window of 256 keys gives an output tile three key tiles, and rung 7's one block per tile would
// leave the SM idle for the launch, Q's copy and the first S of every tile; here they run under the last products of
// the tile before. Two ways to say which tiles an output tile computes, one kernel for each, as the sm_80 kernel
// (sparse_r9_window.cu):
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
// The order of the output tiles is given by the launcher (flashlab.gpu.sparse_order): slot i holds output tile
// order[i] = qb + nqb * (b * H + h), ranked by its computed tiles, most first, as rung 9 ranks causal tiles, and dealt
// to the persistent blocks in a snake (round j: slot j * gridDim.x + k to block k when j is even, to block
// gridDim.x - 1 - k when odd). Tiles with as many key tiles stay in rung 8's order (the query blocks of one head,
// then the next head), so that neighbouring query blocks, whose windows share most keys, run together and find
// those keys in L2.
//
// Inputs fp16 or bf16 by tensor maps (boxes of 64 rows for q, 128 for k and v). Grid: (min(tiles, SMs), 1, 1)
// with tiles = ceil(n / 128) * H * B, B passed last; block: 384 threads; dynamic shared memory:
// (128 + 2 * STAGES * BC) * D * 2 + 1024 + 128 bytes. Tiles are 128 x 128 at both head dimensions (the block mask's
// tile size). Needs scale > 0, as rung 6. Rows that see no key get o = 0 and lse = -inf.
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
                            const int* __restrict__ slots, const u32* __restrict__ bits, int B) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 qs0 = (smem_u32(smem_raw) + 1023) & ~1023u;  // two 64-row tiles of Q, one per consumer
    const u32 kbuf = qs0 + BR * D * 2;                      // STAGES stages of [BC][D]
    const u32 vbuf = kbuf + STAGES * BC * D * 2;
    // mbarriers: Q's "full" and "empty", then per stage K's "full", V's "full" and the stage's "empty"
    const u32 qbar = vbuf + STAGES * BC * D * 2, qempty = qbar + 8, fullk = qempty + 8, fullv = fullk + 8 * STAGES,
              empty = fullv + 8 * STAGES;
    const int nqb = (n + BR - 1) / BR, ntiles_all = nqb * H * B;
    const int off = m - n;  // query i stands at position i + off
    const int role = threadIdx.x / 128;  // 0: the producer, 1 and 2: the consumers

    // This block's j-th output tile: a slot in the order of all of them (past the last: none left), dealt in a snake.
    auto slot_of = [&](int j) {
        const int G = gridDim.x, k = blockIdx.x;
        return j * G + ((j & 1) ? G - 1 - k : k);
    };
    // Slot -> output tile: its head, batch entry, first query row and its computed key tiles: positions
    // pbeg .. pend - 1 of the list (LIST), or key tiles pbeg .. pend - 1 of the window's range, of which ntiles are
    // computed.
    struct Tile {
        int h, b, q0, pbeg, pend, ntiles;
    };
    auto tile_of = [&](int i) {
        Tile w;
        const int v = __ldg(order + i), qb = v % nqb, hb = v / nqb;
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
            for (int j = 0, i = slot_of(0); i < ntiles_all; i = slot_of(++j)) {
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
                for (int t = 0, p = next_from(w, w.pbeg); t < w.ntiles; ++t, ++it, p = next_from(w, p + 1)) {
                    const int st = it % STAGES, k0 = key_tile(p) * BC;
                    if (it >= STAGES)  // the consumers' release of this stage's last tile, it - STAGES
                        while (!mbar_try_wait(empty + 8 * st, ((it / STAGES) + 1) & 1)) {
                        }
                    const u32 kb = fullk + 8 * st, vb = fullv + 8 * st;
                    mbar_expect_tx(kb, BC * D * 2);
#pragma unroll
                    for (int q = 0; q < D / 64; ++q)
                        tma_load_3d(kbuf + st * BC * D * 2 + q * BC * 128, kmap, 64 * q, k0, w.b * Hk + hk, kb);
                    mbar_expect_tx(vb, BC * D * 2);
#pragma unroll
                    for (int q = 0; q < D / 64; ++q)
                        tma_load_3d(vbuf + st * BC * D * 2 + q * BC * 128, vmap, 64 * q, k0, w.b * Hk + hk, vb);
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
    for (int j = 0, i = slot_of(0); i < ntiles_all; i = slot_of(++j)) {
        const Tile w = tile_of(i);
        const int ntiles = w.ntiles;
        const bool last_tile = slot_of(j + 1) >= ntiles_all;
        const int r0 = w.q0 + 64 * c;  // this warpgroup's first row
        const int rlast = min(r0 + 64, n) - 1;
        const int row0 = r0 + 16 * warp + g;  // this thread's rows: row0 and row0 + 8
        int ps = next_from(w, w.pbeg);  // the position of the tile the next softmax masks
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
        // The pattern's mask on this consumer's part of the tile at position ps (then ps moves to the next computed
        // tile). A FULL tile costs one uniform branch; in a PARTIAL one each element is a bit test (list) or its
        // position against the window (window mode: a row sees an interval of keys, so its bounds are taken once per row
        // and each element is two compares with its compile-time offset 8 jj + e % 2; a dilation adds a residue of
        // delta mod stride carried from one 8-key block to the next, never an integer division per element).
        auto mask = [&]() {
            const int k0 = key_tile(ps) * BC;
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
                    const int c0 = k0 + 2 * tg;  // this thread's first key of the tile
                    if (stride == 1) {
#pragma unroll
                        for (int e2 = 0; e2 < 2; ++e2) {
                            const int i = row0 + 8 * e2 + off;  // the row's position
                            const int lo = i - left - c0, hi = min(i + right, m - 1) - c0;  // key offsets seen
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
                            const int lo = i - left - c0, hi = min(i + right, m - 1) - c0;
                            int r = (c0 - i) % stride;  // delta mod stride of the thread's first key, in [0, stride)
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
        // Online softmax in base 2 of S_t on this thread's two rows, as rung 6, after the pattern's mask.
        auto softmax = [&](float& c0, float& c1) {
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

        // The turns of rung 8 over the computed tiles; the arrival on "Q empty" follows this consumer's last S.
        int t = 0;
        if (ntiles > 0) {  // turn 0: S_0 alone
            float c0, c1;
            wait_tiles(0);
            named_bar_sync(mine, 256);
            issue_s(0);
            hand_over(0);
            wgmma_wait<0>();
            pin<BC / 2>(s);
            softmax(c0, c1);
            pack();
            for (t = 1; t < ntiles; ++t) {  // turns 1 .. ntiles - 1: S_t, O rescaled, then P_{t-1} V_{t-1}
                wait_tiles(t);
                named_bar_sync(mine, 256);
                issue_s(t);
                rescale(c0, c1);
                issue_pv(t);
                hand_over(t);
                wgmma_wait<1>();
                pin<BC / 2>(s);
                softmax(c0, c1);
                wgmma_wait<0>();
                pin<D / 2>(oacc);
                release(t);
                pack();
            }
            mbar_arrive(qempty);  // every S of this tile has completed: Q may be overwritten
            // turn ntiles: the last product
            wait_tiles(t);
            named_bar_sync(mine, 256);
            rescale(c0, c1);
            issue_pv(t);
            hand_over(t);
            wgmma_wait<0>();
            pin<D / 2>(oacc);
            release(t);
        } else {  // no computed tile: the turn is still taken, so that the two consumers stay in step
            mbar_arrive(qempty);
            wait_tiles(0);
            named_bar_sync(mine, 256);
            hand_over(0);
        }

        u16* ob = o + ((size_t)w.b * H + w.h) * n * D;
        float* lb = lse + ((size_t)w.b * H + w.h) * n;
        const int row1 = row0 + 8;
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

#define DEFINE_KERNEL(NAME, TY, D, LIST)                                                                         \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                                                   \
        NAME(const __grid_constant__ TensorMap qmap, const __grid_constant__ TensorMap kmap,                    \
             const __grid_constant__ TensorMap vmap, u16* o, float* lse, int n, int m, int H, int Hk, float scale, \
             int left, int right, int stride, const int* order, const int* row_ptr, const int* tiles,            \
             const int* slots, const u32* bits, int B) {                                                        \
        attn_sparse<TY, D, LIST>(&qmap, &kmap, &vmap, o, lse, n, m, H, Hk, scale, left, right, stride, order,    \
                                 row_ptr, tiles, slots, bits, B);                                               \
    }

DEFINE_KERNEL(attn_window_f16_d64, F16, 64, false)
DEFINE_KERNEL(attn_window_f16_d128, F16, 128, false)
DEFINE_KERNEL(attn_window_bf16_d64, BF16, 64, false)
DEFINE_KERNEL(attn_window_bf16_d128, BF16, 128, false)
DEFINE_KERNEL(attn_blocks_f16_d64, F16, 64, true)
DEFINE_KERNEL(attn_blocks_f16_d128, F16, 128, true)
DEFINE_KERNEL(attn_blocks_bf16_d64, BF16, 64, true)
DEFINE_KERNEL(attn_blocks_bf16_d128, BF16, 128, true)
