// Backward pass on Hopper, fourth step: bwd_h3_bulk_dq.cu with the causal blocks started longest first. Needs sm_90a.
//
// A block owns 128 keys; with the causal mask it visits only the query tiles that see one of them, so the block of
// the first keys of a head has the most work and that of its last keys the least (64 query tiles against 2 at
// n = 4096). The GPU starts blocks in the order of their index, x fastest: in bwd_h3_bulk_dq.cu that is a head's key
// blocks from the longest to the shortest, then the next head's. The last heads' long blocks then start near the
// end and run on while most SMs have nothing left: greedy list scheduling of those blocks on 132 SMs ends at 1.07x
// the even share at n = 4096 (flashlab.gpu.backward.block_order and makespan). Rung H9 of the forward met the same
// tail and started the longest tiles first; so does this kernel for causal calls. The blocks are numbered in
// groups of `group` heads, and within a group all key blocks 0 come first, then all key blocks 1, and so on; the
// launcher passes every head as one group (greedy list scheduling then ends within 1 % of the even share), and 1
// without the mask, which is bwd_h3_bulk_dq.cu's order. The blocks that run together then belong to many heads
// rather than to a few, so fewer of them share each Q and dO tile in L2. An estimate, to be checked by a profile:
// at n = 4096 (16 heads, batch 4) about half of the 2.2 GB of Q and dO tiles read would come from DRAM, some 1 GB
// in a call of a few ms, a small part of what DRAM delivers in that time.
//
// Block (linear index L = x + X (y + Y z), X = key blocks, heads = Y Z = Hk B): the group of heads g0 .. g0 + gs - 1
// with g0 = L / (X group) group and gs = min(group, heads - g0); within it, L' = L - g0 X is key block L' / gs of
// head g0 + L' % gs, head = hk + Hk b. (CUDA does not promise that blocks start in the order of their index; GPUs
// do so in practice, and rung H9 and FlashAttention's schedulers rely on it as well.) Everything else is bwd_h3_bulk_dq.cu's; the kernels take `group` after
// `causal`.
#include "wgmma.cuh"
#include "tma.cuh"  // named barriers
#include "backward.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))
#define POS_INF (__int_as_float(0x7f800000))
#define NT 256  // two warpgroups
#define BC 128  // keys per block: 64 per warpgroup
#define BR 64   // query rows per tile
#define LOG2E 1.4426950408889634f
#define NL (NT - 64)  // the threads that copy: all but the first warp of each warpgroup
#define ISSUER (threadIdx.x % 128 == 0)  // the thread of each warpgroup that talks to the copy engine
#define COPIER (threadIdx.x % 128 >= 32)  // a thread that issues cp.async (not in an issuer's warp)

// Issue the copies of rows r0 .. r0 + ROWS - 1 of a [*][D] matrix (zeros past row `rows`) into a swizzled tile,
// spread over the NL copying threads.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const u16* src, int r0, int rows) {
    if (!COPIER) return;
    const int first = threadIdx.x % 128 - 32 + 96 * (threadIdx.x / 128);  // 0 .. NL - 1
#pragma unroll
    for (int e = first; e < ROWS * D / 8; e += NL) {
        const int r = e / (D / 8), c = e % (D / 8);
        const bool valid = r0 + r < rows;
        cp_async16(dst + tile_offset<ROWS>(r, c), src + (size_t)(valid ? r0 + r : 0) * D + c * 8, valid);
    }
}

// This block's key block kb and head hb (= hk + Hk b): numbered in groups of `group` heads, key blocks outer within
// a group. The block index is read with asm volatile, so that a second call recomputes rather than reuses the first.
__device__ __forceinline__ void block_of(int group, int& kb, int& hb) {
    u32 x, y, z;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    const int nkb = gridDim.x, heads = gridDim.y * gridDim.z;
    const int linear = x + nkb * (y + gridDim.y * z);
    const int g0 = linear / (nkb * group) * group, gs = min(group, heads - g0), within = linear - g0 * nkb;
    kb = within / gs;
    hb = g0 + within % gs;
}

template <class Ty, int D>
__device__ void bwd_wgmma_balanced(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                          const u16* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ dvec, float* __restrict__ dq_acc, u16* __restrict__ dk,
                          u16* __restrict__ dv, int n, int m, int H, int Hk, float scale, int causal,
                              int group) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 ks = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms start on 1024-byte boundaries
    const u32 vs = ks + BC * D * 2;                       // [BC][D]
    const u32 qbuf = vs + BC * D * 2;                     // two stages of [BR][D]
    const u32 dobuf = qbuf + 2 * BR * D * 2;              // two stages of [BR][D]
    const u32 dss = dobuf + 2 * BR * D * 2;               // dS^T: [BC][BR], one panel
    unsigned char* dss_ptr = smem_raw + (dss - smem_u32(smem_raw));
    float* lbuf = (float*)(dss_ptr + BC * BR * 2);  // [2][BR] L in log2 units (+inf: the row sees nothing)
    float* dbuf = lbuf + 2 * BR;                    // [2][BR] D
    float* dq_stage = dbuf + 2 * BR;                // [2][BR D / 2]: each warpgroup's dQ half, in accumulator order

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;
    int kb, hb;
    block_of(group, kb, hb);
    const int G = H / Hk, k0 = kb * BC;
    const int hq0 = hb / Hk * H + hb % Hk * G;  // the group's first query head, b H + hk G (hb = b Hk + hk)
    const int off = m - n;
    const float scale2 = scale * LOG2E;
    const size_t kvbase = (size_t)hb * m;
    const int kw = k0 + 64 * wg;  // this warpgroup's first key
    const int ntiles = (n + BR - 1) / BR;

    // The (query head, query tile) pairs this block visits, in order: heads gi of the group outer, tiles inner.
    const int qstart = causal ? (max(0, k0 - off) / BR) * BR : 0;
    const int tiles = qstart < n ? (n - qstart + BR - 1) / BR : 0;
    const int steps = G * tiles;
    float next_x = 0.f;  // L (threads 0 .. BR - 1) or D (threads BR .. 2 BR - 1) of the next step's rows
    auto prefetch = [&](int i) {
        const int gi = i / tiles, q0 = qstart + (i % tiles) * BR, buf = i & 1;
        const size_t hrow = ((size_t)hq0 + gi) * n;
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
        const u32 qs = qbuf + buf * BR * D * 2, dos = dobuf + buf * BR * D * 2;
        const float* lsm = lbuf + buf * BR;
        const float* dsm = dbuf + buf * BR;
        if (COPIER) cp_async_wait<0>();  // this thread's copies of step i (and of K, V) have landed
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
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 koff = (kk / 4) * BC * 128 + 64 * wg * 128 + (kk % 4) * 32, qoff = (kk / 4) * BR * 128 + (kk % 4) * 32;
            Wgmma<BR>::template ss<Ty::bf16>(dpt, descriptor(vs + koff, 16, 1024), descriptor(dos + qoff, 16, 1024), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<1>();  // S^T is done; dP^T may still run
        pin<BR / 2>(st);

        // P^T (in place, fp32) and packed into A fragments (k16 step kk: query columns 16 kk .. 16 kk + 15).
        // Element e of 8-column block j: key kw + 16 warp + g + 8 (e / 2), query row q0 + 8 j + 2 t + e % 2. The
        // mask is applied only where this warpgroup's keys reach past the cache's end or (causal) past the tile's
        // first row (why keys past m are masked: bwd_h1_wgmma.cu).
        const int key0 = kw + 16 * warp + g;
        const bool need_mask = kw + 64 > m || (causal && kw + 63 > q0 + off);
        u32 pa[BR / 16][4], sa[BR / 16][4];
#pragma unroll
        for (int j = 0; j < BR / 8; ++j) {
            const float2 L = *(const float2*)(lsm + 8 * j + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = fmaf(st[4 * j + e], scale2, -(e & 1 ? L.y : L.x));
                if (need_mask) {
                    const int key = key0 + 8 * (e >> 1);
                    if (key >= m || (causal && key > q0 + 8 * j + 2 * t + (e & 1) + off)) x = NEG_INF;
                }
                st[4 * j + e] = ex2(x);
            }
            pa[j / 2][(j & 1) * 2] = Ty::pack(st[4 * j], st[4 * j + 1]);
            pa[j / 2][(j & 1) * 2 + 1] = Ty::pack(st[4 * j + 2], st[4 * j + 3]);
        }
        // dV_w += P^T dO: one wgmma per 16 query rows; the k16 step kk is 16 rows (2048 bytes) down the dO tile,
        // whose 64-column panels are BR * 128 bytes apart.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk)
            Wgmma<D>::template rs<Ty::bf16>(dva, pa[kk], descriptor(dos + kk * 2048, BR * 128, 1024), 1);
        wgmma_commit();
        wgmma_wait<1>();  // dP^T is done; dV may still run
        pin<BR / 2>(dpt);

        // dS^T = P^T (dP^T - D), packed likewise; then dK_w += dS^T Q, the same way as dV.
#pragma unroll
        for (int j = 0; j < BR / 8; ++j) {
            const float2 Dv = *(const float2*)(dsm + 8 * j + 2 * t);
            float s[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) s[e] = st[4 * j + e] * (dpt[4 * j + e] - (e & 1 ? Dv.y : Dv.x));
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
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk)
            Wgmma<D>::template rs<Ty::bf16>(dka, sa[kk], descriptor(qs + kk * 2048, BR * 128, 1024), 1);
        wgmma_commit();
        fence_to_tensor_cores();
        if (ISSUER) bulk_wait_read<0>();  // the engine has read the last step's staging tile
        __syncthreads();  // dS^T is complete; the staging tiles may be written

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
        hold<BR / 4>(&pa[0][0]);  // the register operands of dV and dK were read until here
        hold<BR / 4>(&sa[0][0]);
        pin<NQ / 2>(dqa);
        pin<D / 2>(dva);
        pin<D / 2>(dka);

        // Block j of this thread's accumulators (query row q0 + 16 warp + g + 8 (e / 2), column wg NQ + 8 j + 2 t +
        // e % 2 for its element e) as one 16-byte store; then the warpgroup's half of the tile goes to the engine.
        float* stage = dq_stage + wg * (BR * NQ);
#pragma unroll
        for (int j = 0; j < NQ / 8; ++j)
            *(float4*)(stage + (j * 128 + threadIdx.x % 128) * 4) =
                make_float4(dqa[4 * j], dqa[4 * j + 1], dqa[4 * j + 2], dqa[4 * j + 3]);
        fence_to_tensor_cores();      // the stores are visible to the copy engine ...
        named_bar_sync(1 + wg, 128);  // ... once every thread of the warpgroup has made them
        if (ISSUER) {
            const size_t tile = ((size_t)hq0 + gi) * ntiles + q0 / BR;
            bulk_reduce_add(dq_acc + tile * (BR * D) + wg * (BR * NQ), smem_u32(stage), BR * NQ * 4);
            bulk_commit();
        }
        if (i + 1 < steps) store_vec((i + 1) & 1);  // buffer (i + 1) % 2 has been free since this step's first barrier
    }
    if (ISSUER) bulk_wait<0>();   // the block's shared memory must outlive the engine's last read
    if (COPIER) cp_async_wait<0>();  // (steps = 0: the K and V copies are still owed)

    // The block's K/V head again, from the block index: kept in registers across the loop (ptxas's choice otherwise)
    // it cost 8 bytes of spill at d = 128.
    block_of(group, kb, hb);
    const size_t kvend = (size_t)hb * m;
    // dK (scaled here) and dV of this warpgroup's keys: element e of block j is key kw + 16 warp + g + 8 (e / 2),
    // column 8 j + 2 t + e % 2; two neighbouring columns are written as one 32-bit word.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = kw + 16 * warp + g + 8 * h;
        if (key < m) {
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                const int c = 8 * j + 2 * t;
                *(u32*)(dk + (kvend + key) * D + c) = Ty::pack(scale * dka[4 * j + 2 * h], scale * dka[4 * j + 2 * h + 1]);
                *(u32*)(dv + (kvend + key) * D + c) = Ty::pack(dva[4 * j + 2 * h], dva[4 * j + 2 * h + 1]);
            }
        }
    }
}

#define DEFINE_KERNELS(DT, TY, D)                                                                                     \
    extern "C" __global__ void __launch_bounds__(NT, 1)                                                               \
        bwd_wgmma_balanced_##DT##_d##D(const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,   \
                              const float* dvec, float* dq_acc, u16* dk, u16* dv, int n, int m, int H, int Hk,        \
                              float scale, int causal, int group) {                                                   \
        bwd_wgmma_balanced<TY, D>(q, k, v, dout, lse, dvec, dq_acc, dk, dv, n, m, H, Hk, scale, causal, group);       \
    }                                                                                                                 \
    extern "C" __global__ void bwd_dq_tiles_##DT##_d##D(const float* acc, u16* dq, float scale, int n,                \
                                                       long long blocks) {                                            \
        bwd_dq_tiles<TY, D, BR>(acc, dq, scale, n, blocks);                                                           \
    }

DEFINE_KERNELS(f16, F16, 64)
DEFINE_KERNELS(f16, F16, 128)
DEFINE_KERNELS(bf16, BF16, 64)
DEFINE_KERNELS(bf16, BF16, 128)
