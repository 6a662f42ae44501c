// Backward pass, third version: bwd_r2_mma.cu with twice the keys per block and the next query tile loaded while
// the current one is used. Needs sm_80.
//
// What limited bwd_r2_mma.cu (0.42x PyTorch's FlashAttention-2 backward on an H200 at d = 128, n = 4096,
// data/ch8/bwd.json): per 64 keys, every query tile (Q, dO: 16 KB at d = 128) was loaded with plain loads while
// the block waited at a barrier, and every tile added a 32 x D block of dQ into memory with fp32 atomics -- one
// atomic per dQ element per 64 keys. Two changes, nothing else:
//   * BC = 128 keys per block, eight warps of 16 keys (the same per-warp work): each Q/dO tile and each dQ atomic
//     now serves twice the keys, so the block loads half the query bytes per key and issues half the atomics.
//   * Q, dO, L and D are double-buffered in shared memory and copied with cp.async (zero-filled past row n): tile
//     i + 1 is on its way while the block computes tile i, and a wait_group + barrier replaces the blocking loads.
// The dQ step is shared by the eight warps: warp w takes query rows 16 (w % 2) .. + 15 and the D / 4 columns
// starting at (w / 2) D / 4.
// Dynamic shared memory: (2 BC + 4 BR) (D + 8) 2 + BC (BR + 8) 2 + 4 BR 4 bytes (114 KB at D = 128).
// Layout and arguments as bwd_main in bwd_r1_smem.cu; kernels 1 and 3 (bwd_dot, bwd_dq) are bwd_r1_smem.cu's.

#define NEG_INF (-__int_as_float(0x7f800000))
#define POS_INF (__int_as_float(0x7f800000))
#define NWARPS 8
#define NT (32 * NWARPS)
#define BC 128  // keys per block: 16 per warp
#define BR 32  // query rows per tile
#define LOG2E 1.4426950408889634f

typedef unsigned short u16;
typedef unsigned int u32;

struct F16 {
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ u16 store(float f) {
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
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
    static __device__ __forceinline__ u16 store(float f) {
        u16 h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void ldsm_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
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

// Copy ROWS rows of D halves (rows row0.. of src, zeros from row `limit` on) to a padded shared tile, blocking.
template <int D, int ROWS>
__device__ __forceinline__ void stage(u16* dst, const u16* src, int row0, int limit) {
    constexpr int CH = D / 8;
    for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
        const int r = i / CH, c = (i % CH) * 8;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (row0 + r < limit) x = *(const uint4*)(src + (size_t)(row0 + r) * D + c);
        *(uint4*)(dst + r * (D + 8) + c) = x;
    }
}

// The same with cp.async (not waited for here); a row past `limit` reads nothing and is zero-filled. The source
// address of such a row is clamped to row 0, which exists, so no out-of-range address is even formed.
template <int D, int ROWS>
__device__ __forceinline__ void stage_async(u16* dst, const u16* src, int row0, int limit) {
    constexpr int CH = D / 8;
    for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
        const int r = i / CH, c = (i % CH) * 8;
        const bool ok = row0 + r < limit;
        cp_async16(smem_addr(dst + r * (D + 8) + c), src + (size_t)(ok ? row0 + r : 0) * D + c, ok);
    }
}

template <class Ty, int D>
__device__ void bwd_pipe(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                         const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dvec,
                         float* __restrict__ dq_acc, u16* __restrict__ dk, u16* __restrict__ dv, int n, int m, int H,
                         int Hk, float scale, int causal) {
    constexpr int S = D + 8;    // padded row (halves) of Q, dO, K, V
    constexpr int SD = BR + 8;  // padded row (halves) of dS^T
    extern __shared__ __align__(16) u16 smem[];
    u16* ks = smem;                  // [BC][S]
    u16* vs = ks + BC * S;           // [BC][S]
    u16* qbuf = vs + BC * S;         // [2][BR][S]: Q of the tile in use and of the next one
    u16* dobuf = qbuf + 2 * BR * S;  // [2][BR][S]: dO likewise
    u16* dss = dobuf + 2 * BR * S;   // [BC][SD]: dS^T of the tile
    float* lbuf = (float*)(dss + BC * SD);  // [2][BR] L in log2 units (+inf: the row sees nothing)
    float* dbuf = lbuf + 2 * BR;            // [2][BR] D

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int k0 = blockIdx.x * BC, hk = blockIdx.y, b = blockIdx.z, G = H / Hk;
    const int off = m - n;
    const float scale2 = scale * LOG2E;
    const size_t kvbase = ((size_t)b * Hk + hk) * m;
    const int kw = 16 * warp;  // this warp's first key inside the block
    // ldmatrix lane pattern: row lane % 8 + 8 * (lane / 8 % 2) of a 16-row block, 8-column chunk + lane / 16
    const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lchunk = lane >> 4;

    // The (query head, query tile) pairs this block visits, in order: heads gi of the group outer, tiles inner.
    const int qstart = causal ? (max(0, k0 - off) / BR) * BR : 0;
    const int tiles = qstart < n ? (n - qstart + BR - 1) / BR : 0;
    const int steps = G * tiles;
    // Issue the copies of step i into buffer i % 2: Q and dO by cp.async; L and D (one float per row) with plain
    // loads into registers, stored to shared memory by store_vec() at the end of the step before, so that no warp
    // waits for them while it computes.
    float next_l = 0.f, next_d = 0.f;
    int next_buf = 0;
    auto prefetch = [&](int i) {
        const int gi = i / tiles, q0 = qstart + (i % tiles) * BR;
        const size_t hrow = ((size_t)b * H + (size_t)hk * G + gi) * n;
        next_buf = i & 1;
        stage_async<D, BR>(qbuf + next_buf * BR * S, q + hrow * D, q0, n);
        stage_async<D, BR>(dobuf + next_buf * BR * S, dout + hrow * D, q0, n);
        cp_async_commit();
        if (threadIdx.x < BR) {
            const int row = q0 + threadIdx.x;
            next_l = row < n ? lse[hrow + row] : NEG_INF;
            next_d = row < n ? dvec[hrow + row] : 0.f;
        }
    };
    auto store_vec = [&]() {
        if (threadIdx.x < BR) {
            lbuf[next_buf * BR + threadIdx.x] = next_l == NEG_INF ? POS_INF : next_l * LOG2E;
            dbuf[next_buf * BR + threadIdx.x] = next_d;
        }
    };
    if (steps > 0) prefetch(0), store_vec();
    stage<D, BC>(ks, k + kvbase * D, k0, m);
    stage<D, BC>(vs, v + kvbase * D, k0, m);

    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[nt][e] = dva[nt][e] = 0.f;

    for (int i = 0; i < steps; ++i) {
        const int gi = i / tiles, q0 = qstart + (i % tiles) * BR, buf = i & 1;
        const size_t hrow = ((size_t)b * H + (size_t)hk * G + gi) * n;
        const u16* qs = qbuf + buf * BR * S;
        const u16* dos = dobuf + buf * BR * S;
        const float* lsm = lbuf + buf * BR;
        const float* dsm = dbuf + buf * BR;
        cp_async_wait<0>();  // this thread's copies of step i have landed
        __syncthreads();     // everyone's have; and step i - 1 is done with buffer (i + 1) % 2 and with dS^T
        if (i + 1 < steps) prefetch(i + 1);

        // S^T and dP^T for keys kw.. kw+15 (mma rows) and the BR query rows (mma columns, BR / 8 tiles).
        float st[BR / 8][4], dpt[BR / 8][4];
#pragma unroll
        for (int nt = 0; nt < BR / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 ka[4], va[4];
            ldsm_x4(ka, smem_addr(ks + (kw + lrow) * S + (2 * kk + lchunk) * 8));
            ldsm_x4(va, smem_addr(vs + (kw + lrow) * S + (2 * kk + lchunk) * 8));
#pragma unroll
            for (int nt = 0; nt < BR / 8; nt += 2) {
                u32 qb[4], db[4];  // blocks: (rows nt, d lo), (rows nt+1, d lo), (rows nt, d hi), (rows nt+1, d hi)
                ldsm_x4(qb, smem_addr(qs + (nt * 8 + lrow) * S + (2 * kk + lchunk) * 8));
                ldsm_x4(db, smem_addr(dos + (nt * 8 + lrow) * S + (2 * kk + lchunk) * 8));
                Ty::mma(st[nt], ka, qb[0], qb[2]);
                Ty::mma(st[nt + 1], ka, qb[1], qb[3]);
                Ty::mma(dpt[nt], va, db[0], db[2]);
                Ty::mma(dpt[nt + 1], va, db[1], db[3]);
            }
        }
        // P^T and dS^T in place. Element e of tile nt: key kw + g + 8 (e / 2), query row nt * 8 + 2t + e % 2.
#pragma unroll
        for (int nt = 0; nt < BR / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + kw + g + 8 * (e >> 1), r = nt * 8 + 2 * t + (e & 1), row = q0 + r;
                const bool ok = row < n && key < m && (!causal || key <= row + off);
                const float p = ok ? exp2f(fmaf(st[nt][e], scale2, -lsm[r])) : 0.f;
                st[nt][e] = p;
                dpt[nt][e] = p * (dpt[nt][e] - dsm[r]);
            }
        // dV_w += P^T dO and dK_w += dS^T Q: A from the accumulators (two 8-column tiles = one 16-wide A),
        // B = dO / Q rows (k = query row) by ldmatrix.trans.
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk) {
            u32 pa[4], sa[4];
            pa[0] = Ty::pack(st[2 * kk][0], st[2 * kk][1]);
            pa[1] = Ty::pack(st[2 * kk][2], st[2 * kk][3]);
            pa[2] = Ty::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]);
            pa[3] = Ty::pack(st[2 * kk + 1][2], st[2 * kk + 1][3]);
            sa[0] = Ty::pack(dpt[2 * kk][0], dpt[2 * kk][1]);
            sa[1] = Ty::pack(dpt[2 * kk][2], dpt[2 * kk][3]);
            sa[2] = Ty::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
            sa[3] = Ty::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                u32 ob[4], qb[4];  // blocks: (rows lo, cols nt), (rows hi, cols nt), (lo, nt+1), (hi, nt+1)
                ldsm_x4_t(ob, smem_addr(dos + (kk * 16 + lrow) * S + (nt + lchunk) * 8));
                ldsm_x4_t(qb, smem_addr(qs + (kk * 16 + lrow) * S + (nt + lchunk) * 8));
                Ty::mma(dva[nt], pa, ob[0], ob[1]);
                Ty::mma(dva[nt + 1], pa, ob[2], ob[3]);
                Ty::mma(dka[nt], sa, qb[0], qb[1]);
                Ty::mma(dka[nt + 1], sa, qb[2], qb[3]);
            }
            // dS^T to shared memory for dQ: key row kw + g (+8), query columns 16 kk + 2t (+1), (+8).
            *(u32*)(dss + (kw + g) * SD + kk * 16 + 2 * t) = sa[0];
            *(u32*)(dss + (kw + g + 8) * SD + kk * 16 + 2 * t) = sa[1];
            *(u32*)(dss + (kw + g) * SD + kk * 16 + 8 + 2 * t) = sa[2];
            *(u32*)(dss + (kw + g + 8) * SD + kk * 16 + 8 + 2 * t) = sa[3];
        }
        __syncthreads();  // dS^T is complete

        // dQ tile (BR x D) += dS (BR x BC) K_j (BC x D): warp w takes rows 16 (w % 2) .. + 15 and columns
        // (w / 2) D / 4 .. + D / 4. A = dS by ldmatrix.trans of dS^T: stored row = key 16 kk + lane % 8 +
        // 8 (lane / 16), chunk = query rows m0 / 8 + lane / 8 % 2. B = K rows (k = key) by ldmatrix.trans.
        {
            constexpr int NQ = D / 32;  // 8-column tiles per warp
            const int m0 = 16 * (warp & 1), c0 = (warp >> 1) * (D / 4);
            float qa[NQ][4];
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) qa[nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                u32 a[4];
                ldsm_x4_t(a, smem_addr(dss + (kk * 16 + (lane & 7) + 8 * (lane >> 4)) * SD + m0 +
                                       ((lane >> 3) & 1) * 8));
#pragma unroll
                for (int nt = 0; nt < NQ; nt += 2) {
                    u32 kb[4];
                    ldsm_x4_t(kb, smem_addr(ks + (kk * 16 + lrow) * S + c0 + (nt + lchunk) * 8));
                    Ty::mma(qa[nt], a, kb[0], kb[1]);
                    Ty::mma(qa[nt + 1], a, kb[2], kb[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = q0 + m0 + g + 8 * (e >> 1), c = c0 + nt * 8 + 2 * t + (e & 1);
                    if (row < n) atomicAdd(dq_acc + (hrow + row) * D + c, qa[nt][e]);
                }
        }
        if (i + 1 < steps) store_vec();  // buffer (i + 1) % 2 has been free since this step's first barrier
    }

    // dK (scaled here) and dV of this warp's keys: element e of tile nt is key kw + g + 8 (e / 2), column nt * 8 + 2t
    // + e % 2; two neighbouring columns are written as one 32-bit word.
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = k0 + kw + g + 8 * h, c = nt * 8 + 2 * t;
            if (key < m) {
                *(u32*)(dk + (kvbase + key) * D + c) = Ty::pack(scale * dka[nt][2 * h], scale * dka[nt][2 * h + 1]);
                *(u32*)(dv + (kvbase + key) * D + c) = Ty::pack(dva[nt][2 * h], dva[nt][2 * h + 1]);
            }
        }
}

#define DEFINE_KERNELS(DT, TY, D)                                                                                 \
    extern "C" __global__ void __launch_bounds__(NT, 1)                                                           \
        bwd_pipe_##DT##_d##D(const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,           \
                            const float* dvec, float* dq_acc, u16* dk, u16* dv, int n, int m, int H, int Hk,      \
                            float scale, int causal) {                                                            \
        bwd_pipe<TY, D>(q, k, v, dout, lse, dvec, dq_acc, dk, dv, n, m, H, Hk, scale, causal);                     \
    }

DEFINE_KERNELS(f16, F16, 64)
DEFINE_KERNELS(f16, F16, 128)
DEFINE_KERNELS(bf16, BF16, 64)
DEFINE_KERNELS(bf16, BF16, 128)
