// Backward pass on Hopper's warpgroup MMAs (wgmma). Needs sm_90a (H100, H200).
//
// The schedule is bwd_r3_pipelined.cu's (FlashAttention-2's): a block owns BC = 128 keys, keeps their dK and dV
// in registers while the query tiles of every query head of its group stream past, and adds its share of dQ into
// an fp32 buffer. That kernel runs at 0.57x PyTorch's FlashAttention-2 backward on an H200, and its profile
// (ncu: data/raw/ncu/ncu_bwd_pipe.csv) shows it issuing about three times the warp instructions of FlashAttention-2's
// kernel for the same work at d = 128, and at d = 64 waiting on shared memory (short scoreboard) more than on
// anything but fixed latencies. Much of both is feeding mma.sync: each warp owned 16 keys and read the whole query
// tile through ldmatrix for them, 104 ldmatrix.x4 per 160 mma (d = 128, a warp's 32-row tile). wgmma reads both operands of a product from shared memory itself, for 64 rows
// of a warpgroup at once, so none of that passes through the registers. Per query tile of BR = 64 rows, each of
// the two warpgroups (64 keys each):
//   S^T  = K_w Q^T      and dP^T = V_w dO^T   wgmma m64n64k16, A and B K-major in shared memory;
//   P^T  = exp2(S^T scale log2 e - L)         dS^T = P^T (dP^T - D)   (fp32, in the accumulators);
//   dV_w += P^T dO      and dK_w += dS^T Q    wgmma m64nDk16, A from registers: the accumulator layout of S^T is
//                                             the A fragment layout (as P in the forward), B = dO / Q read
//                                             transposed from the same tiles;
//   dQ   += dS K        every key of the block: dS^T goes to shared memory (the other warpgroup's keys are needed
//                                             too), A = dS^T read transposed, B = K read transposed; warpgroup w
//                                             takes dQ's columns w D / 2 .. (w + 1) D / 2 and adds them into the
//                                             fp32 buffer with red.global.add.v2.f32 (two columns an instruction).
// Q, dO, L and D are double-buffered and copied with cp.async while the tile before is used, as in
// bwd_r3_pipelined.cu; every tile is in wgmma's 128-byte swizzled layout (wgmma.cuh).
//
// Layout and arguments as bwd_main in bwd_r1_smem.cu (kernels 1 and 3, bwd_dot and bwd_dq, are that file's).
// Grid: (ceil(m / 128), Hk, B); block: 256 threads (two warpgroups); dynamic shared memory:
// (2 BC + 4 BR) D 2 + BC BR 2 + 4 BR 4 + 1024 bytes (149,504 B at D = 128, 83,968 B at D = 64).
#include "wgmma.cuh"
#include "backward.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define POS_INF (__int_as_float(0x7f800000))
#define NT 256  // two warpgroups
#define BC 128  // keys per block: 64 per warpgroup
#define BR 64   // query rows per tile
#define LOG2E 1.4426950408889634f

// Issue the copies of rows r0 .. r0 + ROWS - 1 of a [*][D] matrix (zeros past row `rows`) into a swizzled tile.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const u16* src, int r0, int rows) {
#pragma unroll
    for (int e = threadIdx.x; e < ROWS * D / 8; e += NT) {
        const int r = e / (D / 8), c = e % (D / 8);
        const bool valid = r0 + r < rows;
        cp_async16(dst + tile_offset<ROWS>(r, c), src + (size_t)(valid ? r0 + r : 0) * D + c * 8, valid);
    }
}

template <class Ty, int D>
__device__ void bwd_wgmma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                          const u16* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ dvec, float* __restrict__ dq_acc, u16* __restrict__ dk,
                          u16* __restrict__ dv, int n, int m, int H, int Hk, float scale, int causal) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 ks = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms start on 1024-byte boundaries
    const u32 vs = ks + BC * D * 2;                       // [BC][D]
    const u32 qbuf = vs + BC * D * 2;                     // two stages of [BR][D]
    const u32 dobuf = qbuf + 2 * BR * D * 2;              // two stages of [BR][D]
    const u32 dss = dobuf + 2 * BR * D * 2;               // dS^T: [BC][BR], one panel
    unsigned char* dss_ptr = smem_raw + (dss - smem_u32(smem_raw));
    float* lbuf = (float*)(dss_ptr + BC * BR * 2);  // [2][BR] L in log2 units (+inf: the row sees nothing)
    float* dbuf = lbuf + 2 * BR;                    // [2][BR] D

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;
    const int k0 = blockIdx.x * BC, hk = blockIdx.y, b = blockIdx.z, G = H / Hk;
    const int off = m - n;
    const float scale2 = scale * LOG2E;
    const size_t kvbase = ((size_t)b * Hk + hk) * m;
    const int kw = k0 + 64 * wg;  // this warpgroup's first key

    // The (query head, query tile) pairs this block visits, in order: heads gi of the group outer, tiles inner.
    const int qstart = causal ? (max(0, k0 - off) / BR) * BR : 0;
    const int tiles = qstart < n ? (n - qstart + BR - 1) / BR : 0;
    const int steps = G * tiles;
    float next_x = 0.f;  // L (threads 0 .. BR - 1) or D (threads BR .. 2 BR - 1) of the next step's rows
    auto prefetch = [&](int i) {
        const int gi = i / tiles, q0 = qstart + (i % tiles) * BR, buf = i & 1;
        const size_t hrow = ((size_t)b * H + (size_t)hk * G + gi) * n;
        load_tile<D, BR>(qbuf + buf * BR * D * 2, q + hrow * D, q0, n);
        load_tile<D, BR>(dobuf + buf * BR * D * 2, dout + hrow * D, q0, n);
        cp_async_commit();
        if (threadIdx.x < 2 * BR) {
            const int row = q0 + threadIdx.x % BR;
            next_x = threadIdx.x < BR ? (row < n ? lse[hrow + row] : NEG_INF) : (row < n ? dvec[hrow + row] : 0.f);
        }
    };
    auto store_vec = [&](int buf) {
        if (threadIdx.x < BR) lbuf[buf * BR + threadIdx.x] = next_x == NEG_INF ? POS_INF : next_x * LOG2E;
        else if (threadIdx.x < 2 * BR) dbuf[buf * BR + threadIdx.x - BR] = next_x;
    };
    load_tile<D, BC>(ks, k + kvbase * D, k0, m);
    load_tile<D, BC>(vs, v + kvbase * D, k0, m);
    if (steps > 0) prefetch(0), store_vec(0);
    else cp_async_commit();

    float dka[D / 2], dva[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dka[i] = dva[i] = 0.f;

    for (int i = 0; i < steps; ++i) {
        const int gi = i / tiles, q0 = qstart + (i % tiles) * BR, buf = i & 1;
        const size_t hrow = ((size_t)b * H + (size_t)hk * G + gi) * n;
        const u32 qs = qbuf + buf * BR * D * 2, dos = dobuf + buf * BR * D * 2;
        const float* lsm = lbuf + buf * BR;
        const float* dsm = dbuf + buf * BR;
        cp_async_wait<0>();      // this thread's copies of step i (and of K, V) have landed
        fence_to_tensor_cores();  // ... and are visible to wgmma
        __syncthreads();         // everyone's are; step i - 1 is done with buffer (i + 1) % 2 and with dS^T
        if (i + 1 < steps) prefetch(i + 1);

        // S^T and dP^T of this warpgroup's 64 keys and the tile's 64 rows: one wgmma per 16 columns of d.
        float st[BR / 2], dpt[BR / 2];
#pragma unroll
        for (int e = 0; e < BR / 2; ++e) st[e] = dpt[e] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 koff = (kk / 4) * BC * 128 + 64 * wg * 128 + (kk % 4) * 32, qoff = (kk / 4) * BR * 128 + (kk % 4) * 32;
            Wgmma<BR>::template ss<Ty::bf16>(st, descriptor(ks + koff, 16, 1024), descriptor(qs + qoff, 16, 1024), kk > 0);
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 koff = (kk / 4) * BC * 128 + 64 * wg * 128 + (kk % 4) * 32, qoff = (kk / 4) * BR * 128 + (kk % 4) * 32;
            Wgmma<BR>::template ss<Ty::bf16>(dpt, descriptor(vs + koff, 16, 1024), descriptor(dos + qoff, 16, 1024), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin<BR / 2>(st);
        pin<BR / 2>(dpt);

        // P^T and dS^T, packed at once into A fragments (k16 step kk: query columns 16 kk .. 16 kk + 15). Element
        // e of 8-column block j: key kw + 16 warp + g + 8 (e / 2), query row q0 + 8 j + 2 t + e % 2. The mask is
        // applied only where this warpgroup's keys reach past the cache's end or (causal) past the tile's first
        // row. A key past m must be masked although its K and V rows are zeros: its P = 2^-L can be huge for a row
        // whose every score is very negative, and dS = -P D rounded to 16 bits would then be inf, and inf times
        // K's zero row a NaN in dQ.
        const int key0 = kw + 16 * warp + g;
        const bool need_mask = kw + 64 > m || (causal && kw + 63 > q0 + off);
        u32 pa[BR / 16][4], sa[BR / 16][4];
#pragma unroll
        for (int j = 0; j < BR / 8; ++j) {
            const int c = 8 * j + 2 * t;
            const float2 L = *(const float2*)(lsm + c), Dv = *(const float2*)(dsm + c);
            float p[4], s[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float l = e & 1 ? L.y : L.x, dd = e & 1 ? Dv.y : Dv.x;
                float x = fmaf(st[4 * j + e], scale2, -l);
                if (need_mask) {
                    const int key = key0 + 8 * (e >> 1);
                    if (key >= m || (causal && key > q0 + c + (e & 1) + off)) x = NEG_INF;
                }
                p[e] = ex2(x);
                s[e] = p[e] * (dpt[4 * j + e] - dd);
            }
            pa[j / 2][(j & 1) * 2] = Ty::pack(p[0], p[1]);
            pa[j / 2][(j & 1) * 2 + 1] = Ty::pack(p[2], p[3]);
            sa[j / 2][(j & 1) * 2] = Ty::pack(s[0], s[1]);
            sa[j / 2][(j & 1) * 2 + 1] = Ty::pack(s[2], s[3]);
        }

        // dS^T to shared memory for dQ, row = key (0 .. 127 in the block), column = query row of the tile; two
        // columns a 4-byte store, in the swizzle (the 32 lanes of a store hit 32 different banks). Stored before
        // dK's wgmma is issued: a register a running wgmma reads is not to be touched until it is waited for.
#pragma unroll
        for (int j = 0; j < BR / 8; ++j) {
            const int r = 64 * wg + 16 * warp + g;
            *(u32*)(dss_ptr + tile_offset<BC>(r, j) + 4 * t) = sa[j / 2][(j & 1) * 2];
            *(u32*)(dss_ptr + tile_offset<BC>(r + 8, j) + 4 * t) = sa[j / 2][(j & 1) * 2 + 1];
        }
        // dV_w += P^T dO and dK_w += dS^T Q: one wgmma each per 16 query rows; the k16 step kk is 16 rows (2048
        // bytes) down the dO / Q tile, whose 64-column panels are BR * 128 bytes apart.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk) {
            Wgmma<D>::template rs<Ty::bf16>(dva, pa[kk], descriptor(dos + kk * 2048, BR * 128, 1024), 1);
            Wgmma<D>::template rs<Ty::bf16>(dka, sa[kk], descriptor(qs + kk * 2048, BR * 128, 1024), 1);
        }
        wgmma_commit();
        fence_to_tensor_cores();
        __syncthreads();  // dS^T is complete

        // dQ (64 rows x this warpgroup's D / 2 columns) = dS K over the block's 128 keys: the k16 step kk is 16
        // keys, 16 rows (2048 bytes) down dS^T and down K.
        constexpr int NQ = D / 2;
        float dqa[NQ / 2];
#pragma unroll
        for (int e = 0; e < NQ / 2; ++e) dqa[e] = 0.f;
        const u32 kcol = ks + (wg * NQ / 64) * BC * 128 + (wg * NQ % 64) * 2;
        wgmma_fence();  // dqa was just written by this thread
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            WgmmaT<NQ>::template ss<Ty::bf16>(dqa, descriptor(dss + kk * 2048, BC * 128, 1024),
                                              descriptor(kcol + kk * 2048, BC * 128, 1024), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        pin<NQ / 2>(dqa);
        pin<D / 2>(dva);
        pin<D / 2>(dka);

        // Element e of block j: query row q0 + 16 warp + g + 8 (e / 2), column wg NQ + 8 j + 2 t + e % 2.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = q0 + 16 * warp + g + 8 * h;
            if (row < n) {
                float* dst = dq_acc + (hrow + row) * D + wg * NQ + 2 * t;
#pragma unroll
                for (int j = 0; j < NQ / 8; ++j) red_add_v2(dst + 8 * j, dqa[4 * j + 2 * h], dqa[4 * j + 2 * h + 1]);
            }
        }
        if (i + 1 < steps) store_vec((i + 1) & 1);  // buffer (i + 1) % 2 has been free since this step's first barrier
    }
    cp_async_wait<0>();  // (steps = 0: the K and V copies are still owed)

    // dK (scaled here) and dV of this warpgroup's keys: element e of block j is key kw + 16 warp + g + 8 (e / 2),
    // column 8 j + 2 t + e % 2; two neighbouring columns are written as one 32-bit word.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = kw + 16 * warp + g + 8 * h;
        if (key < m) {
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                const int c = 8 * j + 2 * t;
                *(u32*)(dk + (kvbase + key) * D + c) = Ty::pack(scale * dka[4 * j + 2 * h], scale * dka[4 * j + 2 * h + 1]);
                *(u32*)(dv + (kvbase + key) * D + c) = Ty::pack(dva[4 * j + 2 * h], dva[4 * j + 2 * h + 1]);
            }
        }
    }
}

#define DEFINE_KERNELS(DT, TY, D)                                                                                 \
    extern "C" __global__ void __launch_bounds__(NT, 1)                                                           \
        bwd_wgmma_##DT##_d##D(const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,          \
                              const float* dvec, float* dq_acc, u16* dk, u16* dv, int n, int m, int H, int Hk,    \
                              float scale, int causal) {                                                          \
        bwd_wgmma<TY, D>(q, k, v, dout, lse, dvec, dq_acc, dk, dv, n, m, H, Hk, scale, causal);                    \
    }

DEFINE_KERNELS(f16, F16, 64)
DEFINE_KERNELS(f16, F16, 128)
DEFINE_KERNELS(bf16, BF16, 64)
DEFINE_KERNELS(bf16, BF16, 128)
