// ---- skuforge MoE grouped matmul: the problem (templates/moe/problem.cuh) --------------------
// What every moe main kernel shares: the problem, the dynamic tile scheduler, the m-tile decoder
// (routing -> rows of one expert), the NaN fill for invalid offsets and the paired output stores.
//   grouped_matmul                  y[m, n]  = sum_k x[m, k] * w[e(m), n, k]      (NT, FWD)
//   grouped_matmul_backward_input   dx[m, k] = sum_n dy[m, n] * w[e(m), n, k]     (NN, DGRAD)
//   grouped_matmul_backward_weight  dw[e, n, k] = sum_{m in e} dy[m, n] * x[m, k] (TN, WGRAD)
// Generic names inside the kernels: the output tile is BM x BN ("rows" x "cols"), the reduction
// runs over R. FWD / DGRAD gather output rows (rows of x / dy) through the routing; WGRAD gathers
// the reduction (rows of expert e) and tiles (e, n, k).
// The templates over the problem take the SKU's traits S (a struct of the SKU's own namespace, from
// templates/moe/grouped_matmul.cu.j2): S::T (input storage), S::OutT (output storage), S::PASS,
// S::ROUTE_WARPS. Each SKU of a unit thus has instantiations of its own, as if written out for it
// (the simt and mma SKUs of a unit may share T, OutT and PASS).
namespace moe {

enum Pass { FWD = 0, DGRAD = 1, WGRAD = 2 };

template <class S>
struct Problem {
    using T = typename S::T;
    using OutT = typename S::OutT;
    const T* x; i64_t ldx;
    const T* w; i64_t w_se, w_sn;
    const T* dy; i64_t lddy;
    OutT* out;
    i64_t M, N, K; int E;
    const i32_t* perm;        // sorted position -> row; null: rows are already in expert order
    const i64_t* row_start;   // [E+2] sorted positions of each bucket (bucket E: padding rows)
    const i64_t* tile_start;  // [E+2] m-tile schedule (fwd / bwd-input)
    u64_t* counter;           // dynamic tile counter, 0 at launch
};

template <class S>
__device__ __forceinline__ i64_t row_of(const Problem<S>& p, i64_t pos) { return p.perm ? (i64_t)p.perm[pos] : pos; }

// Next tile for the whole block (integer atomic: which block runs a tile never changes its bits).
__device__ __forceinline__ i64_t next_tile(u64_t* counter, i64_t* slot) {
    __syncthreads();  // the block is done with the previous tile (shared memory, *slot)
    if (threadIdx.x == 0) *slot = (i64_t)atomicAdd(counter, 1ull);
    __syncthreads();
    return *slot;
}

struct MTile { int bucket; i64_t p0, p1, nt; };

// Tile t of the (m-tile, n-tile) grid, rasterised in groups of 8 m-tiles (L2 reuse of w);
// m-tile -> bucket by binary search over tile_start; rows [p0, p1) in sorted positions.
template <class S>
__device__ __forceinline__ MTile decode_mtile(const Problem<S>& p, i64_t t, i64_t n_tiles, int bm) {
    constexpr i64_t GROUP = 8;
    const i64_t m_tiles = p.tile_start[p.E + 1];
    const i64_t per_group = GROUP * n_tiles;
    const i64_t first = (t / per_group) * GROUP;
    const i64_t gsize = min(m_tiles - first, GROUP);
    const i64_t in_group = t % per_group;
    const i64_t mt = first + in_group % gsize;
    MTile r;
    r.nt = in_group / gsize;
    int lo = 0, hi = p.E;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (p.tile_start[mid] <= mt) lo = mid; else hi = mid - 1;
    }
    r.bucket = lo;
    r.p0 = p.row_start[lo] + (mt - p.tile_start[lo]) * bm;
    r.p1 = min(r.p0 + bm, p.row_start[lo + 1]);
    return r;
}

template <class S>
__device__ __forceinline__ i64_t output_size(const Problem<S>& p) {
    if constexpr (S::PASS == FWD) return p.M * p.N;
    else if constexpr (S::PASS == DGRAD) return p.M * p.K;
    else return (i64_t)p.E * p.N * p.K;
}

template <class S>
__device__ void poison(const Problem<S>& p) {
    using OutT = typename S::OutT;
    const OutT nan = from_f32<OutT>(__int_as_float(0x7fc00000));
    const i64_t n = output_size(p);
    for (i64_t i = (i64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64_t)gridDim.x * blockDim.x)
        p.out[i] = nan;
}

// Two adjacent outputs (an accumulator pair) rounded once to the 16-bit output type, packed in 32 bits.
template <class OutT> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<bf16_t>(float lo, float hi) {
    unsigned v;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(v) : "f"(hi), "f"(lo));
    return v;
}
template <> __device__ __forceinline__ unsigned pack2<f16_t>(float lo, float hi) {
    unsigned v;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(v) : "f"(hi), "f"(lo));
    return v;
}
// Two adjacent outputs (tensor-core accumulator pairs), rounded once to the output type, in one store.
template <class OutT>
__device__ __forceinline__ void store2(OutT* p, float lo, float hi) {
    if constexpr (same_type<OutT, float>) *reinterpret_cast<float2*>(p) = make_float2(lo, hi);
    else *reinterpret_cast<unsigned*>(p) = pack2<OutT>(lo, hi);
}

// Padding rows (bucket E) of an m-tile: zeros.
template <class S>
__device__ void zero_rows(const Problem<S>& p, const i64_t* rows, int nrows, i64_t c0, int bn, i64_t cols) {
    using OutT = typename S::OutT;
    const OutT zero = from_f32<OutT>(0.0f);
    for (int i = threadIdx.x; i < nrows * bn; i += blockDim.x) {
        const i64_t c = c0 + i % bn;
        const i64_t r = rows[i / bn];
        if (r >= 0 && c < cols) p.out[r * cols + c] = zero;
    }
}

}  // namespace moe
// ---- end of MoE problem ----------------------------------------------------------------------
