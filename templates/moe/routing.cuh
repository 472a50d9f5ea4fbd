// ---- skuforge MoE routing prologue (templates/moe/routing.cuh) ------------------------------
// Rows -> experts, on the device, no host sync; shared by every moe kernel. Each SKU's extern "C"
// entry points (<symbol>_route_*, templates/moe/grouped_matmul.cu.j2) call these templates with
// its traits S (S::ROUTE_WARPS: warps of the count / scatter blocks, one chunk of rows per warp;
// the offsets and scan kernels run as one block of ROUTE_THREADS, codegen/families/moe/launch.py).
//
// Outputs (workspace, see runtime/moe/grouped.py):
//   row_start[E+2]  bucket b holds the sorted positions [row_start[b], row_start[b+1]);
//                   buckets 0..E-1 are the experts, bucket E the padding rows.
//   tile_start[E+2] exclusive prefix sums of ceil(rows of bucket / bm): the m-tile schedule.
//   perm[M]         (row_experts only) sorted position -> row index, stable (rows of one
//                   expert in increasing row order), so every reduction has a fixed order.
//   status          0, or 1 when offsets are invalid (the main kernels then write NaN).
//   counters[4]     dynamic tile counters of the main kernels, reset to 0.
// Invalid offsets (not trusted) are also reported to the device's status word (runtime/status.py,
// mapped host memory, read by the host without a sync): the offsets entry points take it as their
// last parameter (null: not reported) and pass the SKU's code status.code(op, "offsets") as
// bad_code; the next call on the device raises DeviceValueError.
// The kernels' bodies are templates over S even where they read nothing of it: each SKU of a unit
// has instantiations of its own, so how a kernel is inlined does not depend on the unit's other SKUs.
namespace moe {

// Exclusive scan of one value per thread over the block (Op = sum or max); *total gets the
// reduction of all values. Deterministic: integer math in a fixed tree.
template <typename Op>
__device__ __forceinline__ i64_t block_scan_excl(i64_t v, i64_t identity, Op op, i64_t* smem, i64_t* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    i64_t incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const i64_t t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl = op(incl, t);
    }
    __syncthreads();  // smem may still be read by a previous scan
    if (lane == 31) smem[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const i64_t s = lane < nwarps ? smem[lane] : identity;
        i64_t si = s;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const i64_t t = __shfl_up_sync(0xffffffffu, si, o);
            if (lane >= o) si = op(si, t);
        }
        const i64_t prev = __shfl_up_sync(0xffffffffu, si, 1);
        if (lane < nwarps) smem[lane] = lane == 0 ? identity : prev;
        if (lane == 31) smem[32] = si;
    }
    __syncthreads();
    const i64_t before_lane = __shfl_up_sync(0xffffffffu, incl, 1);
    *total = smem[32];
    return op(smem[warp], lane == 0 ? identity : before_lane);
}

struct SumOp { __device__ i64_t operator()(i64_t a, i64_t b) const { return a + b; } };
struct MaxOp { __device__ i64_t operator()(i64_t a, i64_t b) const { return a > b ? a : b; } };

// tile_start[b] = sum over buckets < b of ceil(rows(b) / bm), b = 0..E+1. row_start is final.
template <class S>
__device__ void finish_tiles(int E, int bm, const i64_t* row_start, i64_t* tile_start, i64_t* smem) {
    const int n = E + 1;                                   // buckets 0..E
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = min(n, lo + per);
    i64_t local = 0;
    for (int b = lo; b < hi; ++b) local += (row_start[b + 1] - row_start[b] + bm - 1) / bm;
    i64_t total;
    i64_t run = block_scan_excl(local, (i64_t)0, SumOp(), smem, &total);
    for (int b = lo; b < hi; ++b) {
        tile_start[b] = run;
        run += (row_start[b + 1] - row_start[b] + bm - 1) / bm;
    }
    if (threadIdx.x == 0) tile_start[E + 1] = total;
}

// Offsets mode: clamp into [0, M], make monotone (prefix max), validate unless trusted; invalid:
// the workspace status is 1 (the main kernels poison their output) and `bad_code` goes to the
// device status word `report` (when not null).
template <class S, typename OFF>
__device__ void route_offsets(const OFF* __restrict__ off, int E, i64_t M, int bm, int trusted,
                              i32_t* status, i64_t* row_start, i64_t* tile_start, u64_t* counters,
                              u32_t* report, u32_t bad_code) {
    __shared__ i64_t smem[33];
    if (threadIdx.x < 4) counters[threadIdx.x] = 0;
    const int n = E + 1;
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = min(n, lo + per);
    int bad = 0;
    i64_t local = 0;
    for (int i = lo; i < hi; ++i) {
        const i64_t v = (i64_t)off[i];
        bad |= (v < 0) | (v > M) | (i == 0 && v != 0) | (i == E && v != M) | (i > 0 && v < (i64_t)off[i - 1]);
        local = max(local, min(max(v, (i64_t)0), M));
    }
    i64_t total;
    i64_t run = block_scan_excl(local, (i64_t)0, MaxOp(), smem, &total);
    for (int i = lo; i < hi; ++i) {
        run = max(run, min(max((i64_t)off[i], (i64_t)0), M));
        row_start[i] = i == 0 ? 0 : run;
    }
    if (threadIdx.x == 0) row_start[E + 1] = M;   // rows past off[E] (trusted only): padding
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        *status = (bad && !trusted) ? 1 : 0;
        if (bad && !trusted && report) *(volatile u32_t*)report = bad_code;
    }
    __syncthreads();
    finish_tiles<S>(E, bm, row_start, tile_start, smem);
}

__device__ __forceinline__ unsigned bucket_of(u32_t id, int E) { return id < (u32_t)E ? id : (unsigned)E; }

// row_experts mode, pass 1: per chunk of rows, rows per bucket -> hist[bucket * chunks + chunk].
template <class S>
__device__ void route_count(const u32_t* __restrict__ ids, i64_t M, int E, i64_t chunk_rows, i64_t chunks,
                            i32_t* __restrict__ hist) {
    extern __shared__ i32_t cnt_s[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i32_t* cnt = cnt_s + warp * (E + 1);
    for (i64_t c = (i64_t)blockIdx.x * S::ROUTE_WARPS + warp; c < chunks; c += (i64_t)gridDim.x * S::ROUTE_WARPS) {
        for (int b = lane; b <= E; b += 32) cnt[b] = 0;
        __syncwarp();
        const i64_t end = min(M, (c + 1) * chunk_rows);
        for (i64_t r0 = c * chunk_rows; r0 < end; r0 += 32) {
            const i64_t r = r0 + lane;
            const unsigned b = r < end ? bucket_of(ids[r], E) : 0xffffffffu;
            const unsigned same = __match_any_sync(0xffffffffu, b);
            if (b != 0xffffffffu && lane == __ffs(same) - 1) cnt[b] += __popc(same);
            __syncwarp();
        }
        for (int b = lane; b <= E; b += 32) hist[(i64_t)b * chunks + c] = cnt[b];
        __syncwarp();
    }
}

// row_experts mode, pass 2 (one block): base = exclusive scan of hist in bucket-major order.
template <class S>
__device__ void route_scan(const i32_t* __restrict__ hist, int E, i64_t M, i64_t chunks, int bm,
                           u32_t* __restrict__ base, i64_t* row_start, i64_t* tile_start,
                           i32_t* status, u64_t* counters) {
    __shared__ i64_t smem[33];
    if (threadIdx.x < 4) counters[threadIdx.x] = 0;
    if (threadIdx.x == 0) *status = 0;
    const i64_t n = (i64_t)(E + 1) * chunks;
    const i64_t per = (n + blockDim.x - 1) / blockDim.x;
    const i64_t lo = threadIdx.x * per, hi = min(n, lo + per);
    i64_t local = 0;
    for (i64_t i = lo; i < hi; ++i) local += hist[i];
    i64_t total;
    i64_t run = block_scan_excl(local, (i64_t)0, SumOp(), smem, &total);
    for (i64_t i = lo; i < hi; ++i) {
        base[i] = (u32_t)run;
        if (i % chunks == 0) row_start[i / chunks] = run;
        run += hist[i];
    }
    if (threadIdx.x == 0) row_start[E + 1] = M;
    __syncthreads();
    finish_tiles<S>(E, bm, row_start, tile_start, smem);
}

// row_experts mode, pass 3: stable scatter, perm[position] = row.
template <class S>
__device__ void route_scatter(const u32_t* __restrict__ ids, i64_t M, int E, i64_t chunk_rows, i64_t chunks,
                              const u32_t* __restrict__ base, i32_t* __restrict__ perm) {
    extern __shared__ u32_t next_s[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32_t* next = next_s + warp * (E + 1);
    const unsigned below = (1u << lane) - 1u;
    for (i64_t c = (i64_t)blockIdx.x * S::ROUTE_WARPS + warp; c < chunks; c += (i64_t)gridDim.x * S::ROUTE_WARPS) {
        for (int b = lane; b <= E; b += 32) next[b] = base[(i64_t)b * chunks + c];
        __syncwarp();
        const i64_t end = min(M, (c + 1) * chunk_rows);
        for (i64_t r0 = c * chunk_rows; r0 < end; r0 += 32) {
            const i64_t r = r0 + lane;
            const unsigned b = r < end ? bucket_of(ids[r], E) : 0xffffffffu;
            const unsigned same = __match_any_sync(0xffffffffu, b);
            if (b != 0xffffffffu) perm[next[b] + __popc(same & below)] = (i32_t)r;
            __syncwarp();
            if (b != 0xffffffffu && lane == __ffs(same) - 1) next[b] += __popc(same);
            __syncwarp();
        }
    }
}

}  // namespace moe
// ---- end of MoE routing ----------------------------------------------------------------------
