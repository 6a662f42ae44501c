// Rung 3 -- tensor cores: mma.sync.aligned.m16n8k16 through inline PTX. Needs sm_80 or newer.
//
// Change from rung 2: a warp, not a thread, owns query rows -- 16 of them -- and the two matrix products of a
// tile, S = Q K^T and O += P V, run on the tensor cores as 16x8x16 products with fp32 accumulators. S, P and O
// never leave registers: the accumulator layout of S (row g = lane/4 and g+8, columns 2*(lane%4) and +1 of each
// 8-wide tile) is, after a cast to 16 bits, exactly the A-operand layout that P V needs, so P goes from one mma
// to the next without touching memory. Each thread holds two rows' worth of statistics (m, l); a row's max and
// sum are finished with two shuffles across the 4 threads (a "quad") that share the row.
//
// Deliberately naive, for the next rungs to fix: the K and V tiles sit in shared memory row after row, so the
// 8 rows a fragment load touches start in the same bank (8-way bank conflicts); the B fragments of V are built
// from 16-bit loads; loads and math do not overlap; the output is kept normalised after every tile (FA-1
// style: rescale by l_old/l_new, divide P by l_new); causal masking visits every key tile, even fully masked.
//
// Inputs fp16 or bf16 (raw 16-bit patterns). Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q,
// lse (B, H, n) fp32. Grid: (ceil(n / 64), H, B); block: 128 threads (4 warps x 16 rows);
// dynamic shared memory: 2 * 64 * D * 2 bytes.

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 64
#define BC 64
#define NTHREADS 128

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
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <class Ty, int D>
__device__ void attn_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                         u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk, float scale,
                         int causal) {
    extern __shared__ __align__(16) u16 smem[];
    u16* ks = smem;           // [BC][D], plain row-major
    u16* vs = smem + BC * D;  // [BC][D]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, tg = lane & 3;  // row group and thread-in-group of the mma fragment layouts
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const u16* qb = q + ((size_t)b * H + h) * n * D;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const int row0 = blockIdx.x * BR + warp * 16 + g, row1 = row0 + 8;  // this thread's two query rows

    // Q fragments (A operand, 16 rows x D) straight from global memory into registers, once.
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int c = kk * 16 + tg * 2;
        qf[kk][0] = row0 < n ? *(const u32*)(qb + (size_t)row0 * D + c) : 0u;
        qf[kk][1] = row1 < n ? *(const u32*)(qb + (size_t)row1 * D + c) : 0u;
        qf[kk][2] = row0 < n ? *(const u32*)(qb + (size_t)row0 * D + c + 8) : 0u;
        qf[kk][3] = row1 < n ? *(const u32*)(qb + (size_t)row1 * D + c + 8) : 0u;
    }

    float oacc[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) oacc[nt][0] = oacc[nt][1] = oacc[nt][2] = oacc[nt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const int kend0 = causal ? min(m, row0 + (m - n) + 1) : m;  // keys row0 may see
    const int kend1 = causal ? min(m, row1 + (m - n) + 1) : m;

    for (int k0 = 0; k0 < m; k0 += BC) {
        __syncthreads();
        // K and V tiles into shared memory, 16 bytes per thread per step; zeros past key m.
        for (int e = threadIdx.x; e < BC * D / 8; e += NTHREADS) {
            const int r = e / (D / 8), c = (e % (D / 8)) * 8;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
            if (k0 + r < m) {
                kx = *(const uint4*)(kb + (size_t)(k0 + r) * D + c);
                vx = *(const uint4*)(vb + (size_t)(k0 + r) * D + c);
            }
            *(uint4*)(ks + r * D + c) = kx;
            *(uint4*)(vs + r * D + c) = vx;
        }
        __syncthreads();

        // S = Q K^T: B operand element (k = d index, n = key) is K[key][d]; a 32-bit load takes two d's.
        float s[BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u16* kr = ks + (nt * 8 + g) * D + kk * 16 + tg * 2;
                Ty::mma(s[nt], qf[kk], *(const u32*)kr, *(const u32*)(kr + 8));
            }
        }

        // Scale, mask (causal and past m), and the online-softmax update of the two rows.
        float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = k0 + nt * 8 + tg * 2 + (e & 1);
                s[nt][e] = col < (e < 2 ? kend0 : kend1) ? s[nt][e] * scale : NEG_INF;
            }
            t0 = fmaxf(t0, fmaxf(s[nt][0], s[nt][1]));
            t1 = fmaxf(t1, fmaxf(s[nt][2], s[nt][3]));
        }
        const float mn0 = fmaxf(m0, quad_max(t0)), mn1 = fmaxf(m1, quad_max(t1));
        const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;  // no (-inf) - (-inf)
        float r0 = 0.f, r1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = expf(s[nt][0] - ms0);
            s[nt][1] = expf(s[nt][1] - ms0);
            s[nt][2] = expf(s[nt][2] - ms1);
            s[nt][3] = expf(s[nt][3] - ms1);
            r0 += s[nt][0] + s[nt][1];
            r1 += s[nt][2] + s[nt][3];
        }
        const float ln0 = l0 * expf(m0 - ms0) + quad_sum(r0);
        const float ln1 = l1 * expf(m1 - ms1) + quad_sum(r1);
        // Keep O normalised (FA-1 style): O <- O * (l_old e^(m_old - m_new) / l_new) + P V / l_new.
        const float i0 = ln0 > 0.f ? 1.f / ln0 : 0.f, i1 = ln1 > 0.f ? 1.f / ln1 : 0.f;
        const float a0 = l0 * expf(m0 - ms0) * i0, a1 = l1 * expf(m1 - ms1) * i1;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            oacc[nt][0] *= a0;
            oacc[nt][1] *= a0;
            oacc[nt][2] *= a1;
            oacc[nt][3] *= a1;
        }
        m0 = mn0, m1 = mn1, l0 = ln0, l1 = ln1;

        // O += P V. P's A fragment for keys 16kk..16kk+15 is made of S tiles 2kk and 2kk+1.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            u32 pa[4];
            pa[0] = Ty::pack(s[2 * kk][0] * i0, s[2 * kk][1] * i0);
            pa[1] = Ty::pack(s[2 * kk][2] * i1, s[2 * kk][3] * i1);
            pa[2] = Ty::pack(s[2 * kk + 1][0] * i0, s[2 * kk + 1][1] * i0);
            pa[3] = Ty::pack(s[2 * kk + 1][2] * i1, s[2 * kk + 1][3] * i1);
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                // B element (k = key, n = d) is V[key][d]: the two keys of a register are in different rows.
                const u16* vr = vs + (kk * 16 + tg * 2) * D + nt * 8 + g;
                const u32 b0 = (u32)vr[0] | ((u32)vr[D] << 16);
                const u32 b1 = (u32)vr[8 * D] | ((u32)vr[9 * D] << 16);
                Ty::mma(oacc[nt], pa, b0, b1);
            }
        }
    }

    // Write O (already normalised) and the logsumexp; a row that saw no key has l = 0 and O = 0.
    u16* ob = o + ((size_t)b * H + h) * n * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int c = nt * 8 + tg * 2;
        if (row0 < n) *(u32*)(ob + (size_t)row0 * D + c) = Ty::pack(oacc[nt][0], oacc[nt][1]);
        if (row1 < n) *(u32*)(ob + (size_t)row1 * D + c) = Ty::pack(oacc[nt][2], oacc[nt][3]);
    }
    if (tg == 0) {
        float* lb = lse + ((size_t)b * H + h) * n;
        if (row0 < n) lb[row0] = l0 > 0.f ? m0 + logf(l0) : NEG_INF;
        if (row1 < n) lb[row1] = l1 > 0.f ? m1 + logf(l1) : NEG_INF;
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
