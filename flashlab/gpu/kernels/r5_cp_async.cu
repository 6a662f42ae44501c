// Rung 5 -- cp.async double buffering. Needs sm_80 or newer.
//
// Change from rung 4: tiles travel from global to shared memory with cp.async, which copies 16 bytes without
// passing through registers and without making the thread wait. There are two K/V buffers: while the warps
// compute on tile t in one, the copy engine fills the other with tile t+1 (cp.async.commit_group /
// wait_group 1), so the latency of global memory hides behind the tensor-core work instead of stalling every
// warp at the start of each tile. Rows past key m are zero-filled by the copy itself (source size 0).
//
// Unchanged, for rung 6: expf and the per-tile normalisation of O, every key tile visited under a causal mask.
//
// Inputs fp16 or bf16 (raw 16-bit patterns). Layout: q (B, H, n, D), k and v (B, Hk, m, D), o like q,
// lse (B, H, n) fp32. Grid: (ceil(n / 64), H, B); block: 128 threads (4 warps x 16 rows);
// dynamic shared memory: (64 + 2 * 2 * 64) * D * 2 bytes (80 KB at D = 128).

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
    const int q0 = blockIdx.x * BR;
    const u16* qb = q + ((size_t)b * H + h) * n * D;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    const int ntiles = (m + BC - 1) / BC;

    // Prologue: Q and the first K/V tile in flight together; Q must land before it goes to registers.
    for (int e = threadIdx.x; e < BR * D / 8; e += NTHREADS) {
        const int r = e / (D / 8), c = e % (D / 8);
        const bool valid = q0 + r < n;
        cp_async16(smem_addr(qs + swz<D>(r, c)), qb + (size_t)(valid ? q0 + r : 0) * D + c * 8, valid);
    }
    load_tile<D>(kbuf, kb, 0, m);
    load_tile<D>(vbuf, vb, 0, m);
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
    extern "C" __global__ void __launch_bounds__(NTHREADS, 2) NAME(const u16* q, const u16* k, const u16* v, \
                                                                u16* o, float* lse, int n, int m, int H,  \
                                                                int Hk, float scale, int causal) {        \
        attn_mma<TY, D>(q, k, v, o, lse, n, m, H, Hk, scale, causal);                                     \
    }

DEFINE_KERNEL(attn_fwd_f16_d64, F16, 64)
DEFINE_KERNEL(attn_fwd_f16_d128, F16, 128)
DEFINE_KERNEL(attn_fwd_bf16_d64, BF16, 64)
DEFINE_KERNEL(attn_fwd_bf16_d128, BF16, 128)
