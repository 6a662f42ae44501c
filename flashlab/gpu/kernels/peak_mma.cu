// The tensor-core ceiling of mma.sync: how many FLOP/s this GPU's tensor cores give to the instruction every
// rung of the ladder issues (m16n8k16, fp16 or bf16 inputs, fp32 accumulators), with nothing else in the loop.
//
// Each warp keeps its A and B fragments in registers and issues mma after mma into ACC independent accumulators,
// so that no mma waits for the result of the one before it (an mma's latency is many cycles; ACC chains in
// flight hide it). No memory is touched in the loop; the accumulators are summed and stored once at the end so
// that the compiler cannot drop the work. FLOP per mma: 2 * 16 * 8 * 16 = 4096.
//
// Grid: any number of blocks of any number of warps (python -m flashlab bench peak fills every SM).

#ifndef ACC
#define ACC 8
#endif

typedef unsigned int u32;

template <bool BF16>
__device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

template <bool BF16>
__device__ void peak(float* out, int iters, u32 seed) {
    // Fragments from the thread index and a seed the host passes: values the compiler cannot know.
    u32 a[4], b[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = (seed * (threadIdx.x + 1) + i) & 0x3c003c00u;  // small normal numbers
    b[0] = a[0] ^ 0x00010001u;
    b[1] = a[1] ^ 0x00010001u;
    float c[ACC][4];
#pragma unroll
    for (int j = 0; j < ACC; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int j = 0; j < ACC; ++j) mma<BF16>(c[j], a, b);
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < ACC; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void mma_peak_f16(float* out, int iters, unsigned seed) { peak<false>(out, iters, seed); }
extern "C" __global__ void mma_peak_bf16(float* out, int iters, unsigned seed) { peak<true>(out, iters, seed); }
