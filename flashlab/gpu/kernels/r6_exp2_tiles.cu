// Rung 6 -- exp2 with log2(e) folded into the scale, one division by l at the end, larger tiles, and causal
// masking that skips fully masked tiles. Needs sm_80 or newer.
//
// Changes from rung 5 (FlashAttention-2's changes to the inner loop):
// * e^x = 2^(x log2 e): multiplying the scale by log2(e) once lets every exponential be a bare ex2.approx
//   (one MUFU instruction) instead of expf's range reduction; the running max m is kept in the same base-2
//   units, and the logsumexp is converted back with one multiply by ln 2 at the end.
// * O and l stay unnormalised until the very end: per tile, O is only rescaled by 2^(m_old - m_new), and each
//   thread keeps a partial row sum l over its own columns (the rescale factor is the same for the 4 threads of
//   a row). One division by l and one quad reduction per row at the end, instead of a reciprocal, a reduction
//   and a multiply of P per tile.
// * Larger blocks: NWARPS warps (8 by default, 128 query rows) share each K/V tile, halving the traffic from
//   L2 to shared memory per query row; blocks are compiled with -DNWARPS / -DBC for tuning.
// * Causal: a block stops at the last key its last row may see, and only the tiles that cross the diagonal (or
//   the end of the keys) pay for the mask. Blocks are launched longest first (query tiles in reverse), so the
//   short ones fill in the tail.
//
// Each change can be undone alone, to time what it brings (python -m flashlab bench ablate): -DABLATE_EXP2 takes
// every exponential through expf, -DABLATE_DEFERRED_NORM normalises P and O every tile (rung 5's way),
// -DNWARPS=4 gives 64-row blocks, -DABLATE_CAUSAL_SKIP makes causal blocks visit every key tile (masked).
//
// Inputs fp16 or bf16 (raw 16-bit patterns). Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q,
// lse (B, H, n) fp32. Grid: (ceil(n / BR), H, B); block: 32 * NWARPS threads;
// dynamic shared memory: (BR + 2 * 2 * BC) * D * 2 bytes (96 KB at D = 128 with the defaults).

#define NEG_INF (-__int_as_float(0x7f800000))
#ifndef NWARPS
#define NWARPS 8
#endif
#ifndef BC
#define BC 64
#endif
#define BR (16 * NWARPS)
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
        asm volatile(
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
        asm volatile(
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
#ifdef ABLATE_EXP2
#define EXP2(x) expf((x) * LN2)  // the same power of two, through the library's e^x
#else
#define EXP2(x) ex2(x)
#endif
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
// Offset (in elements) of 16-byte chunk c of row r in a swizzled [rows][D] tile.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
    return r * D + ((c ^ (r & 7)) << 3);
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

// Issue the copies of one [BC][D] tile (rows k0 .. k0+BC-1 of src, zeros past row m) into a swizzled buffer.
template <int D>
__device__ __forceinline__ void load_tile(u16* dst, const u16* src, int k0, int m) {
    for (int e = threadIdx.x; e < BC * D / 8; e += NTHREADS) {
        const int r = e / (D / 8), c = e % (D / 8);
        const bool valid = k0 + r < m;
        cp_async16(smem_addr(dst + swz<D>(r, c)), src + (size_t)(valid ? k0 + r : 0) * D + c * 8, valid);
    }
}

template <class Ty, int D>
__device__ void attn_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                         u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk, float scale,
                         int causal) {
    extern __shared__ __align__(16) u16 smem[];
    u16* qs = smem;                    // [BR][D], swizzled
    u16* kbuf = qs + BR * D;           // two stages of [BC][D], swizzled
    u16* vbuf = kbuf + 2 * BC * D;     // two stages of [BC][D], swizzled

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    // Causal blocks run longest first: the last query tile sees the most keys.
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;
    const u16* qb = q + ((size_t)b * H + h) * n * D;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    // Keys the block may see: all of them, or (causal) up to the last row's diagonal. Rows past n count as n-1.
#ifdef ABLATE_CAUSAL_SKIP
    const int block_kend = m;  // every tile, the ones past the diagonal masked whole
#else
    const int block_kend = causal ? min(m, min(q0 + BR, n) + (m - n)) : m;
#endif
    const int ntiles = block_kend > 0 ? (block_kend + BC - 1) / BC : 0;
    // Tiles starting at or after this key need the mask: they cross the first row's diagonal, or key m.
    const int mask_from = causal ? min(q0 + (m - n) + 1 - BC + 1, m - BC + 1) : m - BC + 1;
    const float scale2 = scale * LOG2E;

    // Prologue: Q and the first K/V tile in flight together; Q must land before it goes to registers.
    for (int e = threadIdx.x; e < BR * D / 8; e += NTHREADS) {
        const int r = e / (D / 8), c = e % (D / 8);
        const bool valid = q0 + r < n;
        cp_async16(smem_addr(qs + swz<D>(r, c)), qb + (size_t)(valid ? q0 + r : 0) * D + c * 8, valid);
    }
    if (ntiles > 0) {
        load_tile<D>(kbuf, kb, 0, m);
        load_tile<D>(vbuf, vb, 0, m);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldsm_x4(qf[kk], smem_addr(qs + swz<D>(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4))));

    float oacc[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) oacc[nt][0] = oacc[nt][1] = oacc[nt][2] = oacc[nt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const int kend0 = causal ? min(m, row0 + (m - n) + 1) : m;  // keys row0 may see
    const int kend1 = causal ? min(m, row1 + (m - n) + 1) : m;

    for (int t = 0; t < ntiles; ++t) {
        const int k0 = t * BC;
        u16* ks = kbuf + (t & 1) * BC * D;
        u16* vs = vbuf + (t & 1) * BC * D;
        // Start copying tile t+1 into the other buffer, then wait only for tile t.
        if (t + 1 < ntiles) {
            load_tile<D>(kbuf + ((t + 1) & 1) * BC * D, kb, k0 + BC, m);
            load_tile<D>(vbuf + ((t + 1) & 1) * BC * D, vb, k0 + BC, m);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // tile t is visible to every warp

        // S = Q K^T. One ldmatrix.x4 gives the B fragments of 8 keys for two 16-wide steps along d.
        float s[BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                u32 bf[4];
                ldsm_x4(bf, smem_addr(ks + swz<D>(nt * 8 + (lane & 7), kk * 2 + (lane >> 3))));
                Ty::mma(s[nt], qf[kk], bf[0], bf[1]);
                Ty::mma(s[nt], qf[kk + 1], bf[2], bf[3]);
            }
        }

        // Scale into base-2 units; mask only the tiles that need it (diagonal tiles, the tile holding key m).
        if (k0 >= mask_from) {
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = k0 + nt * 8 + tg * 2 + (e & 1);
                    s[nt][e] = col < (e < 2 ? kend0 : kend1) ? s[nt][e] * scale2 : NEG_INF;
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] *= scale2;
        }
        float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            t0 = fmaxf(t0, fmaxf(s[nt][0], s[nt][1]));
            t1 = fmaxf(t1, fmaxf(s[nt][2], s[nt][3]));
        }
        const float mn0 = fmaxf(m0, quad_max(t0)), mn1 = fmaxf(m1, quad_max(t1));
        const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;  // no (-inf) - (-inf)
        const float c0 = EXP2(m0 - ms0), c1 = EXP2(m1 - ms1);
        float r0 = 0.f, r1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = EXP2(s[nt][0] - ms0);
            s[nt][1] = EXP2(s[nt][1] - ms0);
            s[nt][2] = EXP2(s[nt][2] - ms1);
            s[nt][3] = EXP2(s[nt][3] - ms1);
            r0 += s[nt][0] + s[nt][1];
            r1 += s[nt][2] + s[nt][3];
        }
#ifdef ABLATE_DEFERRED_NORM
        // Normalised every tile: the row's whole sum (quad reduction), a reciprocal, P scaled by it, and O by
        // the ratio of the old sum to the new one.
        const float ln0 = l0 * c0 + quad_sum(r0), ln1 = l1 * c1 + quad_sum(r1);
        const float inv0 = ln0 > 0.f ? 1.f / ln0 : 0.f, inv1 = ln1 > 0.f ? 1.f / ln1 : 0.f;
        const float f0 = l0 * c0 * inv0, f1 = l1 * c1 * inv1;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] *= inv0;
            s[nt][1] *= inv0;
            s[nt][2] *= inv1;
            s[nt][3] *= inv1;
        }
        l0 = ln0;
        l1 = ln1;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            oacc[nt][0] *= f0;
            oacc[nt][1] *= f0;
            oacc[nt][2] *= f1;
            oacc[nt][3] *= f1;
        }
#else
        // Unnormalised: l and O are only rescaled; l is this thread's partial sum (reduced at the end).
        l0 = l0 * c0 + r0;
        l1 = l1 * c1 + r1;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            oacc[nt][0] *= c0;
            oacc[nt][1] *= c0;
            oacc[nt][2] *= c1;
            oacc[nt][3] *= c1;
        }
#endif
        m0 = mn0, m1 = mn1;

        // O += P V. P's A fragment for keys 16kk..16kk+15 is made of S tiles 2kk and 2kk+1.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            u32 pa[4];
            pa[0] = Ty::pack(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = Ty::pack(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = Ty::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = Ty::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            // V's B fragments for 16 keys and two 8-wide column tiles: one transposing ldmatrix.x4.
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                u32 bf[4];
                ldsm_x4_t(bf, smem_addr(vs + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, nt + (lane >> 4))));
                Ty::mma(oacc[nt], pa, bf[0], bf[1]);
                Ty::mma(oacc[nt + 1], pa, bf[2], bf[3]);
            }
        }
        __syncthreads();  // every warp is done with this buffer before the next iteration refills it
    }

    // The one division: finish each row's sum across its quad, divide, write O and the logsumexp.
#ifdef ABLATE_DEFERRED_NORM
    const float i0 = 1.f, i1 = 1.f;  // O is already normalised, l already the row's whole sum
#else
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
#endif
    u16* ob = o + ((size_t)b * H + h) * n * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int c = nt * 8 + tg * 2;
        if (row0 < n) *(u32*)(ob + (size_t)row0 * D + c) = Ty::pack(oacc[nt][0] * i0, oacc[nt][1] * i0);
        if (row1 < n) *(u32*)(ob + (size_t)row1 * D + c) = Ty::pack(oacc[nt][2] * i1, oacc[nt][3] * i1);
    }
    if (tg == 0) {
        float* lb = lse + ((size_t)b * H + h) * n;
        if (row0 < n) lb[row0] = l0 > 0.f ? (m0 + __log2f(l0)) * LN2 : NEG_INF;
        if (row1 < n) lb[row1] = l1 > 0.f ? (m1 + __log2f(l1)) * LN2 : NEG_INF;
    }
}

#define DEFINE_KERNEL(NAME, TY, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(NTHREADS) NAME(const u16* q, const u16* k, const u16* v, \
                                                                u16* o, float* lse, int n, int m, int H,  \
                                                                int Hk, float scale, int causal) {        \
        attn_mma<TY, D>(q, k, v, o, lse, n, m, H, Hk, scale, causal);                                     \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
