// Rung 8 -- a leaner softmax: one FFMA per exponent and O rescaled only when a row's max moved. sm_80+.
//
// Change from rung 7, both in the non-matmul work that sits between the two mma phases of every tile:
// * The running max is kept in raw score units (max commutes with a positive scale), so each exponent is
//   2^(s * scale log2 e - m * scale log2 e): one FFMA feeding ex2, instead of a multiply, a subtract and ex2.
//   This needs scale > 0 (flashlab.gpu falls back to rung 7 otherwise).
// * After the first few tiles the running max of a row rarely grows, and then the factor 2^(m_old - m_new) is
//   exactly 1: the warp checks (one vote) whether any of its rows moved and skips the 64 or 128 multiplies
//   that rescale its O accumulators when none did.
// * The registers this frees let d = 128 use 64-key tiles (rung 7: 32) without spilling: half the barriers,
//   max reductions and rescale checks per key.
//
// Each change can be undone alone, to time what it brings (python -m flashlab bench ablate): -DABLATE_RAW_MAX
// keeps the max in scaled units again (a multiply, then a subtract feeding ex2), -DABLATE_SKIP_RESCALE rescales O
// every tile, -DBC_D128=32 gives d = 128 rung 7's 32-key tiles.
//
// Inputs fp16 or bf16 (raw 16-bit patterns). Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q,
// lse (B, H, n) fp32. Grid: (ceil(n / BR), H, B) with BR = 32 * NWARPS; block: 32 * NWARPS threads;
// dynamic shared memory: (BR + 2 * 2 * BC) * D * 2 bytes (96 KB at D = 128, 48 KB at D = 64 with the defaults).

#define NEG_INF (-__int_as_float(0x7f800000))
#ifdef ABLATE_SKIP_RESCALE
#define RESCALE_ALWAYS true
#else
#define RESCALE_ALWAYS false
#endif
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
template <int D, int BC>
__device__ __forceinline__ void load_tile(u16* dst, const u16* src, int k0, int m) {
    for (int e = threadIdx.x; e < BC * D / 8; e += NTHREADS) {
        const int r = e / (D / 8), c = e % (D / 8);
        const bool valid = k0 + r < m;
        cp_async16(smem_addr(dst + swz<D>(r, c)), src + (size_t)(valid ? k0 + r : 0) * D + c * 8, valid);
    }
}

template <class Ty, int D, int BC>
__device__ void attn_lean(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                            u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk,
                            float scale, int causal) {
    extern __shared__ __align__(16) u16 smem[];
    u16* qs = smem;                 // [BR][D], swizzled; read again for every key tile
    u16* kbuf = qs + BR * D;        // two stages of [BC][D], swizzled
    u16* vbuf = kbuf + 2 * BC * D;  // two stages of [BC][D], swizzled

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;  // causal: longest blocks first
    const u16* qb = q + ((size_t)b * H + h) * n * D;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const int wrow = warp * 16 * MT;  // first row of this warp inside the block
    // This thread holds rows g and g + 8 of each 16-row tile; row (mt, e) = q0 + wrow + 16 mt + 8 e + g may see
    // keys below kbase + 16 mt + 8 e (causal), computed where needed to save registers.
    const int kbase = causal ? q0 + wrow + g + (m - n) + 1 : m;
    const int block_kend = causal ? min(m, min(q0 + BR, n) + (m - n)) : m;
    const int ntiles = block_kend > 0 ? (block_kend + BC - 1) / BC : 0;
    const int mask_from = causal ? min(q0 + (m - n) + 2 - BC, m - BC + 1) : m - BC + 1;
    const float scale2 = scale * LOG2E;
#ifdef ABLATE_RAW_MAX
    const float mscale = 1.f;  // the running max is kept in scaled units
#else
    const float mscale = scale2;  // the running max is kept in raw units
#endif

    for (int e = threadIdx.x; e < BR * D / 8; e += NTHREADS) {
        const int r = e / (D / 8), c = e % (D / 8);
        const bool valid = q0 + r < n;
        cp_async16(smem_addr(qs + swz<D>(r, c)), qb + (size_t)(valid ? q0 + r : 0) * D + c * 8, valid);
    }
    if (ntiles > 0) {
        load_tile<D, BC>(kbuf, kb, 0, m);
        load_tile<D, BC>(vbuf, vb, 0, m);
    }
    cp_async_commit();

    float oacc[MT][D / 8][4];
    float mx[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) oacc[mt][nt][0] = oacc[mt][nt][1] = oacc[mt][nt][2] = oacc[mt][nt][3] = 0.f;
        mx[mt][0] = mx[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
    }

    for (int t = 0; t < ntiles; ++t) {
        const int k0 = t * BC;
        const u16* ks = kbuf + (t & 1) * BC * D;
        const u16* vs = vbuf + (t & 1) * BC * D;
        if (t + 1 < ntiles) {
            load_tile<D, BC>(kbuf + ((t + 1) & 1) * BC * D, kb, k0 + BC, m);
            load_tile<D, BC>(vbuf + ((t + 1) & 1) * BC * D, vb, k0 + BC, m);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

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
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(qa[mt], smem_addr(qs + swz<D>(wrow + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                      kk * 2 + (lane >> 4))));
#pragma unroll
            for (int nt = 0; nt < BC / 8; nt += 2) {
                // blocks: (keys nt, d lo), (keys nt, d hi), (keys nt+1, d lo), (keys nt+1, d hi)
                u32 bf[4];
                ldsm_x4(bf, smem_addr(ks + swz<D>(nt * 8 + (lane & 7) + (lane >> 4) * 8, kk * 2 + ((lane >> 3) & 1))));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Ty::mma(s[mt][nt], qa[mt], bf[0], bf[1]);
                    Ty::mma(s[mt][nt + 1], qa[mt], bf[2], bf[3]);
                }
            }
        }

        // Online softmax: max in raw units, exponents as one FFMA, O rescaled only if some row's max moved.
        const bool need_mask = k0 >= mask_from;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (need_mask) {
#pragma unroll
                for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int lim = causal ? min(m, kbase + mt * 16 + (e >> 1) * 8) : m;
                        if (k0 + nt * 8 + tg * 2 + (e & 1) >= lim) s[mt][nt][e] = NEG_INF;
                    }
            }
#ifdef ABLATE_RAW_MAX
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] *= scale2;
#endif
            float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt) {
                t0 = fmaxf(t0, fmaxf(s[mt][nt][0], s[mt][nt][1]));
                t1 = fmaxf(t1, fmaxf(s[mt][nt][2], s[mt][nt][3]));
            }
            const float mn0 = fmaxf(mx[mt][0], quad_max(t0)), mn1 = fmaxf(mx[mt][1], quad_max(t1));
            const float ms0 = mn0 == NEG_INF ? 0.f : mn0 * mscale, ms1 = mn1 == NEG_INF ? 0.f : mn1 * mscale;
            const float c0 = ex2(mx[mt][0] * mscale - ms0), c1 = ex2(mx[mt][1] * mscale - ms1);
            float r0 = 0.f, r1 = 0.f;
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt) {
#ifdef ABLATE_RAW_MAX
                s[mt][nt][0] = ex2(s[mt][nt][0] - ms0);
                s[mt][nt][1] = ex2(s[mt][nt][1] - ms0);
                s[mt][nt][2] = ex2(s[mt][nt][2] - ms1);
                s[mt][nt][3] = ex2(s[mt][nt][3] - ms1);
#else
                s[mt][nt][0] = ex2(fmaf(s[mt][nt][0], scale2, -ms0));
                s[mt][nt][1] = ex2(fmaf(s[mt][nt][1], scale2, -ms0));
                s[mt][nt][2] = ex2(fmaf(s[mt][nt][2], scale2, -ms1));
                s[mt][nt][3] = ex2(fmaf(s[mt][nt][3], scale2, -ms1));
#endif
                r0 += s[mt][nt][0] + s[mt][nt][1];
                r1 += s[mt][nt][2] + s[mt][nt][3];
            }
            l[mt][0] = l[mt][0] * c0 + r0;
            l[mt][1] = l[mt][1] * c1 + r1;
            if (RESCALE_ALWAYS || __any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {  // uniform: one vote per warp
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
                ldsm_x4_t(bf, smem_addr(vs + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, nt + (lane >> 4))));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Ty::mma(oacc[mt][nt], pa[mt], bf[0], bf[1]);
                    Ty::mma(oacc[mt][nt + 1], pa[mt], bf[2], bf[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before the next iteration refills it
    }
    cp_async_wait<0>();  // (ntiles = 0: the Q copy is still owed)

    u16* ob = o + ((size_t)b * H + h) * n * D;
    float* lb = lse + ((size_t)b * H + h) * n;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int row0 = q0 + wrow + mt * 16 + g, row1 = row0 + 8;
        const float l0 = quad_sum(l[mt][0]), l1 = quad_sum(l[mt][1]);
        const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int c = nt * 8 + tg * 2;
            if (row0 < n) *(u32*)(ob + (size_t)row0 * D + c) = Ty::pack(oacc[mt][nt][0] * i0, oacc[mt][nt][1] * i0);
            if (row1 < n) *(u32*)(ob + (size_t)row1 * D + c) = Ty::pack(oacc[mt][nt][2] * i1, oacc[mt][nt][3] * i1);
        }
        if (tg == 0) {
            if (row0 < n) lb[row0] = l0 > 0.f ? (mx[mt][0] * mscale + __log2f(l0)) * LN2 : NEG_INF;
            if (row1 < n) lb[row1] = l1 > 0.f ? (mx[mt][1] * mscale + __log2f(l1)) * LN2 : NEG_INF;
        }
    }
}

#define DEFINE_KERNEL(NAME, TY, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(NTHREADS) NAME(const u16* q, const u16* k, const u16* v, \
                                                                u16* o, float* lse, int n, int m, int H,  \
                                                                int Hk, float scale, int causal) {        \
        attn_lean<TY, D, (D == 128 ? BC_D128 : BC_D64)>(q, k, v, o, lse, n, m, H, Hk, scale, causal);                                  \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
