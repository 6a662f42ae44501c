// Turing -- rung 4's tensor-core forward on what sm_75 has (Colab's T4): mma.sync m16n8k8, ldmatrix, no cp.async.
//
// A side step of the ladder, not a rung above rung 9: what changes on an older GPU. sm_75's tensor cores take
// fp16 only (no bf16) in m16n8k8 shapes (m16n8k16 needs sm_80), and sm_75 has ldmatrix but no cp.async; a block
// may use 64 KB of shared memory, and a T4 SM has 64 KB in all.
//
// Change from rung 4 (r4_ldmatrix.cu):
// * Each k16 step of a product is two mma.sync.m16n8k8: the m16n8k16 A fragment {a0, a1, a2, a3} is the k8 A
//   fragment {a0, a1} of columns 0-7 followed by {a2, a3} of columns 8-15, and its B fragment {b0, b1} is b0 for
//   k 0-7 and b1 for k 8-15; the accumulators are the same four floats. So the ldmatrix loads of rung 4 stay, and
//   S's accumulators still become P's A fragments in registers (packed two halves at a time).
// * K/V prefetch through registers instead of cp.async: the next tile's 16-byte global loads are issued before
//   this tile's math and stored to shared memory after it, so one tile buffer suffices (16 KB at both d; Q passes
//   through the same buffer once, into registers, before the first tile).
// * Rung 6's softmax: exp2 with log2(e) folded into the scale, O kept unnormalised with a per-thread partial l
//   (one quad sum and one division at the end), and a causal block stops at its last visible key.
// * The f16x2 pack is two cvt.rn.f16.f32 and a mov (cvt.rn.f16x2.f32 needs sm_80).
//
// Inputs fp16. Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q, lse (B, H, n) fp32. Grid:
// (ceil(n / 64), H, B); block: 128 threads (4 warps x 16 rows); keys per tile BC = 64 at D = 64, 32 at D = 128;
// dynamic shared memory 2 * BC * D * 2 bytes = 16 KB. Needs sm_75.

#define NEG_INF (-__int_as_float(0x7f800000))
#define BR 64
#define NTHREADS 128
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef unsigned short u16;
typedef unsigned int u32;

// Two floats -> f16x2 (lo in the low half), round to nearest even, with sm_75's one-at-a-time conversion.
__device__ __forceinline__ u32 pack_f16x2_sm75(float lo, float hi) {
    u32 r;
    asm("{ .reg .f16 l, h; cvt.rn.f16.f32 l, %1; cvt.rn.f16.f32 h, %2; mov.b32 %0, {l, h}; }"
        : "=r"(r)
        : "f"(lo), "f"(hi));
    return r;
}
// One k16 step as two m16n8k8: a[0..3] is the m16n8k16 A fragment, b0 / b1 its B registers for k 0-7 / 8-15.
__device__ __forceinline__ void mma_k16_as_two_k8(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[2]), "r"(a[3]), "r"(b1));
}

// Max / sum over the 4 threads of a quad (lanes 4g .. 4g+3 hold the same two rows).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
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

template <int D>
__device__ void attn_turing(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                            u16* __restrict__ o, float* __restrict__ lse, int n, int m, int H, int Hk, float scale,
                            int causal) {
    constexpr int BC = D == 64 ? 64 : 32;            // keys per tile: 16 KB of K and V at either D
    constexpr int CHUNKS = BC * D / 8 / NTHREADS;    // 16-byte chunks of K (and of V) per thread per tile
    extern __shared__ __align__(16) u16 smem[];
    u16* ks = smem;            // [BC][D], swizzled
    u16* vs = ks + BC * D;     // [BC][D], swizzled
    u16* qs = smem;            // [BR][D], swizzled: Q passes through the K/V buffer before the first tile

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int q0 = blockIdx.x * BR;
    const u16* qb = q + ((size_t)b * H + h) * n * D;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;

    for (int e = threadIdx.x; e < BR * D / 8; e += NTHREADS) {
        const int r = e / (D / 8), c = e % (D / 8);
        uint4 x = make_uint4(0, 0, 0, 0);
        if (q0 + r < n) x = *(const uint4*)(qb + (size_t)(q0 + r) * D + c * 8);
        *(uint4*)(qs + swz<D>(r, c)) = x;
    }
    __syncthreads();
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldsm_x4(qf[kk], smem_addr(qs + swz<D>(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4))));

    float oacc[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) oacc[nt][0] = oacc[nt][1] = oacc[nt][2] = oacc[nt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // row max (log2 units) and this thread's part of l
    const float sl2 = scale * LOG2E;
    const int kend0 = causal ? min(m, row0 + (m - n) + 1) : m;  // keys row0 may see
    const int kend1 = causal ? min(m, row1 + (m - n) + 1) : m;
    const int kend = causal ? min(m, q0 + BR + (m - n)) : m;   // keys any row of the block may see

    // The next tile in registers: thread t holds chunks t, t + NTHREADS, ... of K and of V (zeros past key m).
    uint4 kr[CHUNKS], vr[CHUNKS];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const int e = threadIdx.x + i * NTHREADS, r = e / (D / 8), c = e % (D / 8);
            kr[i] = vr[i] = make_uint4(0, 0, 0, 0);
            if (k0 + r < m) {
                kr[i] = *(const uint4*)(kb + (size_t)(k0 + r) * D + c * 8);
                vr[i] = *(const uint4*)(vb + (size_t)(k0 + r) * D + c * 8);
            }
        }
    };
    if (kend > 0) fetch(0);

    for (int k0 = 0; k0 < kend; k0 += BC) {
        __syncthreads();  // every warp is done with the buffer (the last tile, or Q)
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const int e = threadIdx.x + i * NTHREADS, r = e / (D / 8), c = e % (D / 8);
            *(uint4*)(ks + swz<D>(r, c)) = kr[i];
            *(uint4*)(vs + swz<D>(r, c)) = vr[i];
        }
        __syncthreads();
        if (k0 + BC < kend) fetch(k0 + BC);  // in flight while this tile is computed

        // S = Q K^T. One ldmatrix.x4 gives the B fragments of 8 keys for two 16-wide steps along d.
        float s[BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                u32 bf[4];
                ldsm_x4(bf, smem_addr(ks + swz<D>(nt * 8 + (lane & 7), kk * 2 + (lane >> 3))));
                mma_k16_as_two_k8(s[nt], qf[kk], bf[0], bf[1]);
                mma_k16_as_two_k8(s[nt], qf[kk + 1], bf[2], bf[3]);
            }
        }

        // Scale into log2 units, mask (causal and past m), online-softmax update of the two rows.
        float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = k0 + nt * 8 + tg * 2 + (e & 1);
                s[nt][e] = col < (e < 2 ? kend0 : kend1) ? s[nt][e] * sl2 : NEG_INF;
            }
            t0 = fmaxf(t0, fmaxf(s[nt][0], s[nt][1]));
            t1 = fmaxf(t1, fmaxf(s[nt][2], s[nt][3]));
        }
        const float mn0 = fmaxf(m0, quad_max(t0)), mn1 = fmaxf(m1, quad_max(t1));
        const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;  // no (-inf) - (-inf)
        const float a0 = exp2f(m0 - ms0), a1 = exp2f(m1 - ms1);
        float r0 = 0.f, r1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - ms0);
            s[nt][1] = exp2f(s[nt][1] - ms0);
            s[nt][2] = exp2f(s[nt][2] - ms1);
            s[nt][3] = exp2f(s[nt][3] - ms1);
            r0 += s[nt][0] + s[nt][1];
            r1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * a0 + r0, l1 = l1 * a1 + r1;
        m0 = mn0, m1 = mn1;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            oacc[nt][0] *= a0;
            oacc[nt][1] *= a0;
            oacc[nt][2] *= a1;
            oacc[nt][3] *= a1;
        }

        // O += P V. P's A fragment for keys 16kk..16kk+15 is made of S tiles 2kk and 2kk+1.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            u32 pa[4];
            pa[0] = pack_f16x2_sm75(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack_f16x2_sm75(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack_f16x2_sm75(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack_f16x2_sm75(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            // V's B fragments for 16 keys and two 8-wide column tiles: one transposing ldmatrix.x4.
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                u32 bf[4];
                ldsm_x4_t(bf, smem_addr(vs + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, nt + (lane >> 4))));
                mma_k16_as_two_k8(oacc[nt], pa, bf[0], bf[1]);
                mma_k16_as_two_k8(oacc[nt + 1], pa, bf[2], bf[3]);
            }
        }
    }

    // Normalise once, write O and the logsumexp (natural log); a row that saw no key has l = 0 and O = 0.
    l0 = quad_sum(l0), l1 = quad_sum(l1);
    const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
    u16* ob = o + ((size_t)b * H + h) * n * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int c = nt * 8 + tg * 2;
        if (row0 < n) *(u32*)(ob + (size_t)row0 * D + c) = pack_f16x2_sm75(oacc[nt][0] * i0, oacc[nt][1] * i0);
        if (row1 < n) *(u32*)(ob + (size_t)row1 * D + c) = pack_f16x2_sm75(oacc[nt][2] * i1, oacc[nt][3] * i1);
    }
    if (tg == 0) {
        float* lb = lse + ((size_t)b * H + h) * n;
        if (row0 < n) lb[row0] = l0 > 0.f ? (m0 + log2f(l0)) * LN2 : NEG_INF;
        if (row1 < n) lb[row1] = l1 > 0.f ? (m1 + log2f(l1)) * LN2 : NEG_INF;
    }
}

#define DEFINE_KERNEL(NAME, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(NTHREADS) NAME(const u16* q, const u16* k, const u16* v, \
                                                                u16* o, float* lse, int n, int m, int H,  \
                                                                int Hk, float scale, int causal) {        \
        attn_turing<D>(q, k, v, o, lse, n, m, H, Hk, scale, causal);                                      \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, 128)
