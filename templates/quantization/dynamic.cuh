// ---- skuforge dynamic quantization (templates/quantization/dynamic.cuh) ---------------------
// What the s8/u8 and the low-bit dynamic_quantize kernels share (docs/dynamic.md): the element math
// (NaN-ignoring min / max, the running reduction, the (scale, zero point) formulas of
// docs/numerics.md), the deterministic two-phase per-tensor / per-channel reduction, the row
// reduction of the fused block kernels and the fused team kernels. Everything is a template over
// the SKU's types: T (x), Q (q), M (math precision), ASYM (asymmetric mode); a team kernel also
// takes its codes C (how a chunk of x becomes q: templates/quantization/dynamic_int8.cuh,
// lowbit_dynamic.cuh) and its Sink (where a row group's scale / zero point go).
namespace dyn {

// -- element math ----------------------------------------------------------------------------------
// Element i of a chunk in the math precision (a bf16 pair of an even-length chunk is one 32-bit
// word: a shift or a mask; a one-element chunk is 2 bytes, read as such).
template <typename M, typename T, int V>
__device__ __forceinline__ M elem(const Vec<T, V>& b, int i) {
    if constexpr (same_type<T, bf16_t> && V % 2 == 0) {
        const u32_t w = reinterpret_cast<const u32_t*>(&b)[i >> 1];
        return __uint_as_float(i & 1 ? w & 0xffff0000u : w << 16);
    } else {
        return to_math<M>(b.v[i]);
    }
}
template <typename M> struct MaxOp { __device__ __forceinline__ M operator()(M a, M b) const { return vmax(a, b); } };
template <typename M> struct MinOp { __device__ __forceinline__ M operator()(M a, M b) const { return vmin(a, b); } };

// Running reduction of one slice. Symmetric: hi = max |x|. Asymmetric: lo = min(x, 0),
// hi = max(x, 0). Starting from 0 is exactly the "min(min x, 0)" of docs/numerics.md; min and max are
// exact, so any combination order gives the same bits.
// SEE_NAN: NaN-propagating min / max (the team kernels' first pass: a NaN anywhere in the slice
// shows in the result, and only then is the slice reduced again ignoring NaN).
template <typename M> struct Acc { M lo, hi; };
template <bool SEE_NAN = false, typename M> __device__ __forceinline__ M acc_max(M a, M b) { return SEE_NAN ? vmax_nan(a, b) : vmax(a, b); }
template <bool SEE_NAN = false, typename M> __device__ __forceinline__ M acc_min(M a, M b) { return SEE_NAN ? vmin_nan(a, b) : vmin(a, b); }
template <bool ASYM, bool SEE_NAN = false, typename M>
__device__ __forceinline__ void accumulate(Acc<M>& a, M v) {
    if (ASYM) { a.lo = acc_min<SEE_NAN>(a.lo, v); a.hi = acc_max<SEE_NAN>(a.hi, v); }
    else      { a.hi = acc_max<SEE_NAN>(a.hi, vabs(v)); }
}

// (scale, zero point) of one slice, docs/numerics.md, in the math precision (--fmad=false: no fused ops).
template <bool ASYM, typename M>
__device__ __forceinline__ void finish(const Acc<M>& a, M eps, int qmin, int qmax, int zp_value, M& s, int& zp) {
    if (ASYM) {
        s = vmax((a.hi - a.lo) / (M)(qmax - qmin), eps);
        const M z = (M)qmin - rne(a.lo / s);
        zp = (int)vmax(vmin(z, (M)qmax), (M)qmin);   // NaN (only from min x = -inf) -> qmax
    } else {
        s = vmax(a.hi, eps) / (M)(qmax - zp_value);
        zp = zp_value;
    }
}

// -- per-tensor / per-channel: the deterministic two-phase reduction -----------------------------
// phase 0: every block reduces work items (a slice part) to partial[] (no atomics);
// phase 1: one warp per scale element combines its parts in a fixed order and writes the
//          scale (and zero point).
// The runtime then runs the static quantize kernel with these scales (same bits by
// construction). Blocks are 1-D (256 threads) seen as TX x TY with TX = tx_width.
// partial layout (n = slots * parts; asymmetric keeps lo at partial[n + i]):
//   slices (tensor: one slice; channel on a leading axis): partial[slot * parts + part]
//   columns (channel on the last axis):                    partial[part * cols + col]

// Slices: channel c owns rows (s / inner) * count * inner + c * inner + s % inner, s < rows / count
// (tensor: count = inner = 1). A part is a block of sub-rows x a chunk of columns.
template <bool ASYM, int V, typename T, typename M>
__device__ __forceinline__ void reduce_slices(
    const T* __restrict__ x, i64_t x_rs, M* __restrict__ partial, i64_t rows, i64_t cols,
    i64_t inner, i64_t count, i64_t row_parts, i64_t col_chunk, int TX, M* smem)
{
    const int TY = blockDim.x / TX, tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    const i64_t sub = rows / count;
    const i64_t col_parts = (cols + col_chunk - 1) / col_chunk;
    const i64_t parts = row_parts * col_parts, items = count * parts;
    for (i64_t it = blockIdx.x; it < items; it += gridDim.x) {
        // Walk the items backwards: the quantize pass that follows starts at row 0, which this
        // pass read last and is still in L2.
        const i64_t w = items - 1 - it;
        const i64_t c = w / parts, part = w - c * parts;
        const i64_t rp = part / col_parts, cp = part - rp * col_parts;
        const i64_t r0 = sub * rp / row_parts, r1 = sub * (rp + 1) / row_parts;
        const i64_t c0 = cp * col_chunk, c1 = c0 + col_chunk < cols ? c0 + col_chunk : cols;
        Acc<M> a = {(M)0, (M)0};
        for (i64_t s = r0 + ty; s < r1; s += TY) {
            const i64_t row = (s / inner) * count * inner + c * inner + s % inner;
            const T* xr = x + row * x_rs;
#pragma unroll 4
            for (i64_t col = c0 + (i64_t)tx * V; col < c1; col += (i64_t)TX * V) {
                const Vec<T, V> v = load_vec<T, V>(xr + col);
#pragma unroll
                for (int i = 0; i < V; ++i) accumulate<ASYM>(a, to_math<M>(v.v[i]));
            }
        }
        if (ASYM) a.lo = block_reduce(a.lo, MinOp<M>(), (M)0, smem);
        a.hi = block_reduce(a.hi, MaxOp<M>(), (M)0, smem);
        if (threadIdx.x == 0) {
            partial[w] = a.hi;
            if (ASYM) partial[items + w] = a.lo;
        }
    }
}

// Flat (tensor scope, contiguous x, vector path): block b reduces the vectors b * 256 + t +
// k * gridDim.x * 256 of the whole tensor, walking backwards, into partial[b]: a plain stream.
template <bool ASYM, int V, typename T, typename M>
__device__ __forceinline__ void reduce_flat(const T* __restrict__ x, M* __restrict__ partial, i64_t n, M* smem)
{
    const i64_t nvec = n / V, step = (i64_t)gridDim.x * blockDim.x;
    Acc<M> a = {(M)0, (M)0};
#pragma unroll 4
    for (i64_t i = (i64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += step) {
        const Vec<T, V> v = load_vec<T, V>(x + (nvec - 1 - i) * V);
#pragma unroll
        for (int e = 0; e < V; ++e) accumulate<ASYM>(a, to_math<M>(v.v[e]));
    }
    if (ASYM) a.lo = block_reduce(a.lo, MinOp<M>(), (M)0, smem);
    a.hi = block_reduce(a.hi, MaxOp<M>(), (M)0, smem);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = a.hi;
        if (ASYM) partial[gridDim.x + blockIdx.x] = a.lo;
    }
}

// Columns (channel on the last axis): a thread owns V adjacent columns of a tile of TX * V and
// walks the part's rows with stride TY; the TY partial results are combined in a fixed order.
template <bool ASYM, int V, typename T, typename M>
__device__ __forceinline__ void reduce_columns(
    const T* __restrict__ x, i64_t x_rs, M* __restrict__ partial, i64_t rows, i64_t cols,
    i64_t row_parts, int TX, M (*red)[256])
{
    const int TY = blockDim.x / TX, tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    const i64_t tiles = (cols + (i64_t)TX * V - 1) / ((i64_t)TX * V);
    const i64_t items = row_parts * tiles, n = row_parts * cols;
    for (i64_t it = blockIdx.x; it < items; it += gridDim.x) {
        const i64_t w = items - 1 - it;        // backwards, as in reduce_slices
        const i64_t rp = w / tiles, tile = w - rp * tiles;
        const i64_t r0 = rows * rp / row_parts, r1 = rows * (rp + 1) / row_parts;
        const i64_t col0 = (tile * TX + tx) * V;
        Acc<M> a[V];
#pragma unroll
        for (int i = 0; i < V; ++i) a[i] = Acc<M>{(M)0, (M)0};
        if (col0 < cols) {
#pragma unroll 4
            for (i64_t r = r0 + ty; r < r1; r += TY) {
                const Vec<T, V> v = load_vec<T, V>(x + r * x_rs + col0);
#pragma unroll
                for (int i = 0; i < V; ++i) accumulate<ASYM>(a[i], to_math<M>(v.v[i]));
            }
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
            __syncthreads();
            red[0][threadIdx.x] = a[i].hi;
            red[1][threadIdx.x] = a[i].lo;
            __syncthreads();
            if (ty == 0 && col0 + i < cols) {
                Acc<M> r = a[i];
                for (int j = 1; j < TY; ++j) {     // fixed order over the TY row strands
                    r.hi = vmax(r.hi, red[0][j * TX + tx]);
                    if (ASYM) r.lo = vmin(r.lo, red[1][j * TX + tx]);
                }
                partial[rp * cols + col0 + i] = r.hi;
                if (ASYM) partial[n + rp * cols + col0 + i] = r.lo;
            }
        }
    }
}

// The two-phase kernel (the entry point's parameters; RVEC: elements of a 16-byte access of x).
// phase 0: x (rows x cols, row stride x_rs) -> partial; phase 1: partial -> scale, zero_point.
// Tensor scope: chan_count = chan_inner = 1, chan_last = 0 (flat = 1: contiguous x, vector path).
// Launched with 1-D blocks of 256.
template <bool ASYM, int RVEC, typename T, typename M>
__device__ __forceinline__ void reduce(
    const T* __restrict__ x, i64_t x_rs, M* __restrict__ partial, M* __restrict__ scale, i32_t* __restrict__ zero_point,
    i64_t rows, i64_t cols, i64_t chan_inner, i64_t chan_count, int chan_last, i64_t row_parts, i64_t col_chunk,
    int tx_width, M eps, int qmin, int qmax, int zp_value, int vec_ok, int flat, int phase)
{
    __shared__ M red[2][256];
    if (phase == 0) {
        if (flat) {                            // launched with gridDim.x == row_parts, col_chunk == cols
            reduce_flat<ASYM, RVEC>(x, partial, rows * cols, red[0]);
        } else if (chan_last) {
            if (vec_ok) reduce_columns<ASYM, RVEC>(x, x_rs, partial, rows, cols, row_parts, tx_width, red);
            else        reduce_columns<ASYM, 1>(x, x_rs, partial, rows, cols, row_parts, tx_width, red);
        } else {
            if (vec_ok) reduce_slices<ASYM, RVEC>(x, x_rs, partial, rows, cols, chan_inner, chan_count, row_parts, col_chunk, tx_width, red[0]);
            else        reduce_slices<ASYM, 1>(x, x_rs, partial, rows, cols, chan_inner, chan_count, row_parts, col_chunk, tx_width, red[0]);
        }
        return;
    }
    // phase 1: one warp per scale element; its lanes stride over the parts, then a fixed tree.
    const i64_t slots = chan_last ? cols : chan_count;
    const i64_t parts = chan_last ? row_parts : row_parts * ((cols + col_chunk - 1) / col_chunk);
    const i64_t n = slots * parts;
    const int lane = threadIdx.x & 31;
    const i64_t warps = (i64_t)gridDim.x * (blockDim.x >> 5);
    for (i64_t slot = ((i64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; slot < slots; slot += warps) {
        Acc<M> a = {(M)0, (M)0};
        for (i64_t p = lane; p < parts; p += 32) {
            const i64_t i = chan_last ? p * slots + slot : slot * parts + p;
            a.hi = vmax(a.hi, partial[i]);
            if (ASYM) a.lo = vmin(a.lo, partial[n + i]);
        }
        a.hi = warp_reduce(a.hi, MaxOp<M>());
        if (ASYM) a.lo = warp_reduce(a.lo, MinOp<M>());
        M s;
        int zp;
        finish<ASYM>(a, eps, qmin, qmax, zp_value, s, zp);
        if (lane == 0) {
            scale[slot] = s;
            if (ASYM) zero_point[slot] = zp;
        }
    }
}

// -- per-token / per-group: the fused block kernels ----------------------------------------------
// A "row group" is one scale element: a row (token) or one group of a row (group; token is the
// case group_size == cols). Block = (TX, TY): TX threads share a row group, TY row groups per block;
// the grid strides over row groups (no grid limit, 64-bit indices). Each thread loads its CH chunks
// of V elements into registers, the row group is reduced (shuffles, then shared memory across
// warps), and the same registers are quantized and stored. Row groups longer than TX * V * CH_max
// take the CH == 0 path: a second read that is served from L2 for rows that fit there.

// Reduces v over the TX threads of this row group; every one of them gets the result.
template <typename M, typename Op>
__device__ __forceinline__ M row_reduce(M v, Op op, M* smem) {
    const int TX = blockDim.x;
    const int width = TX < 32 ? TX : 32;    // TX is a power of two: segments never straddle a warp
    for (int o = width >> 1; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (TX > 32) {                          // uniform over the block
        const int per_row = TX >> 5, base = threadIdx.y * per_row;
        __syncthreads();                    // smem is free again
        if ((threadIdx.x & 31) == 0) smem[base + (threadIdx.x >> 5)] = v;
        __syncthreads();
        v = smem[base];
        for (int i = 1; i < per_row; ++i) v = op(v, smem[base + i]);   // fixed order
    }
    return v;
}

// The chunk counts CH a block kernel is compiled for (the SKU's ch_vec / ch_scalar), ascending.
template <int... CH> struct Chunks {};
// R::run<V, CH>(args...) with the first CH of the list that holds per <= CH chunks per thread,
// else with CH = 0 (a loop over the row group, read twice).
template <class R, int V, int CH, int... MORE, typename... A>
__device__ __forceinline__ void by_chunks(Chunks<CH, MORE...>, i64_t per, A... args) {
    if (per <= CH) R::template run<V, CH>(args...);
    else by_chunks<R, V>(Chunks<MORE...>(), per, args...);
}
template <class R, int V, typename... A>
__device__ __forceinline__ void by_chunks(Chunks<>, i64_t, A... args) { R::template run<V, 0>(args...); }

// -- per-token / per-group: the team kernels -----------------------------------------------------
// One entry point `<symbol>_t<P>` per chunk budget P (16-byte chunks of x per thread, held in
// registers), and fixed-TX ones `<symbol>_t<P>_tx<TX>` (docs/dynamic.md). Parameters: those of the
// block kernel with vec_ok replaced by tx (threads per row group, a power of two <= 512), ch (chunks
// per thread and row group: P or P / 2), dense (rows of x and q contiguous) and ngroups
// (cols / group_size). The launcher only picks them on the vector path (group_size % VEC == 0,
// aligned rows). C, the codes: C::PACK (elements per Q), C::UNCHECKED_PATH (integer codes have an
// unchecked quantize path, no clamp and no NaN test, for row groups that allow it; fp8 codes do not:
// the conversion saturates and keeps NaN itself, so their kernels keep one path), and
// C::quant_store<V, CHECKED>(q, chunk, inv, bounds).

// log2 of a power of two, at compile time
__device__ constexpr int ilog2(int v) { return v > 1 ? 1 + ilog2(v >> 1) : 0; }
// Named barrier of the TX threads (TX / 32 whole warps) of team `id` (ids 1.., 0 is __syncthreads).
__device__ __forceinline__ void team_barrier(int id, int threads) {
    asm volatile("barrier.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// Reduces `a` over the TX threads of a row group; every one of them gets the result. TX <= 32:
// shuffles inside aligned lane segments. TX > 32: then shared memory `xch` across the team's
// TX / 32 warps, behind the team's own barrier (no block-wide barrier); `parity` alternates the
// slots, so one barrier per exchange is enough.
template <bool ASYM, bool SEE_NAN, typename M>
__device__ __forceinline__ void team_reduce(Acc<M>& a, int TX, M (*xch)[2][16], int& parity) {
    const int width = TX < 32 ? TX : 32;
    for (int o = width >> 1; o > 0; o >>= 1) {
        if (ASYM) a.lo = acc_min<SEE_NAN>(a.lo, __shfl_xor_sync(0xffffffffu, a.lo, o));
        a.hi = acc_max<SEE_NAN>(a.hi, __shfl_xor_sync(0xffffffffu, a.hi, o));
    }
    if (TX > 32) {
        const int nw = TX >> 5, team = threadIdx.x / TX, first = team * nw;
        if ((threadIdx.x & 31) == 0) {
            xch[parity][0][threadIdx.x >> 5] = a.lo;
            xch[parity][1][threadIdx.x >> 5] = a.hi;
        }
        team_barrier(1 + team, TX);
        for (int i = 0; i < nw; ++i) {          // fixed order (min / max are exact anyway)
            if (ASYM) a.lo = acc_min<SEE_NAN>(a.lo, xch[parity][0][first + i]);
            a.hi = acc_max<SEE_NAN>(a.hi, xch[parity][1][first + i]);
        }
        parity ^= 1;
    }
}

// The range of a thread's CH chunks of one row group (zeros past its end change nothing);
// SEE_NAN: NaN-propagating (the first pass), else NaN-ignoring.
template <bool ASYM, bool SEE_NAN, typename M, typename T, int V, int CH>
__device__ __forceinline__ Acc<M> chunks_range(const Vec<T, V> (&b)[CH], bool live) {
    Acc<M> a = {(M)0, (M)0};
#if __CUDA_ARCH__ >= 900
    if constexpr (!ASYM && (same_type<T, bf16_t> || same_type<T, f16_t>)) {
        // Symmetric 16-bit floats, first pass: max |x| on the bit patterns, two elements per
        // instruction (sm_90 has a 16x2 integer max). With the sign bit cleared, the unsigned order of
        // a bf16 / f16 bit pattern is the order of |x|, and every NaN pattern lies above infinity, so
        // the result is max |x| exactly, or a NaN when the slice holds one (what the NaN-propagating
        // max gives); starting from 0 as the float reduction does.
        if (SEE_NAN) {
            u32_t m = 0;
            if (live) {
#pragma unroll
                for (int j = 0; j < CH; ++j) {
#pragma unroll
                    for (int w = 0; w < V / 2; ++w) m = __vmaxu2(m, reinterpret_cast<const u32_t*>(&b[j])[w] & 0x7fff7fffu);
                }
            }
            const u32_t h = max(m & 0xffffu, m >> 16);
            if constexpr (same_type<T, bf16_t>) {
                a.hi = __uint_as_float(h << 16);
            } else {
                f16_t hv;
                hv.bits = (unsigned short)h;
                a.hi = to_f32(hv);
            }
            return a;
        }
    }
#endif
    if (live) {
#pragma unroll
        for (int j = 0; j < CH; ++j) {
#pragma unroll
            for (int i = 0; i < V; ++i) accumulate<ASYM, SEE_NAN>(a, elem<M>(b[j], i));
        }
    }
    return a;
}

// Quantizes and stores a thread's first nch chunks of one row group, `step` codes apart in q;
// CHECKED = false: the unchecked path (quant_code_bits).
template <class C, bool CHECKED, typename Q, typename T, typename M, int V, int CH>
__device__ __forceinline__ void store_chunks(Q* p, const Vec<T, V> (&b)[CH], int nch, int step, M inv,
                                             const QuantBounds<M>& qb) {
#pragma unroll
    for (int j = 0; j < CH; ++j, p += step) {
        if (j < nch) C::template quant_store<V, CHECKED>(p, b[j], inv, qb);
    }
}

// Where row group vr = row * ngroups + group keeps its parameters (scale, zero point, e8m0 code):
// element row * rs + group * gs of their arrays. Row-major (rs = ngroups, gs = 1): vr itself;
// column-major, "MN-major" (rs = 1, gs = the column stride, rows or more): row + group * gs. The
// team kernels take a column-major layout only below 2^31 row groups (the launcher's rule): a
// 32-bit division, once per row group and only in its lead thread.
struct ParamAt {
    i64_t rs, gs;
    __device__ __forceinline__ i64_t cell(i64_t row, i64_t grp) const { return row * rs + grp * gs; }
    __device__ __forceinline__ i64_t row_group(i64_t vr, i64_t ngroups) const {
        if (gs == 1 && rs == ngroups) return vr;
        const u32_t row = (u32_t)vr / (u32_t)ngroups;
        return (i64_t)row * rs + (vr - (i64_t)row * ngroups) * gs;
    }
};

// Element offset of row group vr (= row * ngroups + group) in a rows x cols array of row stride
// rs; g = the group's length in that array. dense (rows contiguous): no division; else a 32-bit
// one (the launcher keeps row groups below 2^31 here: a 64-bit division is a call that costs
// registers even when it is not taken).
__device__ __forceinline__ i64_t row_group_offset(i64_t vr, i64_t ngroups, i64_t g, i64_t rs, bool dense) {
    if (dense) return vr * g;
    const u32_t row = (u32_t)vr / (u32_t)ngroups;
    return (i64_t)row * rs + (vr - (i64_t)row * ngroups) * g;
}

// A unit (one warp when TX <= 32, else one team of TX / 32 warps) takes S * RG consecutive row
// groups per step: S = 32 / TX side by side in the warp (TX <= 32), RG one after the other in each
// thread (RG > 1: dense rows only). A thread holds CH chunks of V elements of each of its RG row
// groups in registers (CH * RG = P chunks, all loaded before any is used), so x is read once;
// chunk j of a row group starts at element (j * TX + tx) * V. No block barrier; the grid strides
// over units. Addresses and row-group indices advance by steps and chunks are guarded by j < nch,
// a count per thread (per-chunk or per-row-group offsets would be loop invariants or common
// subexpressions that the compiler keeps in registers); chunks past the row group hold zeros,
// which change no reduction (it starts from 0), so the reduction needs no guard.
// TXC: TX as a compile-time constant (0: TX = tx_n, known at run time only). With it the shuffle
// loop unrolls, the TX > 32 branch and the lane arithmetic fold away, and the steps of the RG row
// groups interleave (the fixed-TX entry points, for short row groups: 8-10 instructions per
// element, about a third of them per row group, where this matters most).
template <class C, bool ASYM, int V, int CH, int RG, int TXC, typename T, typename Q, typename M, class Sink>
__device__ __forceinline__ void team_row_groups(
    const T* __restrict__ x, i64_t x_rs, Q* __restrict__ q, i64_t q_rs, const Sink& sink,
    i64_t vrows, i64_t ngroups, i64_t gs, int tx_n, bool dense, M (*xch)[2][16])
{
    constexpr int PACK = C::PACK;
    constexpr bool UNCHECKED_PATH = C::UNCHECKED_PATH;
    static_assert(sizeof(Vec<T, V>) == 16, "a chunk is 16 bytes");
    static_assert(TXC == 0 || (TXC & (TXC - 1)) == 0, "TX is a power of two");
    const int TX = TXC ? TXC : tx_n;
    const int tx = threadIdx.x & (TX - 1), ltx = TXC ? ilog2(TXC) : __ffs(TX) - 1;
    const int S = TX < 32 ? 32 >> ltx : 1, slice = TX < 32 ? (threadIdx.x & 31) >> ltx : 0;
    const int lspan = TX < 32 ? 5 : ltx;                     // log2 of the threads of a unit
    const i64_t per = (i64_t)S * RG;                         // row groups of a unit per step
    const i64_t stride = (i64_t)gridDim.x * (blockDim.x >> lspan) * per;
    const int step = TX * V;                                 // elements between a thread's chunks
    // its chunks in a row group (gs < 2^31 here); step is a power of two: a shift, not a division
    // (a division here sat on every thread's path to its first load: latency at small sizes)
    const int nch = min(CH, ((int)gs - tx * V + step - 1) >> (__ffs(step) - 1));
    const i64_t gsq = gs / PACK;                             // a row group's length in q
    int parity = 0;
#pragma unroll 1
    for (i64_t first = ((i64_t)blockIdx.x * (blockDim.x >> lspan) + (threadIdx.x >> lspan)) * per + slice;
         first - slice < vrows; first += stride) {
        Vec<T, V> buf[RG][CH];
        {
            const T* xr = x + row_group_offset(first, ngroups, gs, x_rs, dense) + tx * V;
            i64_t vr = first;
#pragma unroll
            for (int r = 0; r < RG; ++r, vr += S, xr += S * gs) {
                if (vr < vrows) {
                    const T* p = xr;
#pragma unroll
                    for (int j = 0; j < CH; ++j, p += step) {   // zeros past the row group
                        uint4 w = make_uint4(0u, 0u, 0u, 0u);
                        if (j < nch) w = __ldg(reinterpret_cast<const uint4*>(p));
                        buf[r][j] = *reinterpret_cast<const Vec<T, V>*>(&w);
                    }
                }
            }
        }
        // G row groups at a time: their reductions, one NaN vote, their scales and reciprocals,
        // one clamp-free test and their stores run side by side (one dependent chain per step:
        // the shuffles and divisions of one hide the latency of the other's). G = RG in the
        // fixed-TX entry points; 1 in the run-time-TX ones, where RG side by side made ptxas spill
        // 8 bytes at the low-bit SKUs' t8 cap.
        constexpr int G = TXC && !ASYM ? RG : 1;
        Q* qr = q + row_group_offset(first, ngroups, gsq, q_rs, dense) + tx * V / PACK;
        i64_t vr = first;
#pragma unroll
        for (int r0 = 0; r0 < RG; r0 += G, vr += G * S) {
            Acc<M> a[G];
#pragma unroll
            for (int g = 0; g < G; ++g) a[g] = chunks_range<ASYM, UNCHECKED_PATH, M>(buf[r0 + g], vr + g * S < vrows);
#pragma unroll
            for (int g = 0; g < G; ++g) team_reduce<ASYM, UNCHECKED_PATH>(a[g], TX, xch, parity);
            // A NaN in one of them (rare): reduce them again ignoring NaN, as docs/numerics.md says (without
            // NaN both reductions give the same bits). Uniform per warp (the shuffles need every
            // lane) and per team (its barrier needs every warp).
            bool nan_here = false;
#pragma unroll
            for (int g = 0; g < G; ++g) nan_here = nan_here || is_nan(a[g].hi) || (ASYM && is_nan(a[g].lo));
            const bool nan_seen = UNCHECKED_PATH && __any_sync(0xffffffffu, nan_here);
            if (nan_seen) {
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    a[g] = chunks_range<ASYM, false, M>(buf[r0 + g], vr + g * S < vrows);
                    team_reduce<ASYM, false>(a[g], TX, xch, parity);
                }
            }
            M inv[G];
            QuantBounds<M> qb[G];
            // the row groups' ranges are known: when they hold no NaN and map inside [qmin, qmax]
            // (always, but for non-finite scales), the per-element clamp and NaN test are left out
            // (a row group past the end has the range [0, 0]: it takes no part)
            bool fast = UNCHECKED_PATH && !nan_seen;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                int zp;
                const M s = sink.params(a[g], vr + g * S, ngroups, vr + g * S < vrows && tx == 0, zp);
                inv[g] = (M)1 / s;             // once per scale element, as the static kernel does
                qb[g] = quant_bounds<M>(zp, sink.qmin, sink.qmax);
                fast = fast && clamp_free(ASYM ? a[g].lo : -a[g].hi, a[g].hi, inv[g], qb[g]);
            }
#pragma unroll
            for (int g = 0; g < G; ++g, qr += S * gsq) {
                if (vr + g * S < vrows) {
                    if (fast) store_chunks<C, false>(qr, buf[r0 + g], nch, step / PACK, inv[g], qb[g]);
                    else      store_chunks<C, true>(qr, buf[r0 + g], nch, step / PACK, inv[g], qb[g]);
                }
            }
        }
    }
}

// The body of a team entry point with chunk budget P. TXC = 0: TX = tx at run time, and ch (P or
// P / 2: one row group per thread, or two) picks the instance; TXC > 0: TX = TXC and ch = CHC fixed
// at compile time.
template <class C, bool ASYM, int V, int P, int TXC = 0, int CHC = P, typename T, typename Q, class Sink>
__device__ __forceinline__ void team(
    const T* __restrict__ x, i64_t x_rs, Q* __restrict__ q, i64_t q_rs, const Sink& sink,
    i64_t rows, i64_t ngroups, i64_t group_size, int tx, int ch, int dense)
{
    typedef decltype(Sink::eps) M;             // the math precision
    __shared__ M xch[2][2][16];                // [parity][lo, hi][warp of a 512-thread block]
    const i64_t vrows = rows * ngroups;        // ngroups = cols / group_size, from the launcher (no division here)
    if constexpr (TXC == 0) {
        switch (ch) {
        case P: team_row_groups<C, ASYM, V, P, 1, 0>(x, x_rs, q, q_rs, sink, vrows, ngroups, group_size, tx, dense != 0, xch); break;
        case P / 2: team_row_groups<C, ASYM, V, P / 2, 2, 0>(x, x_rs, q, q_rs, sink, vrows, ngroups, group_size, tx, dense != 0, xch); break;
        default: break;
        }
    } else {
        (void)tx; (void)ch;
        team_row_groups<C, ASYM, V, CHC, P / CHC, TXC>(x, x_rs, q, q_rs, sink, vrows, ngroups, group_size, TXC, dense != 0, xch);
    }
}

}  // namespace dyn
// ---- end of dynamic quantization helpers ----------------------------------------------------
