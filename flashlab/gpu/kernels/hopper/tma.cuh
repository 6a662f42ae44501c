// What the TMA rungs add to wgmma.cuh: tiles copied by the tensor memory accelerator (TMA) and mbarriers that say
// when they have arrived.
//
// A tensor map (built on the host by the driver, cuTensorMapEncodeTiled, and passed by value as a
// __grid_constant__ kernel parameter) describes a tensor in global memory: its element type, sizes and strides,
// the box one copy moves and the swizzle it writes into shared memory. One thread then asks for a whole box with
// one instruction, cp.async.bulk.tensor, giving the box's coordinates; the copy engine computes every address,
// fills the part of the box outside the tensor with zeros and writes the box in the 128-byte swizzled layout that
// wgmma reads (wgmma.cuh). When the bytes have landed it tells an mbarrier.
//
// An mbarrier is a 64-bit object in shared memory with a phase bit. A phase completes when the expected number
// of threads have arrived and the expected number of bytes (set by arrive.expect_tx) have been delivered; waiting
// threads ask with try_wait.parity whether the phase of a given parity has completed. A ring of stages reuses
// each barrier: tile t uses stage t % S and waits for parity (t / S) % 2.

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned.
struct alignas(64) TensorMap {
    u64 opaque[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the barriers' initialisation visible to the copy engine (the async proxy) before any copy uses them.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// This thread arrives on the barrier and adds `bytes` to the bytes its current phase waits for.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Whether the phase of parity `parity` has completed (a bounded wait inside; loop on it).
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
// Copy the box at coordinates (x, y, z) of the tensor `map` describes into shared memory at dst; the bytes count
// towards the current phase of barrier `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}

// The same for a 4-D map: the box at (x, y, z, w).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, int x, int y, int z, int w, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];" ::"r"(dst),
        "l"(map), "r"(x), "r"(y), "r"(z), "r"(w), "r"(bar)
        : "memory");
}

// This thread arrives on the barrier (no bytes expected): a consumer saying it is done with a stage.
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// A warpgroup gives registers back (dec) or takes them (inc) up to N per thread; the kernel must start with a
// register cap (__launch_bounds__(threads, 1)) and each role must be one branch.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// Named barriers (ids 1-15; __syncthreads is 0) for `count` threads, a multiple of 32: bar.sync waits until
// `count` threads have reached the barrier, bar.arrive counts this thread and goes on. Two warpgroups take turns
// with them (rung 4): one waits on its barrier, the other arrives on it when its turn is over.
__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
