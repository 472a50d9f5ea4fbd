// ---- skuforge static elementwise quantization (templates/quantization/elementwise.cuh) -------
// The skeleton shared by every static (elementwise) quantization op: quantize, dequantize, the
// straight-through backward passes and fake_quantize. An entry point calls
// ew::elementwise<Op, scope, asymmetric, layout, VEC, U, BAD_SCALE, BAD_ZP>(in0, in1, out0, out1,
// its quantization parameters...): Op is one of the per-element bodies at the end of this file, the
// streams are its input and output arrays (None for an unused slot), BAD_SCALE / BAD_ZP the codes it
// writes to the status word (runtime/status.py) for an invalid scale / zero point.
// A kernel walks a rows x cols view: rows may be strided, the last axis is contiguous.
// Threads: blockDim = (TX, TY); threadIdx.y picks a row, threadIdx.x walks its columns.
// The grid strides over rows (x) and, in the columns layout, over column blocks (y), so any
// shape works with any grid size.
// Two vector layouts (the launcher picks the grid for each):
// - rows (tensor, token, channel on another axis than the last): a thread takes U column
//   vectors of one row; one scale per row; one block per TY rows.
// - columns (group, channel on the last axis): a thread owns one column vector and walks the
//   rows, U rows per step, so what depends only on the column (the group, per-column
//   parameters and their reciprocals) is computed once per column, not once per row; the
//   grid is persistent. Group sizes that are not a multiple of VEC take the scalar path.
// - row vectors (group, channel on the last axis; the dequantize ops, which take no reciprocal): the
//   rows layout with each vector's own parameters (its group's, or its VEC per-column ones) loaded
//   with its data; a schedule variant beside the columns layout (docs/tuning.md).
// The channel scope has two entry points, each with the registers its own layout needs: the SKU's
// symbol (axis = last, columns layout) and the symbol + "_rows" (another axis, rows layout); the
// row-vectors layout is a further entry point, symbol + "_vrows".
// The per-element body (Op::apply) sees an Elem: `s` (scale), `inv` (1/scale, computed once per
// scale element), `zp` (zero point), `bad` (the scale element failed its device-side check: the
// body writes its op's poison), `qlo`/`qhi` (qmin/qmax in the math precision) and `qmin`/`qmax`;
// then the elements of its input streams and references to those of its output streams.
namespace ew {

enum Layout { ROWS, COLUMNS, ROW_VECTORS };

// The kernel parameters every static elementwise entry point takes (codegen: the elementwise ABI).
// status: this device's status word (runtime/status.py), or null (no value checks).
template <typename M> struct Params {
    const M* scale; M scale_value; const i32_t* zero_point; int zp_value;
    i64_t rows, cols, group_size, chan_inner, chan_count;
    int chan_last, qmin, qmax, vec_ok;
    u32_t* status;
};

// What the per-element body sees of its scale element.
// `bad` is a bool, or Known<false> / Known<true> where the skeleton knows it at compile time (the
// deferred and unswitched paths): there the op's poison selects fold away in the front end.
template <bool V> struct Known { __device__ constexpr operator bool() const { return V; } };
template <typename M, typename B = bool> struct Elem { M s, inv; int zp; B bad; M qlo, qhi; int qmin, qmax; };
// bad_u && bad: a step's flag (known, or f64: a bool) and one scale element's check, read in place.
__device__ __forceinline__ Known<false> both(Known<false>, bool) { return {}; }
__device__ __forceinline__ const bool& both(Known<true>, const bool& b) { return b; }
__device__ __forceinline__ bool both(bool a, bool b) { return a && b; }

// -- streams: a base pointer and a row stride (in elements) -----------------------------------
// None: an unused slot (an op has one or two inputs and one or two outputs).
struct None { using T = u8_t; static constexpr bool ON = false; static constexpr int STORE = 0; T* p; i64_t rs; int bits; };
template <typename T_> struct In { using T = T_; static constexpr bool ON = true; const T* p; i64_t rs; };
// An output's stores: PLAIN, or any of NULLABLE (a null pointer skips them: fake_quantize's mask)
// and BITS (when its int parameter `bits` is set, the vector's 0/1 values are stored as the bits of
// one byte: element 8b + j of a row is bit j of byte b, docs/numerics.md "Mask bits").
enum Store { PLAIN = 0, NULLABLE = 1, BITS = 2 };
template <typename T_, int STORE_ = PLAIN> struct Out {
    using T = T_;
    static constexpr bool ON = true;
    static constexpr int STORE = STORE_;
    T* p; i64_t rs; int bits;
};

// The stores of output `o`'s vector `v` at column c of the row at `base`: store_vec, or, for a BITS
// stream when its parameter is set, the vector's 0/1 values as the bits of one byte (element i:
// bit i; VEC == 8), gathered from the vector's two words (bytes 0/1 -> the top 4 bits of a product:
// w * 0x01020408 >> 24).
template <int VEC, class O>
__device__ __forceinline__ void store_vector(const O& o, typename O::T* base, i64_t c, const Vec<typename O::T, VEC>& v) {
    if constexpr (O::ON) {
        if constexpr ((O::STORE & BITS) != 0) {
            if (!(O::STORE & NULLABLE) || o.p) {
                static_assert(VEC == 8, "one byte of bits a vector");
                if (o.bits) {
                    const u32_t* w = reinterpret_cast<const u32_t*>(&v);
                    (base)[c >> 3] = (u8_t)(((w[0] * 0x01020408u) >> 24) | (((w[1] * 0x01020408u) >> 24) << 4));
                } else {
                    store_vec<typename O::T, VEC>(base + c, v);
                }
            }
        } else if constexpr ((O::STORE & NULLABLE) != 0) {
            if (o.p) store_vec<typename O::T, VEC>(base + c, v);
        } else {
            store_vec<typename O::T, VEC>(base + c, v);
        }
    }
}
// The scalar path's store of element c; a BITS stream gathers its thread's 8 consecutive elements
// in `acc` (the scalar path's column loop takes them together) and writes their byte after the 8th
// (or the row's last) one.
template <class O>
__device__ __forceinline__ void store_scalar(const O& o, typename O::T* row, i64_t c, i64_t cols, typename O::T e, u32_t& acc) {
    if constexpr (O::ON) {
        if constexpr ((O::STORE & BITS) != 0) {
            if (!(O::STORE & NULLABLE) || o.p) {
                if (o.bits) {
                    acc |= (u32_t)e << (c & 7);
                    if ((c & 7) == 7 || c + 1 == cols) {
                        row[c >> 3] = (u8_t)acc;
                        acc = 0;
                    }
                } else {
                    row[c] = e;
                }
            }
        } else if constexpr ((O::STORE & NULLABLE) != 0) {
            if (o.p) row[c] = e;
        } else {
            row[c] = e;
        }
    }
}

// Element i of an input vector. A vector of 8-bit codes is read through vec_at: the codes stay in
// words until used.
template <typename T, int VEC> __device__ __forceinline__ T elem_at(const Vec<T, VEC>& v, int i) {
    if constexpr (sizeof(T) == 1) return vec_at(v, i); else return v.v[i];
}

// The op's body on one element: its present streams only.
template <class Op, class I0, class I1, class O0, class O1, typename M, typename B>
__device__ __forceinline__ void apply(Elem<M, B> e, typename I0::T x0, typename I1::T x1,
                                      typename O0::T& y0, typename O1::T& y1) {
    if constexpr (!I1::ON && !O1::ON) Op::apply(e, x0, y0);
    else if constexpr (!O1::ON) Op::apply(e, x0, x1, y0);
    else if constexpr (!I1::ON) Op::apply(e, x0, y0, y1);
    else Op::apply(e, x0, x1, y0, y1);
}

// One launch: its parameters, streams and thread coordinates; run() takes the vector path of its
// layout or the scalar path.
template <class Op, Scope S, bool ASYM, Layout L, int VEC, int U, u32_t BAD_SCALE, u32_t BAD_ZP,
          typename M, class I0, class I1, class O0, class O1>
struct Kernel {
    using T0 = typename I0::T; using T1 = typename I1::T;
    using R0 = typename O0::T; using R1 = typename O1::T;
    static constexpr bool FLOAT = same_type<M, float>;
    // Deferred checks for single-precision math; the check before the loads for f64 math and for
    // kernels that turn 8-bit codes into float32 (16 float32 outputs a vector, 256 bytes of them in
    // flight per thread), where the second sweep costs registers and spills (ptxas: up to 24 B of
    // stack and 256 B of spills).
    static constexpr bool DEFERRED = FLOAT &&
        !((same_type<R0, float> || (O1::ON && same_type<R1, float>)) && (!same_type<T0, float> || (I1::ON && !same_type<T1, float>)));

    const Params<M> a;
    I0 in0; I1 in1; O0 out0; O1 out1;
    int TX, TY;
    bool narrow_rows, narrow_cols;
    M qlo, qhi;
    i64_t row0, row_step;

    // a row's stream pointers
    struct Row { const T0* x0; const T1* x1; R0* y0; R1* y1; };
    __device__ __forceinline__ Row row_at(i64_t row) const {
        Row r;
        if constexpr (I0::ON) r.x0 = in0.p + row * in0.rs;
        if constexpr (I1::ON) r.x1 = in1.p + row * in1.rs;
        if constexpr (O0::ON) r.y0 = out0.p + row * out0.rs;
        if constexpr (O1::ON) r.y1 = out1.p + row * out1.rs;
        return r;
    }
    // the index of a row's scale element (the scalar path adds the column's part)
    __device__ __forceinline__ i64_t row_scale_base(i64_t row) const {
        if constexpr (S == Scope::tensor) return 0;
        else if constexpr (S == Scope::token) return row;
        else if constexpr (S == Scope::group) return row * (a.cols / a.group_size);
        else return a.chan_last ? 0 : channel_of(row, a.chan_inner, a.chan_count, narrow_rows);
    }
    __device__ __forceinline__ M scale_at(i64_t idx) const { return a.scale ? a.scale[idx] : a.scale_value; }
    __device__ __forceinline__ int zp_at(i64_t idx) const {
        if constexpr (ASYM) return a.zero_point ? a.zero_point[idx] : a.zp_value;
        else return a.zp_value;   // symmetric: the implied zero point
    }
    __device__ __forceinline__ bool check(M s, int zp) const {
        return param_bad<ASYM>(a.status, s, zp, a.qmin, a.qmax, BAD_SCALE, BAD_ZP);
    }
    template <typename B> __device__ __forceinline__ Elem<M, B> elem(M s, M inv, int zp, B bad) const {
        return Elem<M, B>{s, inv, zp, bad, qlo, qhi, a.qmin, a.qmax};
    }

    // -- rows layout: U column vectors of one row per step, one scale per row ------------------
    // One pass over a row's columns: U column vectors per step (loads, then compute and stores).
    // The reciprocal is taken after the data loads: its slow-path branch keeps the compiler from
    // moving loads above it.
    template <typename B> __device__ __forceinline__ void row_pass(const Row& r, M s, int zp, B bad) const {
        for (i64_t c0 = (i64_t)threadIdx.x * VEC; c0 < a.cols; c0 += (i64_t)TX * VEC * U) {
            Vec<T0, VEC> v0[U];
            Vec<T1, VEC> v1[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64_t c = c0 + (i64_t)u * TX * VEC;
                if (c < a.cols) {
                    if constexpr (I0::ON) v0[u] = load_vec<T0, VEC>(r.x0 + c);
                    if constexpr (I1::ON) v1[u] = load_vec<T1, VEC>(r.x1 + c);
                }
            }
            const M inv = recip(s);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64_t c = c0 + (i64_t)u * TX * VEC;
                if (c >= a.cols) break;
                Vec<R0, VEC> o0;
                Vec<R1, VEC> o1;
#pragma unroll
                for (int i = 0; i < VEC; ++i)
                    apply<Op, I0, I1, O0, O1>(elem(s, inv, zp, bad), elem_at(v0[u], i), elem_at(v1[u], i), o0.v[i], o1.v[i]);
                store_vector<VEC>(out0, r.y0, c, o0);
                store_vector<VEC>(out1, r.y1, c, o1);
            }
        }
    }
    // -- row-vectors layout: the rows layout, parameters per vector -------------------------------
    // One pass over a row: U column vectors per step, each with its parameters (group: the vector's
    // group element; channel on the last axis: its VEC per-column elements, vector loads), loaded with
    // the step's data. CHECKED: each element's parameters are tested (status written, the op's poison
    // where one fails); else they are assumed valid and the pass returns whether one was not.
    template <bool CHECKED> __device__ __forceinline__ bool row_vectors_pass(const Row& r, i64_t srow) const {
        bool any_bad = false;
        for (i64_t c0 = (i64_t)threadIdx.x * VEC; c0 < a.cols; c0 += (i64_t)TX * VEC * U) {
            Vec<T0, VEC> v0[U];
            Vec<T1, VEC> v1[U];
            M s_u[U];
            int zp_u[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64_t c = c0 + (i64_t)u * TX * VEC;
                if (c < a.cols) {
                    if constexpr (I0::ON) v0[u] = load_vec<T0, VEC>(r.x0 + c);
                    if constexpr (I1::ON) v1[u] = load_vec<T1, VEC>(r.x1 + c);
                    if constexpr (S == Scope::group) {
                        // 32-bit division where the columns allow (a 64-bit one is a call)
                        const i64_t g = srow + (narrow_cols ? (i64_t)((u32_t)c / (u32_t)a.group_size) : c / a.group_size);
                        s_u[u] = scale_at(g);
                        zp_u[u] = zp_at(g);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64_t c = c0 + (i64_t)u * TX * VEC;
                if (c < a.cols) {
                Vec<R0, VEC> o0;
                Vec<R1, VEC> o1;
                // channel: the vector's per-column parameters, read after the data (L1 hits after a
                // thread's first row; loaded with the data they would hold U x VEC x 2 registers)
                Vec<M, VEC> sv;
                Vec<i32_t, VEC> zv;
                if constexpr (S == Scope::channel) {
                    sv = load_vec<M, VEC>(a.scale + c);
                    if constexpr (ASYM) zv = load_vec<i32_t, VEC>(a.zero_point + c);
                }
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    M s;
                    int zp;
                    if constexpr (S == Scope::group) s = s_u[u], zp = zp_u[u];
                    else s = sv.v[i], zp = ASYM ? zv.v[i] : a.zp_value;
                    const M inv = recip(s);   // unused by the dequantize ops: dead code there
                    if constexpr (CHECKED) {
                        const bool bad = check(s, zp);
                        apply<Op, I0, I1, O0, O1>(elem(s, inv, zp, bad), elem_at(v0[u], i), elem_at(v1[u], i), o0.v[i], o1.v[i]);
                    } else {
                        if (S != Scope::group || i == 0) any_bad |= param_invalid<ASYM>(s, zp, a.qmin, a.qmax);
                        apply<Op, I0, I1, O0, O1>(elem(s, inv, zp, Known<false>{}), elem_at(v0[u], i), elem_at(v1[u], i), o0.v[i], o1.v[i]);
                    }
                }
                store_vector<VEC>(out0, r.y0, c, o0);
                store_vector<VEC>(out1, r.y1, c, o1);
                }
            }
        }
        return any_bad;
    }
    // As rows_layout: deferred checks (a checked second pass over the thread's rows where a
    // parameter failed) for single-precision math, checked as it goes otherwise.
    __device__ __forceinline__ void row_vectors_layout() const {
        if constexpr (DEFERRED) {
            bool any_bad = false;
#pragma unroll 1
            for (i64_t row = row0; row < a.rows; row += row_step) any_bad |= row_vectors_pass<false>(row_at(row), row_scale_base(row));
            if (any_bad && a.status) {
#pragma unroll 1
                for (i64_t row = row0; row < a.rows; row += row_step) row_vectors_pass<true>(row_at(row), row_scale_base(row));
            }
        } else {
            for (i64_t row = row0; row < a.rows; row += row_step) row_vectors_pass<true>(row_at(row), row_scale_base(row));
        }
    }
    // A thread loads U column vectors of its row (U x 16 bytes in flight), then computes and stores
    // them; the row's scale is loaded once, its reciprocal taken after the data loads are issued (so
    // that one memory latency covers both: small shapes are latency-bound).
    __device__ __forceinline__ void rows_layout() const {
        if constexpr (DEFERRED) {
            // Each row is computed as if its scale were valid and only tested (a few instructions, no
            // branch): a check before the loads would make every row wait for its scale, and a poison
            // pass behind every row costs the row's loop entry again. An invalid scale element (an
            // error: rare) sends this thread over its rows a second time, where each failing row
            // records its code in the status word and has its outputs overwritten with the op's poison
            // (the same thread rewrites the same elements: program order makes the poison final).
            bool any_bad = false;
#pragma unroll 1
            for (i64_t row = row0; row < a.rows; row += row_step) {
                const Row r = row_at(row);
                const i64_t srow = row_scale_base(row);
                const M s = scale_at(srow);
                const int zp = zp_at(srow);
                row_pass(r, s, zp, Known<false>{});
                any_bad |= param_invalid<ASYM>(s, zp, a.qmin, a.qmax);
            }
            if (any_bad && a.status) {
#pragma unroll 1
                for (i64_t row = row0; row < a.rows; row += row_step) {
                    const Row r = row_at(row);
                    const i64_t srow = row_scale_base(row);
                    const M s = scale_at(srow);
                    const int zp = zp_at(srow);
                    const bool bad = check(s, zp);
                    if (bad) row_pass(r, s, zp, Known<true>{});
                }
            }
        } else {
            for (i64_t row = row0; row < a.rows; row += row_step) {
                const Row r = row_at(row);
                const i64_t srow = row_scale_base(row);
                const M s = scale_at(srow);
                const int zp = zp_at(srow);
                const bool bad = check(s, zp);
                row_pass(r, s, zp, bad);
            }
        }
    }

    // -- columns layout: one column vector per thread, U rows per step --------------------------
    // The U rows of one step (c: the column vector, r0: the step's first row): s_c / inv_c / zp_c /
    // bad_c, the column's parameters (channel), or s_u / zp_u / bad_g, the U rows' group parameters
    // (group); v0 / v1, the rows' input vectors; bad_u: whether any of them failed its check.
    template <typename B> __device__ __forceinline__ void columns_step(i64_t c, i64_t r0, const M (&s_c)[VEC], const M (&inv_c)[VEC],
                                                 const int (&zp_c)[VEC], const bool (&bad_c)[VEC],
                                                 const Vec<T0, VEC> (&v0)[U], const Vec<T1, VEC> (&v1)[U],
                                                 const M (&s_u)[U], const int (&zp_u)[U], const bool (&bad_g)[U],
                                                 B bad_u) const {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64_t row = r0 + u * row_step;
            if (row >= a.rows) break;
            M s_g, inv_g;
            int zp_g;
            if constexpr (S == Scope::group) {
                s_g = s_u[u], inv_g = recip(s_g);
                zp_g = zp_u[u];
            }
            Vec<R0, VEC> o0;
            Vec<R1, VEC> o1;
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                if constexpr (S == Scope::group)
                    apply<Op, I0, I1, O0, O1>(elem(s_g, inv_g, zp_g, both(bad_u, bad_g[u])), elem_at(v0[u], i), elem_at(v1[u], i), o0.v[i], o1.v[i]);
                else
                    apply<Op, I0, I1, O0, O1>(elem(s_c[i], inv_c[i], zp_c[i], both(bad_u, bad_c[i])), elem_at(v0[u], i), elem_at(v1[u], i), o0.v[i], o1.v[i]);
            }
            store_vector<VEC>(out0, out0.p + row * out0.rs, c, o0);
            store_vector<VEC>(out1, out1.p + row * out1.rs, c, o1);
        }
    }
    // A thread owns one column vector at a time and walks the rows, U rows per step (U x 16
    // bytes in flight). What depends only on the column is computed once per column vector,
    // not once per row; the launcher's grid is persistent, so each thread sees many rows.
    // blockIdx.y picks the block's columns, so that a thread owns one column vector of a wide
    // row rather than looping over several (each loop would end on a partial U-row step).
    __device__ __forceinline__ void columns_layout() const {
        for (i64_t c = ((i64_t)blockIdx.y * TX + threadIdx.x) * VEC; c < a.cols; c += (i64_t)gridDim.y * TX * VEC) {
            i64_t ngroups, g;
            M s_c[VEC], inv_c[VEC];
            int zp_c[VEC];
            bool bad_c[VEC], bad_any = false;
            if constexpr (S == Scope::group) {
                // group_size % VEC == 0 (the launcher's condition for this path): the vector lies in group g
                ngroups = a.cols / a.group_size, g = c / a.group_size;
            } else {
                // this vector's VEC per-column parameters, loaded once as vectors (the launcher
                // checks their alignment)
                const Vec<M, VEC> sv = load_vec<M, VEC>(a.scale + c);
                Vec<i32_t, VEC> zv;
                if constexpr (ASYM) zv = load_vec<i32_t, VEC>(a.zero_point + c);
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    s_c[i] = sv.v[i];
                    inv_c[i] = recip(sv.v[i]);
                    zp_c[i] = ASYM ? zv.v[i] : a.zp_value;
                    bad_c[i] = check(s_c[i], zp_c[i]);
                    bad_any = bad_any || bad_c[i];
                }
            }
            for (i64_t r0 = row0; r0 < a.rows; r0 += row_step * U) {
                Vec<T0, VEC> v0[U];
                Vec<T1, VEC> v1[U];
                // the U rows' group scales are loaded with their data: one latency covers both
                M s_u[U];
                int zp_u[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const i64_t row = r0 + u * row_step;
                    if constexpr (S == Scope::group) {
                        s_u[u] = a.scale_value;
                        zp_u[u] = a.zp_value;
                    }
                    if (row < a.rows) {
                        if constexpr (I0::ON) v0[u] = load_vec<T0, VEC>(in0.p + row * in0.rs + c);
                        if constexpr (I1::ON) v1[u] = load_vec<T1, VEC>(in1.p + row * in1.rs + c);
                        if constexpr (S == Scope::group) {
                            if (a.scale) s_u[u] = a.scale[row * ngroups + g];
                            if constexpr (ASYM) {
                                if (a.zero_point) zp_u[u] = a.zero_point[row * ngroups + g];
                            }
                        }
                    }
                }
                bool bad_g[U], bad_step = false;
                if constexpr (S == Scope::group) {
                    // the U group scales' checks, after the loads: one branch for the whole step
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        bad_g[u] = r0 + u * row_step < a.rows && check(s_u[u], zp_u[u]);
                        bad_step = bad_step || bad_g[u];
                    }
                }
                // The common case first: every parameter of the step valid (the flag false), where
                // bad_u is the constant false and the op's poison selects fold away; else the same
                // step with it true. For single-precision math only: 16-bit kernels are issue-bound
                // at full bandwidth and a select per element cost them up to 18 points of copy
                // bandwidth; the f64 kernels spill with two copies.
                const bool flag = S == Scope::group ? bad_step : bad_any;
                if constexpr (FLOAT) {
                    if (!(flag)) columns_step(c, r0, s_c, inv_c, zp_c, bad_c, v0, v1, s_u, zp_u, bad_g, Known<false>{});
                    else columns_step(c, r0, s_c, inv_c, zp_c, bad_c, v0, v1, s_u, zp_u, bad_g, Known<true>{});   // an invalid scale element: its outputs are poisoned
                } else {
                    columns_step(c, r0, s_c, inv_c, zp_c, bad_c, v0, v1, s_u, zp_u, bad_g, flag);
                }
            }
        }
    }

    // -- scalar path: any cols, any alignment, any group size -----------------------------------
    __device__ __forceinline__ void scalar_element(const Row& r, i64_t srow, i64_t c, u32_t& acc0, u32_t& acc1) const {
        i64_t sidx;
        if constexpr (S == Scope::group) sidx = srow + c / a.group_size;
        else if constexpr (S == Scope::channel) sidx = a.chan_last ? c : srow;
        else sidx = srow;
        const M s = scale_at(sidx);
        const M inv = recip(s);
        const int zp = zp_at(sidx);
        const bool bad = check(s, zp);
        T0 x0;
        T1 x1;
        if constexpr (I0::ON) x0 = r.x0[c];
        if constexpr (I1::ON) x1 = r.x1[c];
        R0 y0;
        R1 y1;
        apply<Op, I0, I1, O0, O1>(elem(s, inv, zp, bad), x0, x1, y0, y1);
        store_scalar(out0, r.y0, c, a.cols, y0, acc0);
        store_scalar(out1, r.y1, c, a.cols, y1, acc1);
    }
    __device__ __forceinline__ void scalar_path() const {
        for (i64_t row = row0; row < a.rows; row += row_step) {
            const Row r = row_at(row);
            const i64_t srow = row_scale_base(row);
            u32_t acc0 = 0, acc1 = 0;
            if constexpr (((O0::STORE | O1::STORE) & BITS) != 0) {
                // bit-packed outputs: a thread takes 8 consecutive columns (one byte of bits) at a time
                const i64_t STEP = ((O0::STORE & BITS) && out0.bits) || ((O1::STORE & BITS) && out1.bits) ? 8 : 1;
                for (i64_t c0 = (i64_t)threadIdx.x * STEP; c0 < a.cols; c0 += (i64_t)TX * STEP)
#pragma unroll 1
                for (i64_t c = c0; c < c0 + STEP && c < a.cols; ++c) scalar_element(r, srow, c, acc0, acc1);
            } else {
                for (i64_t c = threadIdx.x; c < a.cols; c += TX) scalar_element(r, srow, c, acc0, acc1);
            }
        }
    }

    __device__ __forceinline__ void run() const {
        bool vec_path;
        if constexpr (S != Scope::channel) vec_path = a.vec_ok;
        else if constexpr (L == ROWS) vec_path = a.vec_ok && !a.chan_last;
        else vec_path = a.vec_ok && a.chan_last;
        if (vec_path) {
            // Vector path: cols % VEC == 0 and every row start is aligned to its vector width.
            if constexpr (L == ROWS) rows_layout();
            else if constexpr (L == COLUMNS) columns_layout();
            else row_vectors_layout();
        } else {
            scalar_path();
        }
    }
};

// The body of a static elementwise entry point: its streams, then its other parameters in the
// order of its signature.
template <class Op, Scope S, bool ASYM, Layout L, int VEC, int U, u32_t BAD_SCALE, u32_t BAD_ZP,
          typename M, class I0, class I1, class O0, class O1>
__device__ __forceinline__ void elementwise(I0 in0, I1 in1, O0 out0, O1 out1, const M* scale, M scale_value,
                                            const i32_t* zero_point, int zp_value, i64_t rows, i64_t cols,
                                            i64_t group_size, i64_t chan_inner, i64_t chan_count, int chan_last,
                                            int qmin, int qmax, int vec_ok, u32_t* status) {
    static_assert(S == Scope::tensor || S == Scope::token ? L == ROWS : S == Scope::group ? L != ROWS : true, "the scope's layout");
    const int TX = blockDim.x, TY = blockDim.y;
    const bool narrow_rows = rows <= 0xFFFFFFFFll && chan_inner <= 0xFFFFFFFFll && chan_count <= 0xFFFFFFFFll;
    const bool narrow_cols = cols <= 0xFFFFFFFFll;
    const M qlo = (M)qmin, qhi = (M)qmax;
    const i64_t row0 = (i64_t)blockIdx.x * TY + threadIdx.y, row_step = (i64_t)gridDim.x * TY;
    const Kernel<Op, S, ASYM, L, VEC, U, BAD_SCALE, BAD_ZP, M, I0, I1, O0, O1> k{
        {scale, scale_value, zero_point, zp_value, rows, cols, group_size, chan_inner, chan_count, chan_last, qmin, qmax,
         vec_ok, status},
        in0, in1, out0, out1, TX, TY, narrow_rows, narrow_cols, qlo, qhi, row0, row_step};
    k.run();
}

// -- the ops' per-element bodies ------------------------------------------------------------------
// quantize: q = clamp(rne(x * inv) + zp, qmin, qmax); NaN -> zp; +-inf saturate (quant_code_bits:
// no float -> int conversion instruction). An invalid scale element (bad) gives qmin.
template <typename Q> struct Quantize {
    template <typename M, typename B, typename T> static __device__ __forceinline__ void apply(Elem<M, B> e, T x, Q& q) {
        q = to_q<Q>(e.bad ? e.qmin : quant_code_bits(to_math<M>(x) * e.inv, quant_bounds<M>(e.zp, e.qmin, e.qmax)));
    }
};
// dequantize: y = (q - zp) * scale, rounded once to the output dtype; NaN for an invalid scale element.
template <typename T> struct Dequantize {
    template <typename M, typename B, typename Q> static __device__ __forceinline__ void apply(Elem<M, B> e, Q q, T& y) {
        y = from_math<T>(e.bad ? poison_nan<M>() : (M)(q_to_int(q) - e.zp) * e.s);
    }
};
// quantize_backward (straight-through estimator with clip mask) and fake_quantize_backward,
// docs/numerics.md: dx = dy * (qmin <= v <= qmax), v = rne(x * inv) + zp (quantize's value before
// the clamp). A NaN x compares false: its gradient is dy * 0. The product is rounded once (exact).
// fake_quantize_backward recomputes the mask from x (PyTorch caches it); `dy * mask` is a product,
// as in PyTorch, so a negative dy outside the range gives -0 and a non-finite dy gives NaN there.
template <typename T> struct ClipBackward {
    template <typename M, typename B> static __device__ __forceinline__ void apply(Elem<M, B> e, T dy, T x, T& dx) {
        const M v = rne_bounded(to_math<M>(x) * e.inv) + (M)e.zp;   // only compared or clamped
        dx = from_math<T>(e.bad ? poison_nan<M>() : to_math<M>(dy) * ((v >= e.qlo && v <= e.qhi) ? (M)1 : (M)0));   // NaN: invalid scale element
    }
};
// dequantize_backward (straight-through), docs/numerics.md: dq = dy * scale, rounded once to dy's dtype.
template <typename T> struct DequantizeBackward {
    template <typename M, typename B> static __device__ __forceinline__ void apply(Elem<M, B> e, T dy, T& dq) {
        dq = from_math<T>(e.bad ? poison_nan<M>() : to_math<M>(dy) * e.s);   // NaN: invalid scale
    }
};
// fake_quantize, docs/numerics.md (PyTorch's fake_quantize_per_tensor_affine formula):
// v = rne(x * inv) + zp;  y = (clamp(v, qmin, qmax) - zp) * scale, rounded once to x's dtype;
// mask = (qmin <= v <= qmax) (a NULLABLE | BITS output: one byte an element, or one bit).
// NaN x: v is NaN, clamp keeps it, y is NaN and the mask is 0. An invalid scale element (bad):
// y is NaN and the mask 0.
template <typename T> struct FakeQuantize {
    template <typename M, typename B> static __device__ __forceinline__ void apply(Elem<M, B> e, T x, T& y, u8_t& mask) {
        const M v = rne_bounded(to_math<M>(x) * e.inv) + (M)e.zp;   // only compared or clamped
        y = from_math<T>(e.bad ? poison_nan<M>() : (clamp_q(v, e.qlo, e.qhi) - (M)e.zp) * e.s);
        mask = (u8_t)((!e.bad && v >= e.qlo && v <= e.qhi) ? 1 : 0);
    }
};

}  // namespace ew
// ---- end of elementwise quantization ------------------------------------------------------------
