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
// flight on it. The split's partial (o_s, lse_s) is written exactly as decode_r1_split.cu writes it.
//
// The merge is done by the split blocks themselves, not by a second kernel. decode_r1_split.cu's merge kernel took
// 7.1 us after a 123 us split kernel (GQA 32/8 heads, 131072 keys, 66 splits), plus the gap between two launches;
// and every block of the split kernel is done at about the same time, so the merge is all tail. Here the splits of
// a chunk of query rows count themselves done on a counter in global memory (a fence makes a block's partial
// visible before its count): the last of each group of GROUP splits merges the group's partials into one, and the
// last group to finish merges the groups' into o and lse. Two levels rather than one, because a warp that merges
// walks its rows one after another, a round trip to L2 for each: at 66 splits and 4 rows a single last block would
// wait on 4 x 5 rounds of 16 loads, here on 2 x 4 rounds. Each merging block sets its counter back to 0, so the
// counters stay zero from call to call and nothing has to clear them.
//
// Grid: (ceil(G * n / 16), num_splits, B * Hk) with G = H / Hk; block: 32 threads. Layout and the arguments up to
// causal as decode_split_* in decode_r1_split.cu; then o (like q) and lse (B, H, n) fp32, the group partials
// gopart (B, H, n, ngroups, D) and glpart (B, H, n, ngroups) fp32 with ngroups = ceil(num_splits / GROUP), and
// counters: (B * Hk * ceil(G * n / 16)) x (ngroups + 1) int32, zero before the launch and zero after it. Needs
// sm_80 (mma.sync m16n8k16 with bf16 inputs, cp.async).

#define NEG_INF (-__int_as_float(0x7f800000))
#define BK 32  // keys per tile (flashlab.gpu.decoding.BLOCK_KEYS: split lengths are whole tiles)
#define ROWS 16  // query rows per block: the rows of one mma
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
// Tiles of the ring: 3 x 16 KB at d = 128 is the 48 KB a block may have without asking for more.
#define STAGES 3
#define GROUP 16  // splits merged by the last block of a group (flashlab.gpu.decoding.MERGE_GROUP)

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

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// Merge the partials [first, first + count) of the rows row_base .. row_base + nrows - 1, whose partials lie
// `stride` to a row in (op, lp), with chapter 1's rule. FINAL: into o (Ty) and lse; else into slot `slot` of the
// group partials (go, gl), `gstride` to a row. Lane l owns columns D/32 l .. D/32 (l + 1) - 1. A row takes its
// partials GROUP at a time, every load of them issued before any is used: one round trip to L2 per GROUP partials
// and row. (A first version guarded each load with `if (s < count)`; the branches kept ptxas from hoisting the loads,
// so a row waited on one round trip per partial, and the merge added 18 us of tail to a GQA step on an H200.) Past
// `count` the loads repeat the last partial and weigh 0; the running maximum is rescaled from chunk to chunk.
template <class Ty, int D, bool FINAL>
__device__ void merge_rows(const float* __restrict__ op, const float* __restrict__ lp, int stride, int first,
                           int count, size_t row_base, int nrows, float* __restrict__ go, float* __restrict__ gl,
                           int gstride, int slot, u16* __restrict__ o, float* __restrict__ lse) {
    constexpr int C = D / 32;
    const int lane = threadIdx.x;
    for (int r = 0; r < nrows; ++r) {
        const size_t row = row_base + r;
        const float* l = lp + row * stride + first;
        const float* p = op + (row * stride + first) * D + C * lane;
        float mx = NEG_INF, wsum = 0.f, acc[C];
#pragma unroll
        for (int j = 0; j < C; ++j) acc[j] = 0.f;
        for (int s0 = 0; s0 < count; s0 += GROUP) {
            float lv[GROUP];
            float2 xv[GROUP][C / 2];
#pragma unroll
            for (int i = 0; i < GROUP; ++i) {
                const int s = min(s0 + i, count - 1);
                lv[i] = __ldcg(l + s);
#pragma unroll
                for (int j = 0; j < C / 2; ++j) xv[i][j] = __ldcg((const float2*)(p + (size_t)s * D) + j);
            }
            float cmx = mx;
#pragma unroll
            for (int i = 0; i < GROUP; ++i) cmx = fmaxf(cmx, s0 + i < count ? lv[i] : NEG_INF);
            const float ms = cmx == NEG_INF ? 0.f : cmx;  // nothing seen yet: weights exp(-inf) = 0, not nan
            const float c = exp2f((mx - ms) * LOG2E);    // the sums so far, rescaled to the new maximum
            wsum *= c;
#pragma unroll
            for (int j = 0; j < C; ++j) acc[j] *= c;
#pragma unroll
            for (int i = 0; i < GROUP; ++i) {
                const float w = s0 + i < count ? exp2f((lv[i] - ms) * LOG2E) : 0.f;
                wsum += w;
#pragma unroll
                for (int j = 0; j < C / 2; ++j) {
                    acc[2 * j] = fmaf(w, xv[i][j].x, acc[2 * j]);
                    acc[2 * j + 1] = fmaf(w, xv[i][j].y, acc[2 * j + 1]);
                }
            }
            mx = cmx;
        }
        const float ms = mx == NEG_INF ? 0.f : mx;
        const float inv = wsum > 0.f ? 1.f / wsum : 0.f, lrow = wsum > 0.f ? ms + logf(wsum) : NEG_INF;
        if (FINAL) {
#pragma unroll
            for (int j = 0; j < C; j += 2)
                *(u32*)(o + row * D + C * lane + j) = Ty::pack(acc[j] * inv, acc[j + 1] * inv);
            if (lane == 0) lse[row] = lrow;
        } else {
            float* g = go + (row * gstride + slot) * D + C * lane;
#pragma unroll
            for (int j = 0; j < C; j += 2) *(float2*)(g + j) = make_float2(acc[j] * inv, acc[j + 1] * inv);
            if (lane == 0) gl[row * gstride + slot] = lrow;
        }
    }
}

// Count this block done on `counter`; true in every lane of the block that is the `of`-th to finish. The fences
// order this block's writes before its count and the last block's reads after it (the pattern of the CUDA
// programming guide's last-block reduction). Lane 0's answer reaches the others by a warp maximum: a shared flag
// would not fit beside the 48 KB ring.
__device__ __forceinline__ bool last_to_finish(int* counter, int of) {
    __threadfence();
    __syncwarp();
    const float mine = threadIdx.x == 0 && atomicAdd(counter, 1) == of - 1 ? 1.f : 0.f;
    const bool last = warp_max(mine) > 0.f;
    if (last) __threadfence();
    return last;
}

// The merge: by the last split of each group to finish, then by the last group. Not inlined: inlined, it changed
// how ptxas allocated the registers of the main loop above (203 instead of 252), and the GQA step took 152 us
// instead of 132 on an H200.
template <class Ty, int D>
__device__ __noinline__ void merge_splits(const float* __restrict__ opart, const float* __restrict__ lpart,
                                          int split, int nsplit, size_t row_base, int nrows, u16* __restrict__ o,
                                          float* __restrict__ lse, float* __restrict__ gopart,
                                          float* __restrict__ glpart, int* __restrict__ counters) {
    const int lane = threadIdx.x;
    const int ngroups = (nsplit + GROUP - 1) / GROUP, grp = split / GROUP;
    int* count = counters + ((size_t)blockIdx.z * gridDim.x + blockIdx.x) * (ngroups + 1);
    if (!last_to_finish(count + grp, min(GROUP, nsplit - grp * GROUP))) return;
    if (lane == 0) count[grp] = 0;  // every split of the group has counted: nobody else touches it this launch
    if (ngroups == 1) {
        merge_rows<Ty, D, true>(opart, lpart, nsplit, 0, nsplit, row_base, nrows, nullptr, nullptr, 0, 0, o, lse);
        return;
    }
    merge_rows<Ty, D, false>(opart, lpart, nsplit, grp * GROUP, min(GROUP, nsplit - grp * GROUP), row_base, nrows,
                             gopart, glpart, ngroups, grp, nullptr, nullptr);
    if (!last_to_finish(count + ngroups, ngroups)) return;
    if (lane == 0) count[ngroups] = 0;
    merge_rows<Ty, D, true>(gopart, glpart, ngroups, 0, ngroups, row_base, nrows, nullptr, nullptr, 0, 0, o, lse);
}

template <class Ty, int D>
__device__ void decode_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                           const int* __restrict__ lens, float* __restrict__ opart, float* __restrict__ lpart, int n,
                           int m, int H, int Hk, int split_len, float scale, int causal, u16* __restrict__ o,
                           float* __restrict__ lse, float* __restrict__ gopart, float* __restrict__ glpart,
                           int* __restrict__ counters) {
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

    merge_splits<Ty, D>(opart, lpart, split, nsplit, row_base, nrows, o, lse, gopart, glpart, counters);
}

#define DEFINE_KERNEL(DT, TY, D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32) decode_mma_##DT##_d##D(                                       \
        const u16* q, const u16* k, const u16* v, const int* lens, float* opart, float* lpart, int n, int m, int H, \
        int Hk, int split_len, float scale, int causal, u16* o, float* lse, float* gopart, float* glpart,          \
        int* counters) {                                                                                           \
        decode_mma<TY, D>(q, k, v, lens, opart, lpart, n, m, H, Hk, split_len, scale, causal, o, lse, gopart,      \
                          glpart, counters);                                                                       \
    }

DEFINE_KERNEL(f16, F16, 64)
DEFINE_KERNEL(f16, F16, 128)
DEFINE_KERNEL(bf16, BF16, 64)
DEFINE_KERNEL(bf16, BF16, 128)
