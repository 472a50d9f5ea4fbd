// ---- skuforge Hopper helpers (templates/common/hopper.cuh) ---------------------------------
// Inline PTX for the sm_90a units (the wgmma backend): transaction mbarriers, tensor-map (TMA) tile
// loads and stores, shared-memory matrix descriptors and the wgmma fences, register reallocation. No CUDA
// headers: the tensor map is an opaque 128-byte, 64-byte aligned value (encoded on the host by
// cuTensorMapEncodeTiled, runtime/tma.py) passed as a `const __grid_constant__` kernel parameter.
struct __align__(64) CUtensorMap { unsigned long long opaque[16]; };

__device__ __forceinline__ u32_t smem_u32(const void* p) { return (u32_t)__cvta_generic_to_shared(p); }

// -- mbarriers (shared::cta addresses) --------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32_t bar, u32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also announces `bytes` of copy-engine writes the phase waits for.
__device__ __forceinline__ void mbar_expect_tx(u32_t bar, u32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase of parity `parity` has completed (a fresh barrier: parity 1 is complete).
__device__ __forceinline__ void mbar_wait(u32_t bar, u32_t parity) {
    u32_t done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// -- tensor-map tile loads: the box at coordinates (innermost first) into shared memory ---------
__device__ __forceinline__ void tma_prefetch(const CUtensorMap* m) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(m) : "memory");
}
__device__ __forceinline__ void tma_load_2d(u32_t dst, const CUtensorMap* m, u32_t bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, { %3, %4 }], [%2];\n"
                 ::"r"(dst), "l"(m), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load_3d(u32_t dst, const CUtensorMap* m, u32_t bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, { %3, %4, %5 }], [%2];\n"
                 ::"r"(dst), "l"(m), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

// -- tensor-map tile stores: shared memory to the box at coordinates (innermost first) -----------
// Bulk-async: the issuing thread groups its stores (commit), and waits for a group's shared-memory
// reads (`.read`: the buffer may be rewritten) or for its completion. Parts of the box outside the
// tensor's bounds are not written.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* m, u32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, { %2, %3 }], [%1];\n"
                 ::"l"(m), "r"(src), "r"(c0), "r"(c1) : "memory");
}
// An L2 policy for stores of outputs far larger than L2 and not read again by the kernel (the weight
// gradient): their lines are evicted first, ahead of the operands the next tiles read.
__device__ __forceinline__ u64_t l2_evict_first() {
    u64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* m, u32_t src, int c0, int c1, int c2, u64_t pol) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, { %2, %3, %4 }], [%1], %5;\n"
                 ::"l"(m), "r"(src), "r"(c0), "r"(c1), "r"(c2), "l"(pol) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// At most N of this thread's newest store groups still read shared memory.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Every store group of this thread has completed.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Ordinary shared-memory stores made visible to the async proxy (wgmma operand reads, TMA writes).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Named barrier `id` over `threads` threads (id 0 is __syncthreads).
__device__ __forceinline__ void named_sync(u32_t id, u32_t threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// -- wgmma -------------------------------------------------------------------------------------
// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading / stride byte offsets
// (K-major: stride = between 8-row groups, leading unused; MN-major: leading = between 64-element
// column blocks, stride = between 8-row groups of the reduction axis). Atoms are 1024-byte aligned.
__device__ __forceinline__ u64_t wg_desc(u32_t addr, u32_t lbo, u32_t sbo) {
    return (u64_t)((addr & 0x3FFFF) >> 4) | ((u64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((u64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads / writes across the asynchronous wgmma.
template <int N> __device__ __forceinline__ void wg_fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// -- register reallocation between warpgroups (needs a register cap at entry: __launch_bounds__(t, 1))
template <int R> __device__ __forceinline__ void regs_grow() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R> __device__ __forceinline__ void regs_shrink() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }
// ---- end of Hopper helpers ---------------------------------------------------------------------
