// ---- skuforge s8 / u8 dynamic quantization (templates/quantization/dynamic_int8.cuh) -------
// The dynamic_quantize kernels with s8 / u8 codes (docs/dynamic.md), after
// templates/quantization/dynamic.cuh: the per-element quantize (the static kernel's expression),
// the fused per-token / per-group block kernel and the team kernels' codes, and the one-launch
// per-tensor (<symbol>_coop) and per-channel (<symbol>_chan) kernels with their cooperative-grid
// helpers.
namespace dyn {

// The static quantize's expression, bit for bit: q = clamp(rne(x * inv) + zp), NaN -> zp.
template <typename Q, bool CHECKED, typename M>
__device__ __forceinline__ Q quant(M xv, M inv, const QuantBounds<M>& qb) {
    return to_q<Q>(quant_code_bits<CHECKED>(xv * inv, qb));
}

// The codes of the s8 / u8 kernels (the team kernels' C).
struct IntCodes {
    static constexpr int PACK = 1;             // elements per Q
    static constexpr bool UNCHECKED_PATH = true;
    // One chunk of V elements quantized and stored (V bytes of q).
    template <int V, bool CHECKED = true, typename Q, typename T, typename M>
    static __device__ __forceinline__ void quant_store(Q* p, const Vec<T, V>& b, M inv, const QuantBounds<M>& qb) {
        Vec<Q, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i) o.v[i] = quant<Q, CHECKED>(elem<M>(b, i), inv, qb);
        store_vec<Q, V>(p, o);
    }
};

// -- per-token / per-group: the fused block kernel ------------------------------------------------
// V elements per access (VEC: 16-byte accesses, or 1: any shape and alignment);
// CH > 0: the thread's CH chunks stay in registers (loaded, reduced, then quantized from there);
// CH == 0: loop over the row group, then read it a second time to quantize.
// (Double buffering the next row group was measured slower: twice the data registers halve the
// resident blocks, and more resident warps hide the latency better.)
template <bool ASYM> struct RowGroups {
    template <int V, int CH, typename T, typename Q, typename M>
    static __device__ __forceinline__ void run(
        const T* __restrict__ x, i64_t x_rs, Q* __restrict__ q, i64_t q_rs,
        M* __restrict__ scale, i32_t* __restrict__ zero_point, ParamAt at,
        i64_t vrows, i64_t ngroups, i64_t gs, M eps, int qmin, int qmax, int zp_value, M* smem)
    {
        const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x;
        // `base` is uniform over the block, so every thread reaches the barriers in row_reduce.
        for (i64_t base = (i64_t)blockIdx.x * TY; base < vrows; base += (i64_t)gridDim.x * TY) {
            const i64_t vr = base + threadIdx.y;   // row group index = row * ngroups + group
            const bool live = vr < vrows;
            const i64_t row = vr / ngroups, grp = vr - row * ngroups;
            const T* xr = x + row * x_rs + grp * gs;
            Q* qr = q + row * q_rs + grp * gs;
            Vec<T, V> buf[CH > 0 ? CH : 1];
            Acc<M> a = {(M)0, (M)0};
            if (live) {
                if constexpr (CH > 0) {
#pragma unroll
                    for (int j = 0; j < CH; ++j) {
                        const int c = (j * TX + tx) * V;   // < 512 * 16 * 16: int is enough here
                        if (c < gs) buf[j] = load_vec<T, V>(xr + c);
                    }
#pragma unroll
                    for (int j = 0; j < CH; ++j) {
                        if ((j * TX + tx) * V < gs) {
#pragma unroll
                            for (int i = 0; i < V; ++i) accumulate<ASYM>(a, to_math<M>(buf[j].v[i]));
                        }
                    }
                } else {
                    for (i64_t c = (i64_t)tx * V; c < gs; c += (i64_t)TX * V) {
                        const Vec<T, V> v = load_vec<T, V>(xr + c);
#pragma unroll
                        for (int i = 0; i < V; ++i) accumulate<ASYM>(a, to_math<M>(v.v[i]));
                    }
                }
            }
            if (ASYM) a.lo = row_reduce(a.lo, MinOp<M>(), smem);
            a.hi = row_reduce(a.hi, MaxOp<M>(), smem);
            M s;
            int zp;
            finish<ASYM>(a, eps, qmin, qmax, zp_value, s, zp);
            const M inv = (M)1 / s;                // once per scale element, as the static kernel does
            const QuantBounds<M> qb = quant_bounds<M>(zp, qmin, qmax);
            if (live) {
                if (tx == 0) {
                    scale[at.cell(row, grp)] = s;
                    if (ASYM) zero_point[at.cell(row, grp)] = zp;
                }
                if constexpr (CH > 0) {
#pragma unroll
                    for (int j = 0; j < CH; ++j) {
                        const int c = (j * TX + tx) * V;
                        if (c < gs) IntCodes::quant_store<V>(qr + c, buf[j], inv, qb);
                    }
                } else {
                    for (i64_t c = (i64_t)tx * V; c < gs; c += (i64_t)TX * V) {   // second read: L2
                        IntCodes::quant_store<V>(qr + c, load_vec<T, V>(xr + c), inv, qb);
                    }
                }
            }
        }
    }
};

// The block kernel: x rows x cols (row stride x_rs, last axis contiguous); q rows x cols;
// scale / zero_point rows x (cols / group_size), element (row, group) at row * p_rs + group * p_gs
// (ParamAt). vec_ok: group_size % VEC == 0 and
// 16-byte aligned rows (checked by the launcher), else the scalar path. CHV / CHS: the chunk
// counts compiled for the vector / scalar path (Chunks<...>).
template <bool ASYM, int VEC, class CHV, class CHS, typename T, typename Q, typename M>
__device__ __forceinline__ void fused(
    const T* __restrict__ x, i64_t x_rs, Q* __restrict__ q, i64_t q_rs, M* __restrict__ scale,
    i32_t* __restrict__ zero_point, i64_t p_rs, i64_t p_gs, i64_t rows, i64_t cols, i64_t group_size, M eps,
    int qmin, int qmax, int zp_value, int vec_ok)
{
    __shared__ M smem[16];                     // one slot per warp of a 512-thread block
    const i64_t ngroups = cols / group_size, vrows = rows * ngroups;
    const ParamAt at{p_rs, p_gs};
    const int TX = blockDim.x;
    if (vec_ok) {
        const i64_t per = ((group_size + VEC - 1) / VEC + TX - 1) / TX;   // chunks per thread
        by_chunks<RowGroups<ASYM>, VEC>(CHV(), per, x, x_rs, q, q_rs, scale, zero_point, at, vrows, ngroups, group_size, eps, qmin, qmax, zp_value, smem);
    } else {
        const i64_t per = (group_size + TX - 1) / TX;
        by_chunks<RowGroups<ASYM>, 1>(CHS(), per, x, x_rs, q, q_rs, scale, zero_point, at, vrows, ngroups, group_size, eps, qmin, qmax, zp_value, smem);
    }
}

// Where a team kernel's row group parameters go: (scale, zero point) of docs/numerics.md, stored
// at its place in their layout (ParamAt) by `lead`.
template <bool ASYM, typename M> struct Sink {
    M* scale; i32_t* zero_point; ParamAt at; M eps; int qmin, qmax, zp_value;
    __device__ __forceinline__ M params(const Acc<M>& a, i64_t vr, i64_t ngroups, bool lead, int& zp) const {
        M s;
        finish<ASYM>(a, eps, qmin, qmax, zp_value, s, zp);
        if (lead) {
            const i64_t i = at.row_group(vr, ngroups);
            scale[i] = s;
            if (ASYM) zero_point[i] = zp;
        }
        return s;
    }
};

// -- the one-launch kernels' cooperative-grid helpers ---------------------------------------------
// 16 bytes global -> shared without registers (sm_80+), L2 only (.cg: x is not read again by this SM).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const u32_t s = (u32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Every block of a cooperative launch waits here until all have arrived; `count` is 0 at launch
// (the launcher clears it) and each block adds 1 once.
__device__ __forceinline__ void grid_barrier(u32_t* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();                       // this block's partial result is visible first
        atomicAdd(count, 1u);
        while (*reinterpret_cast<volatile u32_t*>(count) < gridDim.x) asm volatile("nanosleep.u32 100;");
        __threadfence();
    }
    __syncthreads();
}

// -- per-tensor in one cooperative launch (<symbol>_coop) ------------------------------------------
// Every block is resident (cuLaunchCooperativeKernel), so a grid-wide barrier is safe:
// 1. block b reduces its share of x (tiles of 16-byte vectors, grid-stride) to partial[b]; its
//    first tiles are copied to shared memory on the way (cp.async), the rest streams;
// 2. grid barrier;
// 3. every block combines the G partial results in the same fixed order (the same scale in every
//    block, the same bits on every run: no atomics on data), block 0 stores scale / zero point;
// 4. every block quantizes its share: the streamed tiles again from memory, last-read first
//    (they are the ones still in L2), then the kept tiles from shared memory.
// x is read from DRAM once where it fits on chip (about 227 KB per block on an H200) and the
// rest a second time, partly from L2. The quantize expression is the static kernel's.

// Reduces the block's accumulators; every thread gets the result.
template <bool ASYM, typename M>
__device__ __forceinline__ Acc<M> block_acc(Acc<M> a, M* red) {
    if (ASYM) a.lo = block_reduce(a.lo, MinOp<M>(), (M)0, red);
    a.hi = block_reduce(a.hi, MaxOp<M>(), (M)0, red);
    return a;
}

template <bool ASYM, int V, typename T, typename M>
__device__ __forceinline__ void accumulate_vec(Acc<M>& a, const Vec<T, V>& v) {
#pragma unroll
    for (int e = 0; e < V; ++e) accumulate<ASYM>(a, elem<M>(v, e));
}

// The streamed vectors i = from, from + stride, ... < end: U loads issued before any is used
// (a loop with a bound test per vector keeps one 16-byte load in flight per thread: too few bytes
// in flight for DRAM at the 32-register cap of two 1024-thread blocks per SM), then the rest.
template <bool ASYM, int U, int V, typename T, typename M>
__device__ __forceinline__ void reduce_streamed(Acc<M>& a, const T* __restrict__ x, i64_t i, i64_t end, i64_t stride) {
    for (; i + (U - 1) * stride < end; i += U * stride) {
        Vec<T, V> v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = load_vec<T, V>(x + (i + u * stride) * V);
#pragma unroll
        for (int u = 0; u < U; ++u) accumulate_vec<ASYM, V>(a, v[u]);
    }
    for (; i < end; i += stride) accumulate_vec<ASYM, V>(a, load_vec<T, V>(x + i * V));
}

// Quantizes the streamed vectors from `last` down to `first` (stride apart), U loads at a time.
template <int U, int V, typename T, typename Q, typename M>
__device__ __forceinline__ void quantize_streamed(const T* __restrict__ x, Q* __restrict__ q, i64_t last, i64_t first,
                                                  i64_t stride, M inv, const QuantBounds<M>& qb) {
    i64_t i = last;
    for (; i - (U - 1) * stride >= first; i -= U * stride) {
        Vec<T, V> v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = load_vec<T, V>(x + (i - u * stride) * V);
#pragma unroll
        for (int u = 0; u < U; ++u) IntCodes::quant_store<V>(q + (i - u * stride) * V, v[u], inv, qb);
    }
    for (; i >= first; i -= stride) IntCodes::quant_store<V>(q + i * V, load_vec<T, V>(x + i * V), inv, qb);
}

// x, q: n contiguous elements (x 16-byte aligned, q aligned to V bytes); partial: 2 x gridDim.x
// slots (hi, then lo); count: a zeroed counter; kept: keep_tiles x blockDim.x 16-byte vectors of
// dynamic shared memory. Launched cooperatively with at most one wave of blocks.
// The grid sweeps x as a grid-stride loop of tiles (a tile: one vector per thread of a block;
// block b takes tiles b, b + G, ...), so all blocks read one contiguous window at a time (a
// contiguous share per block measured 10-20 % slower: 132 separate streams). A tile is `width`
// threads wide (blockDim.x, or fewer for small x, so that every block gets some of it). A block's
// first keep_tiles tiles (the front of x) stay in shared memory.
// V: elements of a 16-byte vector; U, UQ: streamed vectors in flight per thread (reduce, quantize).
template <bool ASYM, int V, int U, int UQ, typename T, typename Q, typename M>
__device__ __forceinline__ void coop(
    const T* __restrict__ x, Q* __restrict__ q, M* __restrict__ partial, u32_t* __restrict__ count,
    M* __restrict__ scale, i32_t* __restrict__ zero_point, i64_t n, int keep_tiles, int width, M eps,
    int qmin, int qmax, int zp_value)
{
    extern __shared__ uint4 kept[];
    __shared__ M red[32];
    const i64_t G = gridDim.x, NT = width, b = blockIdx.x, nvec = n / V;   // NT <= blockDim.x threads per tile
    const bool on = threadIdx.x < width;
    const i64_t first = on ? b * NT + threadIdx.x : nvec, stride = G * NT;   // this thread's vectors: first + k * stride
    const i64_t streamed = first + (i64_t)keep_tiles * stride;  // ... from here on, not kept
    const bool tail = b == G - 1;              // the n % V last elements, one at a time
    // 1. reduce: copy the kept vectors in flight, stream the others, then reduce the kept ones
    for (int k = 0; k < keep_tiles && first + k * stride < nvec; ++k)
        cp_async16(&kept[k * NT + threadIdx.x], x + (first + k * stride) * V);
    Acc<M> a = {(M)0, (M)0};
    reduce_streamed<ASYM, U, V>(a, x, streamed, nvec, stride);
    if (tail) {
        for (i64_t i = nvec * V + threadIdx.x; i < n; i += blockDim.x) accumulate<ASYM>(a, to_math<M>(x[i]));
    }
    cp_async_wait_all();                       // a thread reads back only the vectors it copied
    for (int k = 0; k < keep_tiles && first + k * stride < nvec; ++k)
        accumulate_vec<ASYM, V>(a, *reinterpret_cast<const Vec<T, V>*>(&kept[k * NT + threadIdx.x]));
    a = block_acc<ASYM>(a, red);
    if (threadIdx.x == 0) {
        partial[b] = a.hi;
        if (ASYM) partial[G + b] = a.lo;
    }
    // 2. all partial results are written
    grid_barrier(count);
    // 3. the tensor's range, combined the same way in every block
    Acc<M> t = {(M)0, (M)0};
    for (i64_t i = threadIdx.x; i < G; i += blockDim.x) {
        t.hi = vmax(t.hi, __ldcg(partial + i));
        if (ASYM) t.lo = vmin(t.lo, __ldcg(partial + G + i));
    }
    t = block_acc<ASYM>(t, red);
    M s;
    int zp;
    finish<ASYM>(t, eps, qmin, qmax, zp_value, s, zp);
    if (b == 0 && threadIdx.x == 0) {
        scale[0] = s;
        if (ASYM) zero_point[0] = zp;
    }
    const M inv = (M)1 / s;                    // as the static quantize kernel does
    const QuantBounds<M> qb = quant_bounds<M>(zp, qmin, qmax);
    // 4. quantize: streamed vectors last-read first (the grid walks back through what L2 still
    //    holds), then the kept ones
    if (tail) {
        for (i64_t i = nvec * V + threadIdx.x; i < n; i += blockDim.x) q[i] = quant<Q, true>(to_math<M>(x[i]), inv, qb);
    }
    if (streamed < nvec) {
        const i64_t last = streamed + (nvec - 1 - streamed) / stride * stride;
        quantize_streamed<UQ, V>(x, q, last, streamed, stride, inv, qb);
    }
    for (int k = 0; k < keep_tiles && first + k * stride < nvec; ++k)
        IntCodes::quant_store<V>(q + (first + k * stride) * V, *reinterpret_cast<const Vec<T, V>*>(&kept[k * NT + threadIdx.x]), inv, qb);
}

// -- per-channel along the last axis in one launch (<symbol>_chan) --------------------------------
// One scale per column; x and q are rows x cols, contiguous. A block is TX x TY threads
// (TX = tx_width column vectors of 16 bytes side by side, TY row strands) and owns column tile
// b % col_tiles and row part p = b / col_tiles of row_parts: the tiles of TY rows p, p + row_parts,
// ... (interleaved: all blocks sweep x from the top together, one window at a time):
// 1. reduce: a thread keeps the running range of its V columns in registers while it walks its
//    rows; its first keep_tiles rows go to shared memory on the way (cp.async), the others
//    stream; the block folds its threads' ranges into shared memory;
// 2. row_parts > 1 (a cooperative launch: every block resident): each block folds its tile's
//    range into the column words `colmax` (zeroed by the launcher), a grid barrier, and every
//    block reads its columns' range back; row_parts == 1: the block's range is the column's;
// 3. every thread derives the scale (and zero point) of its V columns exactly as the two-pass
//    path does; the blocks of row part 0 store them;
// 4. quantize: the streamed rows again, last-read first (the ones L2 still holds), then the kept
//    rows from shared memory, with the static quantize's expression (the grid walks back up
//    through what L2 still holds).
// Ranges travel as the bits of non-negative numbers (max |x|; asymmetric: max(x, 0) and
// 0 - min(x, 0)), whose integer order is their numeric order: integer max folds them, and max
// is exact, so the order of the folds never changes a bit (the same bits on every run).
__device__ __forceinline__ u32_t bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ u64_t bits(double v) { return (u64_t)__double_as_longlong(v); }
__device__ __forceinline__ float from_bits(u32_t b) { return __uint_as_float(b); }
__device__ __forceinline__ double from_bits(u64_t b) { return __longlong_as_double((long long)b); }
constexpr int MAX_TX = 128;                    // column vectors of a tile, at most (the launcher's limit)

template <bool ASYM, int V, typename T, typename M>
__device__ __forceinline__ void accumulate_cols(Acc<M> (&a)[V], const Vec<T, V>& v) {
#pragma unroll
    for (int e = 0; e < V; ++e) accumulate<ASYM>(a[e], elem<M>(v, e));
}

// Folds the ranges of the lanes that share a column vector (lanes tx, tx + TX, ... of a warp, for
// TX < 32), so that one lane per column vector folds into shared memory.
template <typename M>
__device__ __forceinline__ M warp_fold(M v, int tx_width) {
    for (int o = tx_width; o < 32; o <<= 1) v = vmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One vector of V columns quantized, each with its own reciprocal and zero point, and stored.
template <int V, int NZ, typename T, typename Q, typename M>
__device__ __forceinline__ void quant_store_cols(Q* p, const Vec<T, V>& b, const M (&inv)[V], const int (&zp)[NZ],
                                                 int qmin, int qmax) {
    Vec<Q, V> o;
#pragma unroll
    for (int i = 0; i < V; ++i) o.v[i] = quant<Q, true>(elem<M>(b, i), inv[i], quant_bounds<M>(zp[NZ == 1 ? 0 : i], qmin, qmax));
    store_vec<Q, V>(p, o);
}

// x, q: rows x cols contiguous (x 16-byte aligned, cols a multiple of V, q aligned to V codes);
// colmax: cols words (then cols more in asymmetric mode), zeroed, and count, a zeroed counter,
// where row_parts > 1 (then launched cooperatively: col_tiles * row_parts blocks, all resident);
// a thread's rows are first + k * step (step = row_parts x TY rows);
// kept: keep_tiles x blockDim.x 16-byte vectors of dynamic shared memory.
// V: elements of a 16-byte vector; U: streamed vectors in flight per thread.
template <bool ASYM, int V, int U, typename T, typename Q, typename B, typename M>
__device__ __forceinline__ void chan(
    const T* __restrict__ x, Q* __restrict__ q, B* __restrict__ colmax, u32_t* __restrict__ count,
    M* __restrict__ scale, i32_t* __restrict__ zero_point, i64_t rows, i64_t cols, int tx_width,
    int col_tiles, int row_parts, int keep_tiles, M eps, int qmin, int qmax, int zp_value)
{
    constexpr int NZ = ASYM ? V : 1;           // zero points: one per column, or the implied one
    extern __shared__ uint4 kept[];
    __shared__ B fold_hi[V * MAX_TX];          // the block's range, element e of column vector t at e * MAX_TX + t
    __shared__ B fold_lo[ASYM ? V * MAX_TX : 1];
    const int NT = blockDim.x, TY = NT / tx_width, tx = threadIdx.x % tx_width, ty = threadIdx.x / tx_width;
    const i64_t ct = blockIdx.x % col_tiles, rp = blockIdx.x / col_tiles;
    const i64_t cv = ct * tx_width + tx;       // this thread's column vector
    const bool on = cv < cols / V;
    // this thread's rows: first + k * step < rows; the first keep_tiles of them stay in shared memory
    const i64_t step = (i64_t)row_parts * TY, first = rp * TY + ty, streamed = first + (i64_t)keep_tiles * step;
    const T* __restrict__ xc = x + cv * V;
    Q* __restrict__ qc = q + cv * V;
    for (int i = threadIdx.x; i < V * MAX_TX; i += NT) {
        fold_hi[i] = 0;
        if (ASYM) fold_lo[i] = 0;
    }
    // 1. reduce: the kept rows in flight to shared memory, the others streamed, then the kept ones
    if (on) {
        for (int t = 0; t < keep_tiles && first + (i64_t)t * step < rows; ++t)
            cp_async16(&kept[t * NT + threadIdx.x], xc + (first + (i64_t)t * step) * cols);
    }
    Acc<M> a[V];
#pragma unroll
    for (int e = 0; e < V; ++e) a[e] = Acc<M>{(M)0, (M)0};
    if (on) {
        i64_t r = streamed;
        for (; r + (U - 1) * step < rows; r += U * step) {
            Vec<T, V> v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) v[u] = load_vec<T, V>(xc + (r + u * step) * cols);
#pragma unroll
            for (int u = 0; u < U; ++u) accumulate_cols<ASYM, V>(a, v[u]);
        }
        for (; r < rows; r += step) accumulate_cols<ASYM, V>(a, load_vec<T, V>(xc + r * cols));
    }
    cp_async_wait_all();                       // a thread reads back only the vectors it copied
    if (on) {
        for (int t = 0; t < keep_tiles && first + (i64_t)t * step < rows; ++t)
            accumulate_cols<ASYM, V>(a, *reinterpret_cast<const Vec<T, V>*>(&kept[t * NT + threadIdx.x]));
    }
#pragma unroll
    for (int e = 0; e < V; ++e) {              // (every lane: the shuffles take the whole warp)
        a[e].hi = warp_fold(a[e].hi, tx_width);
        if (ASYM) a[e].lo = (M)0 - warp_fold((M)0 - a[e].lo, tx_width);
    }
    __syncthreads();                           // the fold words are zero
    if (on && (threadIdx.x & 31) < tx_width) {
#pragma unroll
        for (int e = 0; e < V; ++e) {          // (+ 0 and 0 - turn a -0 into +0: its bits would be the largest)
            atomicMax(&fold_hi[e * MAX_TX + tx], bits(a[e].hi + (M)0));
            if (ASYM) atomicMax(&fold_lo[e * MAX_TX + tx], bits((M)0 - a[e].lo));
        }
    }
    __syncthreads();
    // 2. the columns' range over every row part
    if (row_parts > 1) {
        for (int i = threadIdx.x; i < V * tx_width; i += NT) {
            const int e = i / tx_width, t = i % tx_width;
            const i64_t col = (ct * tx_width + t) * V + e;
            if (col < cols) {
                atomicMax(&colmax[col], fold_hi[e * MAX_TX + t]);
                if (ASYM) atomicMax(&colmax[cols + col], fold_lo[e * MAX_TX + t]);
            }
        }
        grid_barrier(count);
        for (int i = threadIdx.x; i < V * tx_width; i += NT) {
            const int e = i / tx_width, t = i % tx_width;
            const i64_t col = (ct * tx_width + t) * V + e;
            if (col < cols) {
                fold_hi[e * MAX_TX + t] = __ldcg(&colmax[col]);
                if (ASYM) fold_lo[e * MAX_TX + t] = __ldcg(&colmax[cols + col]);
            }
        }
        __syncthreads();
    }
    // 3. scale and zero point of this thread's V columns
    M inv[V];
    int zp[NZ];
#pragma unroll
    for (int e = 0; e < V; ++e) {
        const Acc<M> c = {ASYM ? (M)0 - from_bits(fold_lo[e * MAX_TX + tx]) : (M)0, from_bits(fold_hi[e * MAX_TX + tx])};
        M s;
        int z;
        finish<ASYM>(c, eps, qmin, qmax, zp_value, s, z);
        inv[e] = (M)1 / s;                     // as the static quantize kernel does
        zp[ASYM ? e : 0] = z;
        if (on && rp == 0 && ty == 0) {
            scale[cv * V + e] = s;
            if (ASYM) zero_point[cv * V + e] = z;
        }
    }
    if (!on) return;
    // 4. quantize: the streamed rows from the last one back, then the kept rows
    if (streamed < rows) {
        i64_t r = streamed + (rows - 1 - streamed) / step * step;
        for (; r - (U - 1) * step >= streamed; r -= U * step) {
            Vec<T, V> v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) v[u] = load_vec<T, V>(xc + (r - u * step) * cols);
#pragma unroll
            for (int u = 0; u < U; ++u) quant_store_cols<V, NZ>(qc + (r - u * step) * cols, v[u], inv, zp, qmin, qmax);
        }
        for (; r >= streamed; r -= step) quant_store_cols<V, NZ>(qc + r * cols, load_vec<T, V>(xc + r * cols), inv, zp, qmin, qmax);
    }
    for (int t = 0; t < keep_tiles && first + (i64_t)t * step < rows; ++t)
        quant_store_cols<V, NZ>(qc + (first + (i64_t)t * step) * cols,
                                *reinterpret_cast<const Vec<T, V>*>(&kept[t * NT + threadIdx.x]), inv, zp, qmin, qmax);
}

}  // namespace dyn
// ---- end of s8 / u8 dynamic quantization kernels --------------------------------------------
