// Block-sparse attention on rung 11: the key tiles a pattern leaves empty are never loaded or computed. Needs sm_80.
//
// Rung 11's loop runs over every key tile up to the causal edge; this kernel runs over the computed tiles of a
// pattern only, and masks element by element only the tiles the pattern cuts (PARTIAL); FULL tiles run rung 11's
// unmasked path (a last, ragged key tile still masks its columns past m). The math per tile is rung 11's: one
// barrier per tile (rung 10: the next computed tile's copy is issued after the barrier that opens this one) and
// K's ldmatrix lanes in B order (rung 11: each mma finds its two K registers side by side, so ptxas no longer
// copies them into place). The file was first written on rung 9 and keeps its name. Two ways to say which tiles
// a query block computes, one kernel for each:
// * attn_window_*: a sliding window with an optional dilation, as three numbers: query i sees key j when
//   -left <= delta <= right and delta % stride == 0, delta = j - (i + m - n) (the course's causal alignment;
//   "no limit" is passed as n + m). The key range of a block, the kind of each tile and the mask of an element
//   follow from the formula: nothing is read from memory, and the empty tiles outside the range are not even
//   visited (inside it, a dilated tile with no visible key is skipped).
// * attn_blocks_*: any pattern, as a compressed list per query block (CSR, as FlexAttention's kv_indices):
//   row_ptr[b] .. row_ptr[b + 1] index tiles[] (the computed key tiles, in order) and slots[] (-1 for FULL, else
//   the PARTIAL tile's slot in bits[]); bits[(slot * MT + mt) * NTHREADS + t] holds thread t's BC / 2 = 32
//   visibility bits of 16-row tile mt in the order of its mma accumulators (flashlab.gpu.pack_fragment_bits): one
//   coalesced 32-bit load per 16-row tile, so the mask costs 1 KB per partial tile and nothing per full or empty
//   one; a dense n x m mask would cost a byte per element and a read per element.
// Query blocks run last first when `reverse` (the launcher sets it where later blocks have more tiles, as causal
// windows without a left limit: the longest blocks start first).
//
// Inputs fp16 or bf16 (raw 16-bit patterns). Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q,
// lse (B, H, n) fp32. Grid: (ceil(n / BR), H, B) with BR = 32 * NWARPS; block: 32 * NWARPS threads;
// dynamic shared memory: (BR + 2 * 2 * BC) * D * 2 bytes (96 KB at D = 128, 48 KB at D = 64). Tiles are
// BR x BC = 128 x 64 at both head dimensions, in both kernels (the block mask's tile size). Rows that see no key
// get o = 0 and lse = -inf, as in rung 9.

#define NEG_INF (-__int_as_float(0x7f800000))
#ifndef NWARPS
#define NWARPS 4
#endif
// Keys per tile, by head dimension, for both kernels. With the leaner softmax, 64-key tiles fit in registers at
// d = 128 too; list mode's mask bits as well since K's lanes stopped costing register copies (on rung 9's lanes
// it spilled 16 bytes on sm_90 and kept 32-key tiles at d = 128).
#ifndef BC_D64
#define BC_D64 64
#endif
#ifndef BC_D128
#define BC_D128 64
#endif
#define MT 2  // 16-row mma tiles per warp
#define BR (16 * MT * NWARPS)
#define NTHREADS (32 * NWARPS)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef unsigned short u16;
typedef unsigned int u32;

struct F16 {
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
struct BF16 {
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Max / sum over the 4 threads of a quad (lanes 4g .. 4g+3 hold the same two rows).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2.approx(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Shared-memory address of a generic pointer, as ldmatrix wants it.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// Four 8x8 blocks of 16-bit elements; lanes 8i .. 8i+7 give the row addresses of block i, and every thread
// receives one register per block in the mma fragment layout (row lane/4, columns 2*(lane%4) and +1).
__device__ __forceinline__ void ldsm_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// The same with each block transposed: the thread gets (rows 2*(lane%4) and +1, column lane/4).
__device__ __forceinline__ void ldsm_x4_t(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// Asynchronous 16-byte copy global -> shared; with valid = false nothing is read and 16 zero bytes are written.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Copy ROWS rows of D halves (rows row0 .. row0+ROWS-1 of src, zeros from row `limit` on) into a swizzled
// buffer at shared byte address dst. Thread tid copies chunk tid % (D/8) of rows tid / (D/8) + i * RPP.
template <int D, int ROWS>
__device__ __forceinline__ void copy_rows(u32 dst, const u16* src, int row0, int limit) {
    constexpr int CH = D / 8, RPP = NTHREADS / CH, PASSES = ROWS / RPP;
    static_assert(NTHREADS % CH == 0 && RPP % 8 == 0 && ROWS % RPP == 0, "copy pattern needs rows per pass % 8 == 0");
    const int c = threadIdx.x % CH, r = threadIdx.x / CH;
    const u32 d0 = dst + r * (D * 2) + ((c ^ (r & 7)) << 4);  // the swizzle of rows r, r + RPP, ... is the same
    const u16* s0 = src + (size_t)(row0 + r) * D + c * 8;
    if (row0 + ROWS <= limit) {  // a full tile: no bounds checks, constant offsets (uniform branch)
#pragma unroll
        for (int i = 0; i < PASSES; ++i) cp_async16(d0 + i * RPP * D * 2, s0 + i * RPP * D, true);
    } else {  // the last, partial tile: rarely taken, kept small (rows past `limit` read nothing, get zeros)
#pragma unroll 1
        for (int i = 0; i < PASSES; ++i) {
            const int row = row0 + r + i * RPP;
            cp_async16(d0 + i * RPP * D * 2, src + (size_t)min(row, limit - 1) * D + c * 8, row < limit);
        }
    }
}

// floor(a / b) for b > 0 and any sign of a (C++ division truncates toward zero).
__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((b - 1 - a) / b); }

// Window mode: does key tile t hold no visible key for query rows q0 .. qlast (a dilated window's gap)?
__device__ __forceinline__ bool window_tile_empty(int t, int BCk, int q0, int qlast, int off, int m, int left,
                                                  int right, int stride) {
    const int lo = t * BCk - qlast - off, hi = min(t * BCk + BCk, m) - 1 - q0 - off;
    const int first = max(lo, -left), last = min(hi, right);
    return floor_div(last, stride) * stride < first;
}

// Window mode's element mask of one 16-row tile: this thread's element (e2, nt, e1) is key c0 + 8 nt + e1 at delta
// d0 - 8 e2 + 8 nt + e1; it is seen when the key exists, the delta lies in [-left, right] and the stride divides it
// (POW2: stride a power of two, tested with an AND instead of an integer division per element).
template <bool POW2, int BC>
__device__ __forceinline__ void mask_window(float (&s)[BC / 8][4], int c0, int d0, int m, int left, int right,
                                            int stride) {
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2)
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
                const int delta = d0 - e2 * 8 + nt * 8 + e1;
                const bool on_stride = POW2 ? (delta & (stride - 1)) == 0 : delta % stride == 0;
                if (!(c0 + nt * 8 + e1 < m && delta >= -left && delta <= right && on_stride))
                    s[nt][e2 * 2 + e1] = NEG_INF;
            }
}

// The same without a dilation (stride 1), the common case: a row sees an interval of keys, so the bounds are taken
// once per row, relative to the thread's first column c0, and each element is two compares with its compile-time
// offset 8 nt + e1 and a select (mask_window spends about twice that: the delta, three compares, the stride test).
// Windows of a few tiles are mostly partial tiles, so this is most of what a small window pays over dense tiles.
template <int BC>
__device__ __forceinline__ void mask_interval(float (&s)[BC / 8][4], int c0, int d0, int m, int left, int right) {
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
        const int lo = e2 * 8 - left - d0, hi = min(e2 * 8 + right - d0, m - 1 - c0);  // offsets seen: lo .. hi
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1)
                if (nt * 8 + e1 < lo || nt * 8 + e1 > hi) s[nt][e2 * 2 + e1] = NEG_INF;
    }
}

template <class Ty, int D, int BC, bool LIST>
__device__ void attn_sparse(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                            u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk, float scale,
                            int left, int right, int stride, int reverse, const int* __restrict__ row_ptr,
                            const int* __restrict__ tiles, const int* __restrict__ slots,
                            const u32* __restrict__ bits) {
    extern __shared__ __align__(16) u16 smem[];
    const u32 qs = smem_addr(smem);             // [BR][D], swizzled; read again for every key tile
    const u32 kbuf = qs + BR * D * 2;           // two stages of [BC][D], swizzled
    const u32 vbuf = kbuf + 2 * BC * D * 2;     // two stages of [BC][D], swizzled

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int bx = reverse ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = bx * BR;
    const u16* qb = q + ((size_t)b * H + h) * n * D;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const int wrow = warp * 16 * MT;  // first row of this warp inside the block
    const int off = m - n;            // query i stands at position i + off
    const int qlast = min(q0 + BR, n) - 1;
    // The computed tiles of this block: positions p = pbeg .. pend - 1 of its list (LIST), or the key tiles
    // p = pbeg .. pend - 1 that the window reaches (window mode).
    int pbeg, pend;
    if (LIST) {
        pbeg = __ldg(row_ptr + bx);
        pend = __ldg(row_ptr + bx + 1);
    } else {
        const int jlo = max(0, q0 + off - left), jhi = min(m - 1, qlast + off + right);
        pbeg = jlo / BC;
        pend = jhi >= jlo ? jhi / BC + 1 : pbeg;
    }
    // The next computed position from p on (window mode skips the tiles a dilation leaves empty).
    auto next_from = [&](int p) {
        if (!LIST && stride > 1)
            while (p < pend && window_tile_empty(p, BC, q0, qlast, off, m, left, right, stride)) ++p;
        return p;
    };
    auto key_tile = [&](int p) { return LIST ? __ldg(tiles + p) : p; };
    const float scale2 = scale * LOG2E;

    int p = next_from(pbeg);
    copy_rows<D, BR>(qs, qb, q0, n);
    // The stage of a tile: list mode visits positions p, p + 1, ..., so p's parity alternates and no counter is
    // kept; window mode may skip positions (a dilation's empty tiles) and counts its iterations.
    if (p < pend) {
        const int k0 = key_tile(p) * BC;
        const u32 st = LIST ? (p & 1) * BC * D * 2 : 0;
        copy_rows<D, BC>(kbuf + st, kb, k0, m);
        copy_rows<D, BC>(vbuf + st, vb, k0, m);
    }
    cp_async_commit();

    // ldmatrix lane pattern of Q and V (A order): row lrow of a 16-row block, chunk C + lane / 16. The swizzled
    // byte column of chunk C (C even, a compile-time constant) is (C & ~7) * 16 + (((C & 7) * 16) ^ tsw): one XOR
    // with an immediate, the rest folds into the address.
    const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;
    const u32 tsw = (u32)((lane >> 4) ^ (lane & 7)) << 4;
    const u32 qlane = qs + (wrow + lrow) * D * 2;
#define SWCOL(C) (((C) & ~7) * 16 + ((((C) & 7) << 4) ^ tsw))
// K's (B order): row krow, chunk C + lane / 8 % 2; the same arithmetic with its own swizzle term ktsw.
#define KSWCOL(C) (((C) & ~7) * 16 + ((((C) & 7) << 4) ^ ktsw))

    float oacc[MT][D / 8][4];
    float mx[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) oacc[mt][nt][0] = oacc[mt][nt][1] = oacc[mt][nt][2] = oacc[mt][nt][3] = 0.f;
        mx[mt][0] = mx[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
    }

    for (int it = 0; p < pend; ++it) {
        const int k0 = key_tile(p) * BC;
        const int pn = next_from(p + 1);
        // Re-derived every tile on purpose: hoisted out of the loop, the 16 Q fragment addresses would each hold
        // a register for the whole loop, and at d = 128 there are none to spare (ptxas spilled).
        u32 qtile;
        asm volatile("mov.u32 %0, %1;" : "=r"(qtile) : "r"(qlane));
        // The K and V lane terms are re-derived every tile from the lane, for the same reason.
        u32 ln;
        asm volatile("mov.u32 %0, %1;" : "=r"(ln) : "r"(lane));
        const int stage = LIST ? p & 1 : it & 1;
        const u32 ktsw = (((ln >> 3) & 1) ^ (ln & 7)) << 4;
        const u32 klane = kbuf + stage * BC * D * 2 + ((ln & 7) + (ln >> 4) * 8) * D * 2;
        const u32 vlane = vbuf + stage * BC * D * 2 + ((ln & 7) + ((ln >> 3) & 1) * 8) * D * 2;  // Q's pattern
        cp_async_wait<0>();  // this thread's part of this tile (and, on the first, of Q): the only group in flight
        // Everyone's part of this tile has landed; and every warp is done with the previous one, so its buffers
        // are free for the next.
        __syncthreads();
        if (pn < pend) {
            const int kn = key_tile(pn) * BC;
            copy_rows<D, BC>(kbuf + (stage ^ 1) * BC * D * 2, kb, kn, m);
            copy_rows<D, BC>(vbuf + (stage ^ 1) * BC * D * 2, vb, kn, m);
            cp_async_commit();
        }

        // S = Q K^T for both 16-row tiles: each K fragment (ldmatrix.x4: 16 keys x 16 d) feeds 4 mma.
        float s[MT][BC / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldsm_x4(qa[mt], qtile + mt * 16 * D * 2 + SWCOL(kk * 2));
#pragma unroll
            for (int nt = 0; nt < BC / 8; nt += 2) {
                // blocks: (keys nt, d lo), (keys nt, d hi), (keys nt+1, d lo), (keys nt+1, d hi)
                u32 bf[4];
                ldsm_x4(bf, klane + nt * 8 * D * 2 + KSWCOL(kk * 2));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Ty::mma(s[mt][nt], qa[mt], bf[0], bf[1]);
                    Ty::mma(s[mt][nt + 1], qa[mt], bf[2], bf[3]);
                }
            }
        }

        // Which mask this tile needs (uniform over the block): PARTIAL tiles the pattern's, a FULL tile only the
        // columns past m of a last, ragged key tile; other FULL tiles none.
        // List mode reads its slot and bits only now: the copy through a volatile mov keeps ptxas from hoisting
        // those loads above the ldmatrix of S, where their registers would make d = 128 spill.
        int pm;
        asm volatile("mov.u32 %0, %1;" : "=r"(pm) : "r"(p));
        const bool window_partial = !LIST && (k0 - qlast - off < -left || min(k0 + BC, m) - 1 - q0 - off > right ||
                                              stride > 1);
        const bool ragged = k0 + BC > m;

        // Online softmax: max in raw units, exponents as one FFMA, O rescaled only if some row's max moved.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int slot = LIST ? __ldg(slots + pm) : -1;
            // A cut tile (window mode) is cut again per 16-row tile, warp by warp: beside the diagonal and the far
            // edge of a window, some of its rows often see all its keys. Full tiles skip the test.
            bool cut = window_partial;
            if (!LIST && cut && stride == 1) {
                u32 wv;  // the warp's first row re-derived here: kept from the prologue, it made d = 128 spill
                asm volatile("mov.u32 %0, %1;" : "=r"(wv) : "r"(warp));
                const int rt = q0 + (int)wv * 16 * MT + mt * 16;
                cut = k0 - (rt + 15) - off < -left || min(k0 + BC, m) - 1 - rt - off > right;
            }
            if (LIST ? slot >= 0 : cut) {
                if (LIST) {
                    // This thread's bits of the tile (BC / 2 of its 32), in its fragment order: one coalesced load per 16-row
                    // tile. Bit (e / 2) * BC / 4 + 2 nt + e % 2 is element e of fragment nt.
                    const u32 w = __ldg(bits + ((size_t)slot * MT + mt) * NTHREADS + threadIdx.x);
#pragma unroll
                    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (!((w >> ((e >> 1) * (BC / 4) + nt * 2 + (e & 1))) & 1u)) s[mt][nt][e] = NEG_INF;
                } else {
                    const int c0 = k0 + tg * 2, d0 = c0 - (q0 + wrow + mt * 16 + g + off);  // first column, delta
                    if (stride == 1)  // uniform branches: no dilation; a power of two tests with an AND
                        mask_interval<BC>(s[mt], c0, d0, m, left, right);
                    else if ((stride & (stride - 1)) == 0)
                        mask_window<true, BC>(s[mt], c0, d0, m, left, right, stride);
                    else
                        mask_window<false, BC>(s[mt], c0, d0, m, left, right, stride);
                }
            } else if (!LIST && ragged) {  // (list mode: the launcher makes a ragged tile PARTIAL)
#pragma unroll
                for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (k0 + nt * 8 + tg * 2 + (e & 1) >= m) s[mt][nt][e] = NEG_INF;
            }
            float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt) {
                t0 = fmaxf(t0, fmaxf(s[mt][nt][0], s[mt][nt][1]));
                t1 = fmaxf(t1, fmaxf(s[mt][nt][2], s[mt][nt][3]));
            }
            const float mn0 = fmaxf(mx[mt][0], quad_max(t0)), mn1 = fmaxf(mx[mt][1], quad_max(t1));
            const float ms0 = mn0 == NEG_INF ? 0.f : mn0 * scale2, ms1 = mn1 == NEG_INF ? 0.f : mn1 * scale2;
            const float c0 = ex2(mx[mt][0] * scale2 - ms0), c1 = ex2(mx[mt][1] * scale2 - ms1);
            float r0 = 0.f, r1 = 0.f;
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt) {
                s[mt][nt][0] = ex2(fmaf(s[mt][nt][0], scale2, -ms0));
                s[mt][nt][1] = ex2(fmaf(s[mt][nt][1], scale2, -ms0));
                s[mt][nt][2] = ex2(fmaf(s[mt][nt][2], scale2, -ms1));
                s[mt][nt][3] = ex2(fmaf(s[mt][nt][3], scale2, -ms1));
                r0 += s[mt][nt][0] + s[mt][nt][1];
                r1 += s[mt][nt][2] + s[mt][nt][3];
            }
            l[mt][0] = l[mt][0] * c0 + r0;
            l[mt][1] = l[mt][1] * c1 + r1;
            if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {  // uniform branch: one vote per warp
#pragma unroll
                for (int nt = 0; nt < D / 8; ++nt) {
                    oacc[mt][nt][0] *= c0;
                    oacc[mt][nt][1] *= c0;
                    oacc[mt][nt][2] *= c1;
                    oacc[mt][nt][3] *= c1;
                }
            }
            mx[mt][0] = mn0;
            mx[mt][1] = mn1;
        }

        // O += P V: each V fragment (ldmatrix.x4.trans: 16 keys x 16 columns) feeds 4 mma.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            u32 pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = Ty::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = Ty::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = Ty::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = Ty::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                u32 bf[4];
                ldsm_x4_t(bf, vlane + kk * 16 * D * 2 + SWCOL(nt));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Ty::mma(oacc[mt][nt], pa[mt], bf[0], bf[1]);
                    Ty::mma(oacc[mt][nt + 1], pa[mt], bf[2], bf[3]);
                }
            }
        }
        p = pn;
    }
    cp_async_wait<0>();  // (no computed tile: the Q copy is still owed)
#undef SWCOL
#undef KSWCOL

    // Re-read the block, head and batch index here: kept from the prologue, the output pointers would hold registers
    // through the whole loop (ptxas spilled them at d = 128).
    int xx, hh, bb;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(xx));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(hh));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(bb));
    // List mode re-derives q0 as well (it needs no q0 in the loop); window mode keeps it (ptxas spills otherwise).
    const int qo = LIST ? (reverse ? gridDim.x - 1 - xx : xx) * BR : q0;
    u16* ob = o + ((size_t)bb * H + hh) * n * D;
    float* lb = lse + ((size_t)bb * H + hh) * n;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int row0 = qo + wrow + mt * 16 + g, row1 = row0 + 8;
        const float l0 = quad_sum(l[mt][0]), l1 = quad_sum(l[mt][1]);
        const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int c = nt * 8 + tg * 2;
            if (row0 < n) *(u32*)(ob + (size_t)row0 * D + c) = Ty::pack(oacc[mt][nt][0] * i0, oacc[mt][nt][1] * i0);
            if (row1 < n) *(u32*)(ob + (size_t)row1 * D + c) = Ty::pack(oacc[mt][nt][2] * i1, oacc[mt][nt][3] * i1);
        }
        if (tg == 0) {
            if (row0 < n) lb[row0] = l0 > 0.f ? (mx[mt][0] * scale2 + __log2f(l0)) * LN2 : NEG_INF;
            if (row1 < n) lb[row1] = l1 > 0.f ? (mx[mt][1] * scale2 + __log2f(l1)) * LN2 : NEG_INF;
        }
    }
}

// Window mode and list mode share the arguments (the list pointers are unused, and may be null, in window mode).
#define DEFINE_KERNEL(NAME, TY, D, LIST)                                                                           \
    extern "C" __global__ void __launch_bounds__(NTHREADS)                                                         \
        NAME(const u16* q, const u16* k, const u16* v, u16* o, float* lse, int n, int m, int H, int Hk, float scale, \
             int left, int right, int stride, int reverse, const int* row_ptr, const int* tiles, const int* slots,  \
             const u32* bits) {                                                                     \
        attn_sparse<TY, D, (D == 128 ? BC_D128 : BC_D64), LIST>(q, k, v, o, lse, n, m, H, Hk, scale, left, right,  \
                                                                 stride, reverse, row_ptr, tiles, slots, bits);     \
    }

DEFINE_KERNEL(attn_window_f16_d64, F16, 64, false)
DEFINE_KERNEL(attn_window_f16_d128, F16, 128, false)
DEFINE_KERNEL(attn_window_bf16_d64, BF16, 64, false)
DEFINE_KERNEL(attn_window_bf16_d128, BF16, 128, false)
DEFINE_KERNEL(attn_blocks_f16_d64, F16, 64, true)
DEFINE_KERNEL(attn_blocks_f16_d128, F16, 128, true)
DEFINE_KERNEL(attn_blocks_bf16_d64, BF16, 64, true)
DEFINE_KERNEL(attn_blocks_bf16_d128, BF16, 128, true)
