// Rung 12 -- three blocks per SM at d = 64: one goal, reached in two parts that free registers.
//
// The goal, from the occupancy arithmetic: at d = 64 a thread of rung 11 holds 174 registers (nvcc 13, sm_90), so
// an SM (65,536 registers) runs two blocks of 128 threads, 8 warps. While a warp works through the softmax of its
// tile (exponentials, maxima, shuffles) its tensor cores idle unless another warp has an mma ready, and at d = 64
// the softmax is a large share of a tile's time beside its mma: more warps per SM hide more of it. Three blocks need
// <= 170 registers a thread (168: registers are given out in eights), asked of ptxas by
// __launch_bounds__(128, 3). Given rung 11's loop it finds them with 48 bytes of spill stores to local memory.
// The two parts, each ablated with nvcc 13 (ptxas -v at 168 registers, d = 64):
//   1. P packed to 16 bits as soon as it is computed (rung 11 packed it just before P V): the tile's 32-bit
//      exponentials die at once. Alone: no spill on sm_80 and sm_86, 12 bytes of spill stores on sm_90.
//   2. The four row sums l of the thread's rows in shared memory, read and written once per tile, in a layout
//      where a warp touches 32 consecutive words, one per bank (element [mt][e][thread]),
//      2 KB per block. Alone (P packed late): 4 bytes of spill on sm_80 and sm_86, 16 on sm_90.
//   Both: no spill on any architecture at 168 registers, and the block's 50 KB of shared memory still lets three
//   blocks share an SM of sm_80 or sm_90 (one on sm_86 / sm_89, where "best" keeps rung 11).
// At d = 128 only part 1 applies (the row sums stay in registers; a block needs 96 KB of shared memory and 255
// registers a thread, two blocks per SM, as rung 11).
// Everything else is rung 11's.
//
// Inputs fp16 or bf16 (raw 16-bit patterns). Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q,
// lse (B, H, n) fp32. Grid: (ceil(n / BR), H, B) with BR = 32 * NWARPS; block: 32 * NWARPS threads;
// dynamic shared memory: (BR + 2 * 2 * BC) * D * 2 bytes (96 KB at D = 128), plus MT * 2 * 32 * NWARPS * 4 bytes
// of row sums at D = 64 (50 KB with the defaults).
// Needs sm_80 or newer.

#define NEG_INF (-__int_as_float(0x7f800000))
#ifndef NWARPS
#define NWARPS 4
#endif
// Keys per tile, by head dimension. With the leaner softmax, 64-key tiles fit in registers at d = 128 too.
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

template <class Ty, int D, int BC>
__device__ void attn_three_blocks(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                             u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk,
                             float scale, int causal){
    extern __shared__ __align__(16) u16 smem[];
    const u32 qs = smem_addr(smem);             // [BR][D], swizzled; read again for every key tile
    const u32 kbuf = qs + BR * D * 2;           // two stages of [BC][D], swizzled
    const u32 vbuf = kbuf + 2 * BC * D * 2;     // two stages of [BC][D], swizzled

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;  // causal: longest blocks first
    const u16* qb = q + ((size_t)b * H + h) * n * D;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const int wrow = warp * 16 * MT;  // first row of this warp inside the block
    // This thread holds rows g and g + 8 of each 16-row tile; row (mt, e) = q0 + wrow + 16 mt + 8 e + g may see
    // keys below kbase + 16 mt + 8 e (causal), kbase = q0 + wrow + g + m - n + 1: computed in the masking branch.
    const int block_kend = causal ? min(m, min(q0 + BR, n) + (m - n)) : m;
    const int ntiles = block_kend > 0 ? (block_kend + BC - 1) / BC : 0;
    const int mask_from = causal ? min(q0 + (m - n) + 2 - BC, m - BC + 1) : m - BC + 1;
    const float scale2 = scale * LOG2E;

    copy_rows<D, BR>(qs, qb, q0, n);
    if (ntiles > 0) {
        copy_rows<D, BC>(kbuf, kb, 0, m);
        copy_rows<D, BC>(vbuf, vb, 0, m);
    }
    cp_async_commit();

    // ldmatrix lane pattern of Q and V (A order): row lrow of a 16-row block, chunk C + lane / 16. The swizzled
    // byte column of chunk C (C even, a compile-time constant) is (C & ~7) * 16 + (((C & 7) * 16) ^ tsw): one XOR
    // with an immediate, the rest folds into the address.
    const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;
    const u32 tsw = (u32)((lane >> 4) ^ (lane & 7)) << 4;
    const u32 qlane = qs + (wrow + lrow) * D * 2;
#define SWCOL(C) (((C) & ~7) * 16 + ((((C) & 7) << 4) ^ tsw))
// K's lane pattern (B order): row lane % 8 + 8 * (lane / 16), chunk C + lane / 8 % 2; the same arithmetic with
// its own swizzle term ktsw = ((lane / 8 % 2) ^ (lane % 8)) * 16, set in the loop.
#define KSWCOL(C) (((C) & ~7) * 16 + ((((C) & 7) << 4) ^ ktsw))

    float oacc[MT][D / 8][4];
    float mx[MT][2];
    // The row sums: registers at d = 128; at d = 64 shared memory after V's buffers, [mt][e][thread] (the header).
    constexpr bool L_SHARED = D == 64;
    float lreg[MT][2];
    float* const lsh = reinterpret_cast<float*>(smem + (BR + 4 * BC) * D) + threadIdx.x;
    auto l = [&](int mt, int e) -> float& { return L_SHARED ? lsh[(mt * 2 + e) * NTHREADS] : lreg[mt][e]; };
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) oacc[mt][nt][0] = oacc[mt][nt][1] = oacc[mt][nt][2] = oacc[mt][nt][3] = 0.f;
        mx[mt][0] = mx[mt][1] = NEG_INF;
        l(mt, 0) = l(mt, 1) = 0.f;
    }

    for (int t = 0; t < ntiles; ++t) {
        const int k0 = t * BC;
        // Re-derived every tile on purpose: hoisted out of the loop, the 16 Q fragment addresses would each hold
        // a register for the whole loop, and at d = 128 there are none to spare (ptxas spilled).
        u32 qtile;
        asm volatile("mov.u32 %0, %1;" : "=r"(qtile) : "r"(qlane));
        // The K and V lane terms are re-derived every tile from the lane, for the reason Q's address is: kept from
        // the prologue they would hold registers through the loop, and at d = 128 ptxas then spills more.
        u32 ln;
        asm volatile("mov.u32 %0, %1;" : "=r"(ln) : "r"(lane));
        const u32 ktsw = (((ln >> 3) & 1) ^ (ln & 7)) << 4;
        const u32 klane = kbuf + (t & 1) * BC * D * 2 + ((ln & 7) + (ln >> 4) * 8) * D * 2;
        const u32 vlane = vbuf + (t & 1) * BC * D * 2 + ((ln & 7) + ((ln >> 3) & 1) * 8) * D * 2;  // Q's pattern
        cp_async_wait<0>();  // this thread's part of tile t (and, at t = 0, of Q): the only group in flight
        // Everyone's part of tile t has landed; and every warp is done with tile t - 1, so its buffers are free.
        __syncthreads();
        if (t + 1 < ntiles) {
            copy_rows<D, BC>(kbuf + ((t + 1) & 1) * BC * D * 2, kb, k0 + BC, m);
            copy_rows<D, BC>(vbuf + ((t + 1) & 1) * BC * D * 2, vb, k0 + BC, m);
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

        // Online softmax: max in raw units, exponents as one FFMA, O rescaled only if some row's max moved.
        u32 pa[MT][BC / 16][4];  // P as the A operand of P V, 16 keys per fragment
        const bool need_mask = k0 >= mask_from;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (need_mask) {
                // kbase from the block index and the lane, re-read here: kept from the prologue it would hold a
                // register through the whole loop for the few tiles that need it (at d = 128, ptxas spilled).
                int bx;
                asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
                u32 lm;
                asm volatile("mov.u32 %0, %1;" : "=r"(lm) : "r"(lane));
                const int kbase = (causal ? gridDim.x - 1 - bx : bx) * BR + wrow + (lm >> 2) + (m - n) + 1;
#pragma unroll
                for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int lim = causal ? min(m, kbase + mt * 16 + (e >> 1) * 8) : m;
                        if (k0 + nt * 8 + tg * 2 + (e & 1) >= lim) s[mt][nt][e] = NEG_INF;
                    }
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
            // P packed to 16 bits at once (rung 11 packed it just before P V): the 32-bit exponentials of this
            // 16-row tile die here, and a thread holds half the registers for P until the mma reads it.
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                pa[mt][kk][0] = Ty::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][kk][1] = Ty::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][kk][2] = Ty::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][kk][3] = Ty::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
            l(mt, 0) = l(mt, 0) * c0 + r0;
            l(mt, 1) = l(mt, 1) * c1 + r1;
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
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                u32 bf[4];
                ldsm_x4_t(bf, vlane + kk * 16 * D * 2 + SWCOL(nt));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Ty::mma(oacc[mt][nt], pa[mt][kk], bf[0], bf[1]);
                    Ty::mma(oacc[mt][nt + 1], pa[mt][kk], bf[2], bf[3]);
                }
            }
        }
    }
    cp_async_wait<0>();  // (ntiles = 0: the Q copy is still owed)
#undef SWCOL
#undef KSWCOL

    // Re-read the head and batch index here: kept from the prologue, the output pointers would hold registers
    // through the whole loop (ptxas spilled them at d = 128).
    int hh, bb;
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(hh));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(bb));
    u16* ob = o + ((size_t)bb * H + hh) * n * D;
    float* lb = lse + ((size_t)bb * H + hh) * n;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int row0 = q0 + wrow + mt * 16 + g, row1 = row0 + 8;
        const float l0 = quad_sum(l(mt, 0)), l1 = quad_sum(l(mt, 1));
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

#define DEFINE_KERNEL(NAME, TY, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(NTHREADS, D == 64 ? 3 : 1) NAME(const u16* q, const u16* k, const u16* v, \
                                                                u16* o, float* lse, int n, int m, int H,  \
                                                                int Hk, float scale, int causal) {        \
        attn_three_blocks<TY, D, (D == 128 ? BC_D128 : BC_D64)>(q, k, v, o, lse, n, m, H, Hk, scale, causal);     \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
