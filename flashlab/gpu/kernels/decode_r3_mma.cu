// Split-KV decoding, third version: the query rows of a GQA group as the rows of a tensor-core mma.
//
// What limits decode_r2_warp_keys.cu when a group has four or more rows (GQA 32/8 heads at n = 1: R = 4): at d = 128
// a warp instruction covers two keys (16 lanes each), and per such pair each row costs a lane 8 FMAs of Q K and 8 of
// P V, four xor-shuffles (and adds) to sum a dot product over the key's 16 lanes; then conversions of K and V to
// fp32, the exponentials, masks, maxima and the rescaling. Measured with Nsight Compute on an H200
// (4 rows, 8 K/V heads, 131072 keys; data/raw/ncu/ncu_decode_keys_gqa.txt): 89 warp instructions per key, the
// schedulers issuing on 69 % of cycles and DRAM at 79 % of its peak -- the loop is held back mainly by instruction
// issue: cutting the instructions (below) brought DRAM to 91 %.
//
// Here a warp scores 32 keys at once with mma.sync m16n8k16, as the forward kernels of chapter 7 do: the (up to) 16
// query rows of a group are the 16 rows of the A operand (rows past the group are zeros, and the tensor cores do
// that wasted work for free: the kernel is bound by memory, not by the tensor pipe), K's rows are the 8-key column
// blocks of the B operand (ldmatrix), and P V takes P from S's accumulators in registers as in rung 3 and V by a
// transposing ldmatrix. At d = 128 a 32-key tile is 64 mma, 32 ldmatrix and 16 exponentials a lane (and 2 for the
// rescaling); with the rest (the copies' address arithmetic, the masks), Nsight Compute counted 30 warp instructions
// per key (89 before): the schedulers issue on 30 % of cycles and DRAM runs at 91 % of its peak
// (data/raw/ncu/ncu_decode_mma_gqa.txt).
//
// One warp is one block, and it streams its split through a ring of STAGES tiles in shared memory with cp.async
// (rung 5): STAGES - 1 tiles of K and V in flight while it computes on one, with no barrier but __syncwarp. At
// d = 128 the ring is 48 KB of static shared memory, so an SM holds 4 such blocks and 4 x 2 x 16 KB of loads are in
// flight on it. The split's partial (o_s, lse_s) is written exactly as decode_r1_split.cu writes it, and its merge
// kernel (decode_merge_*) finishes the job; or, in decode_fused_* at the end of this file, the blocks themselves.
//
// Grid: (ceil(G * n / 16), num_splits, B * Hk) with G = H / Hk; block: 32 threads. Layout and arguments as
// decode_split_* in decode_r1_split.cu; decode_fused_* takes seven more: the tree's nodes tree_o (rows, ntree, D)
// and tree_l (rows, ntree), fp32; its counters, ncount ints per group (group blockIdx.z * gridDim.x + blockIdx.x,
// zero before the launch and left at zero); o and lse as the merge kernel writes them; ntree and ncount
// (flashlab.gpu.decoding.merge_tree_sizes). Needs sm_80 (mma.sync m16n8k16 with bf16 inputs, cp.async).

#define NEG_INF (-__int_as_float(0x7f800000))
#define BK 32  // keys per tile (flashlab.gpu.decoding.BLOCK_KEYS: split lengths are whole tiles)
#define ROWS 16  // query rows per block: the rows of one mma
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
// Tiles of the ring: 3 x 16 KB at d = 128 is the 48 KB a block may have without asking for more.
#define STAGES 3

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

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
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
// Offset (in elements) of 16-byte chunk c of row r in a swizzled [rows][D] tile: the 8 rows an ldmatrix reads
// fall in 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
    return r * D + ((c ^ (r & 7)) << 3);
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <class Ty, int D>
__device__ void decode_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                           const int* __restrict__ lens, float* __restrict__ opart, float* __restrict__ lpart, int n,
                           int m, int H, int Hk, int split_len, float scale, int causal) {
    __shared__ __align__(128) u16 ks[STAGES][BK * D];
    __shared__ __align__(128) u16 vs[STAGES][BK * D];

    const int lane = threadIdx.x, g = lane >> 2, tg = lane & 3;
    const int G = H / Hk, rows_total = G * n;
    const int r0 = blockIdx.x * ROWS, split = blockIdx.y, nsplit = gridDim.y;
    const int b = blockIdx.z / Hk, hk = blockIdx.z % Hk;
    const int nrows = min(ROWS, rows_total - r0);
    const int len = lens ? lens[b] : m;  // the launcher checked 0 <= lens[b] <= m
    const int kbeg = split * split_len, kend = min(len, kbeg + split_len);
    const int ntiles = kend > kbeg ? (kend - kbeg + BK - 1) / BK : 0;
    // The rows of a group are consecutive in q: heads hk * G .. hk * G + G - 1, n tokens each.
    const size_t row_base = ((size_t)b * H + (size_t)hk * G) * n + r0;
    const u16* kb = k + ((size_t)b * Hk + hk) * m * D;
    const u16* vb = v + ((size_t)b * Hk + hk) * m * D;
    const float scale2 = scale * LOG2E;

    // Tile t of the split into stage t % STAGES; keys past the split's end are zeros (and masked below).
    auto load = [&](int t) {
        const int k0 = kbeg + t * BK, st = t % STAGES;
#pragma unroll
        for (int e = lane; e < BK * D / 8; e += 32) {
            const int r = e / (D / 8), c = e % (D / 8);
            const bool valid = k0 + r < kend;
            const size_t off = (size_t)(valid ? k0 + r : 0) * D + c * 8;
            cp_async16(smem_addr(&ks[st][swz<D>(r, c)]), kb + off, valid);
            cp_async16(smem_addr(&vs[st][swz<D>(r, c)]), vb + off, valid);
        }
    };
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {  // one commit group per tile, empty past the last, so waits count tiles
        if (t < ntiles) load(t);
        cp_async_commit();
    }

    // Q in the A fragment layout, straight from global memory: register j of k-step kk holds row g (j even) or
    // g + 8 (j odd), columns 16 kk + 2 tg (j < 2) or 16 kk + 8 + 2 tg (j >= 2) and the next. Rows past the group's
    // are zeros.
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = g + 8 * (j & 1), col = 16 * kk + 8 * (j >> 1) + 2 * tg;
            qf[kk][j] = row < nrows ? *(const u32*)(q + (row_base + row) * D + col) : 0u;
        }
    // The last key each of this thread's two rows may see (row r is token r % n of its head).
    const int last0 = causal ? (r0 + g) % n + len - n : kend - 1;
    const int last1 = causal ? (r0 + g + 8) % n + len - n : kend - 1;

    float oacc[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) oacc[nt][0] = oacc[nt][1] = oacc[nt][2] = oacc[nt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // log2 units; l: this thread's columns only

    for (int t = 0; t < ntiles; ++t) {
        cp_async_wait<STAGES - 2>();  // tile t has landed (this lane's copies)
        __syncwarp();                 // ... every lane's; and every lane is done with the stage refilled next
        if (t + STAGES - 1 < ntiles) load(t + STAGES - 1);
        cp_async_commit();
        const u16* kt = ks[t % STAGES];
        const u16* vt = vs[t % STAGES];
        const int k0 = kbeg + t * BK;

        // S = Q K^T for 32 keys: one ldmatrix.x4 gives the B fragments of 8 keys for two 16-wide steps along d.
        float s[BK / 8][4];
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                u32 bf[4];
                ldsm_x4(bf, smem_addr(kt + swz<D>(nt * 8 + (lane & 7), kk * 2 + (lane >> 3))));
                Ty::mma(s[nt], qf[kk], bf[0], bf[1]);
                Ty::mma(s[nt], qf[kk + 1], bf[2], bf[3]);
            }
        }
        // Scale into log2 units, mask (past the split or the cache, causal), online softmax of the two rows.
        float t0 = NEG_INF, t1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + nt * 8 + 2 * tg + (e & 1);
                s[nt][e] = key < kend && key <= (e < 2 ? last0 : last1) ? s[nt][e] * scale2 : NEG_INF;
            }
            t0 = fmaxf(t0, fmaxf(s[nt][0], s[nt][1]));
            t1 = fmaxf(t1, fmaxf(s[nt][2], s[nt][3]));
        }
        const float mn0 = fmaxf(m0, quad_max(t0)), mn1 = fmaxf(m1, quad_max(t1));
        const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;  // no (-inf) - (-inf)
        const float c0 = exp2f(m0 - ms0), c1 = exp2f(m1 - ms1);
        float u0 = 0.f, u1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - ms0);
            s[nt][1] = exp2f(s[nt][1] - ms0);
            s[nt][2] = exp2f(s[nt][2] - ms1);
            s[nt][3] = exp2f(s[nt][3] - ms1);
            u0 += s[nt][0] + s[nt][1];
            u1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * c0 + u0;
        l1 = l1 * c1 + u1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            oacc[nt][0] *= c0;
            oacc[nt][1] *= c0;
            oacc[nt][2] *= c1;
            oacc[nt][3] *= c1;
        }
        // O += P V: P's A fragment for keys 16 kk .. 16 kk + 15 is S's column blocks 2 kk and 2 kk + 1.
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            u32 pa[4];
            pa[0] = Ty::pack(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = Ty::pack(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = Ty::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = Ty::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                u32 bf[4];
                ldsm_x4_t(bf, smem_addr(vt + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, nt + (lane >> 4))));
                Ty::mma(oacc[nt], pa, bf[0], bf[1]);
                Ty::mma(oacc[nt + 1], pa, bf[2], bf[3]);
            }
        }
    }
    cp_async_wait<0>();  // no copy outlives the block (the empty groups past the last tile)

    // The split's partial: O / l and lse in natural log (-inf and zeros for a row that saw no key).
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = g + 8 * h;
        if (row >= nrows) continue;
        const float l = h ? l1 : l0, mx = h ? m1 : m0, inv = l > 0.f ? 1.f / l : 0.f;
        const size_t at = (row_base + row) * nsplit + split;
        float* op = opart + at * D;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt)
            *(float2*)(op + nt * 8 + 2 * tg) = make_float2(oacc[nt][2 * h] * inv, oacc[nt][2 * h + 1] * inv);
        if (tg == 0) lpart[at] = l > 0.f ? (mx + log2f(l)) * LN2 : NEG_INF;
    }
}

// ------------------------------------------------------------------------------------------------------------------
// The same kernel with the merge inside it (kernel="fused"): no second launch. What the merge kernel of
// decode_r1_split.cu costs a GQA step on the H200 is its own few microseconds plus the gap between two launches, and
// the split kernel alone already streams the cache at the copy's speed: the gap to the read-once time is the merge.
//
// The blocks of a group (one chunk of query rows of one (batch, K/V head)) finish at about the same time, so the
// merge must not fall to one block reading every partial: at S = 66 splits and 4 rows that is 135 KB through one
// warp. Instead the partials are merged as a tree of fan-in FAN. The splits of a group form nodes of level 0; each
// run of FAN consecutive nodes has a counter, and the block that arrives last at it (the atomic add returns the
// run's size minus 1) merges that run into one node of the next level and arrives there in turn. The block that
// merges the last run writes o and lse. At FAN = 16 a GQA step (66 splits) takes two levels; a step with one row
// per group and 16 splits takes one. A merge has the loads of two rows in flight at once (16 per lane per row).
//
// The order of memory operations: a node's writes by every lane, __syncwarp (which orders the warp's memory
// operations), then lane 0's atomic add with release and acquire semantics at GPU scope (atom.acq_rel.gpu): the
// release carries the whole warp's writes, the acquire makes every earlier arrival's writes visible to the last
// arriver, and a second __syncwarp passes that on to its other lanes, which read the nodes with __ldcg (from L2).
// This is the pattern of a grid-wide semaphore (one thread releases after a block barrier, one acquires before
// one). The CUDA programming guide's threadfence example instead has every thread run __threadfence(), a
// sequentially consistent fence (MEMBAR.SC in the machine code), at every arrival. The last arriver sets the
// counter back to 0, so the counters (zeroed once when the workspace allocates them) are ready for the next call
// on the stream.
//
// Nodes above level 0 live in tree_o (rows, T, D) / tree_l (rows, T), T the number of them per row
// (flashlab.gpu.decoding.merge_tree_sizes), so that the level-0 partials stay what the "mma" kernel writes.
#define FAN 16

// One arrival at a run's counter: atomic add of 1 with release (the warp's writes before it, which __syncwarp
// ordered before this lane's) and acquire (the other blocks' writes, released by their arrivals, visible after it).
__device__ __forceinline__ int arrive_acq_rel(int* p) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
    return old;
}

template <int C>
__device__ __forceinline__ void load_cols(float* x, const float* p) {  // C consecutive floats from L2
    if constexpr (C == 4) {
        const float4 v = __ldcg((const float4*)p);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else {
        const float2 v = __ldcg((const float2*)p);
        x[0] = v.x, x[1] = v.y;
    }
}

template <int C>
__device__ __forceinline__ void store_cols(float* p, const float* x) {
    if constexpr (C == 4)
        *(float4*)p = make_float4(x[0], x[1], x[2], x[3]);
    else
        *(float2*)p = make_float2(x[0], x[1]);
}

template <class Ty, int D>
__device__ void merge_tree(const float* __restrict__ opart, const float* __restrict__ lpart, float* tree_o,
                           float* tree_l, int* counts, u16* __restrict__ o, float* __restrict__ lse, int n, int H,
                           int Hk, int ntree, int ncount) {
    constexpr int C = D / 32;  // columns per lane
    const int lane = threadIdx.x, G = H / Hk, r0 = blockIdx.x * ROWS;
    const int b = blockIdx.z / Hk, hk = blockIdx.z % Hk, nrows = min(ROWS, G * n - r0);
    const size_t row_base = ((size_t)b * H + (size_t)hk * G) * n + r0;
    int* cnt = counts + ((size_t)blockIdx.z * gridDim.x + blockIdx.x) * ncount;
    // The level being merged: its nodes' arrays, row stride and first node; this block's node index in it
    const float *src_o = opart, *src_l = lpart;
    int stride = gridDim.y, first_node = 0, nodes = gridDim.y, idx = blockIdx.y, tree_at = 0, cnt_at = 0;
    while (true) {
        const int run = idx / FAN, start = run * FAN, members = min(FAN, nodes - start);
        const int up = (nodes + FAN - 1) / FAN;  // nodes of the next level
        __syncwarp();  // every lane's writes of the node, before lane 0's release below
        bool last = false;
        if (lane == 0) {
            last = arrive_acq_rel(cnt + cnt_at + run) == members - 1;
            if (last) cnt[cnt_at + run] = 0;  // every member has arrived: ready for the next call
        }
        if (!__any_sync(0xffffffffu, last)) return;  // lane 0's answer, to every lane
        __syncwarp();  // a vote orders no memory: the barrier puts lane 0's acquire before every lane's loads
        constexpr int RB = 2;  // rows merged together: their loads in flight at once
        for (int r0 = 0; r0 < nrows; r0 += RB) {
            float ls[RB][FAN], os[RB][FAN][C];
#pragma unroll
            for (int j = 0; j < RB; ++j) {  // every load of these rows issued before the first is used
                const size_t row = row_base + r0 + j;
#pragma unroll
                for (int i = 0; i < FAN; ++i) {
                    const bool real = r0 + j < nrows && i < members;
                    const size_t at = row * stride + first_node + start + i;
                    ls[j][i] = real ? __ldcg(src_l + at) : NEG_INF;
                    if (real) load_cols<C>(os[j][i], src_o + at * D + lane * C);
                }
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                if (r0 + j >= nrows) break;
                const size_t row = row_base + r0 + j;
                float mx = NEG_INF;
#pragma unroll
                for (int i = 0; i < FAN; ++i) mx = fmaxf(mx, ls[j][i]);
                float w = 0.f, x[C];
#pragma unroll
                for (int c = 0; c < C; ++c) x[c] = 0.f;
                if (mx != NEG_INF) {  // else no node of the run saw a key: o = 0, lse = -inf, as in the reference
#pragma unroll
                    for (int i = 0; i < FAN; ++i) {
                        const float e = i < members ? expf(ls[j][i] - mx) : 0.f;  // 0 for a node that saw no key
                        w += e;
#pragma unroll
                        for (int c = 0; c < C; ++c) x[c] = i < members ? fmaf(e, os[j][i][c], x[c]) : x[c];
                    }
#pragma unroll
                    for (int c = 0; c < C; ++c) x[c] /= w;
                }
                const float l = mx == NEG_INF ? NEG_INF : mx + logf(w);
                if (up == 1) {  // the root: the step's output, rounded to the inputs' type
                    u32 packed[C / 2];
#pragma unroll
                    for (int c = 0; c < C; c += 2) packed[c / 2] = Ty::pack(x[c], x[c + 1]);
                    u16* dst = o + row * D + lane * C;
                    if constexpr (C == 4)
                        *(uint2*)dst = make_uint2(packed[0], packed[1]);
                    else
                        *(u32*)dst = packed[0];
                    if (lane == 0) lse[row] = l;
                } else {
                    const size_t at = row * ntree + tree_at + run;
                    store_cols<C>(tree_o + at * D + lane * C, x);
                    if (lane == 0) tree_l[at] = l;
                }
            }
        }
        if (up == 1) return;
        src_o = tree_o, src_l = tree_l, stride = ntree, first_node = tree_at;
        tree_at += up, cnt_at += up, nodes = up, idx = run;
    }
}

// When the merge kernel is launched as a programmatic dependent of decode_mma_* (decode(..., dependent_merge=True),
// sm_90 on), its blocks may be scheduled once every block of this grid has said so here, onto whatever room the SMs
// have, and wait in griddepcontrol.wait for this grid to end -- so its launch and block start-up overlap the split
// work instead of following it. Said at the start: the merge waits for the whole grid in any case, so nothing it
// reads depends on where this stands, and a grid of one wave (the default split count) has every block started.
__device__ __forceinline__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define DEFINE_KERNEL(DT, TY, D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32) decode_mma_##DT##_d##D(                                       \
        const u16* q, const u16* k, const u16* v, const int* lens, float* opart, float* lpart, int n, int m, int H, \
        int Hk, int split_len, float scale, int causal) {                                                          \
        let_dependents_launch();                                                                                   \
        decode_mma<TY, D>(q, k, v, lens, opart, lpart, n, m, H, Hk, split_len, scale, causal);                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(32) decode_fused_##DT##_d##D(                                     \
        const u16* q, const u16* k, const u16* v, const int* lens, float* opart, float* lpart, int n, int m, int H, \
        int Hk, int split_len, float scale, int causal, float* tree_o, float* tree_l, int* counts, u16* o,         \
        float* lse, int ntree, int ncount) {                                                                       \
        decode_mma<TY, D>(q, k, v, lens, opart, lpart, n, m, H, Hk, split_len, scale, causal);                     \
        merge_tree<TY, D>(opart, lpart, tree_o, tree_l, counts, o, lse, n, H, Hk, ntree, ncount);                  \
    }

DEFINE_KERNEL(f16, F16, 64)
DEFINE_KERNEL(f16, F16, 128)
DEFINE_KERNEL(bf16, BF16, 64)
DEFINE_KERNEL(bf16, BF16, 128)
