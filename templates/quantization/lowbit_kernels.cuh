// ---- skuforge low-bit kernels (templates/quantization/lowbit_kernels.cuh) -------------------
// The low-bit static quantize / dequantize kernels and the codes every low-bit kernel writes
// (docs/lowbit.md), after templates/common/lowbit.cuh (the conversion functions). Codes: Fp8<F, HW>
// (F: Fp8E4M3 / Fp8E5M2; HW: the sm_89 cvt instructions, else the software conversion) and
// Int4<SIGNED> (s4 / u4, two per byte: 2i low nibble, 2i + 1 high). Each has PACK (elements per byte
// of q), encode / encode_vec (t = x * inv in the math precision M -> codes) and decode_vec (codes ->
// values in M).
namespace lowbit {

// e8m0 block scale (MX) in the math precision: 2^(code - 127), exact
template <typename M> __device__ __forceinline__ M e8m0_to(unsigned code) {
    if constexpr (sizeof(M) == 8) return e8m0_to_f64(code);
    else return e8m0_to_f32(code);
}

// fp8 codes (one a byte): t -> the fp8 byte of t (round half to even, saturating, NaN -> 0x7F);
// decoded exactly. Their kernels keep one quantize path (UNCHECKED_PATH false: the conversion
// saturates and keeps NaN itself).
template <class F, bool HW> struct Fp8 {
    typedef F Format;
    static constexpr int PACK = 1;
    static constexpr bool UNCHECKED_PATH = false;
    template <bool CHECKED = true, typename M>
    static __device__ __forceinline__ unsigned encode(M t, const QuantBounds<M>& qb) {
        (void)qb;
        if constexpr (HW) return fp8x2_encode_hw<F>(t, 0.0f) & 0xFFu;
        else return fp8_encode<F>(t);
    }
    template <int V, bool CHECKED = true, typename M>
    static __device__ __forceinline__ void encode_vec(const M (&t)[V], const QuantBounds<M> (&qb)[V], Vec<u8_t, V / PACK>& out) {
        if constexpr (HW && V % 2 == 0) {
#pragma unroll
            for (int i = 0; i < V; i += 2) {    // one cvt.rn.satfinite.<f8>x2.f32 per pair
                const unsigned d = fp8x2_encode_hw<F>(t[i], t[i + 1]);
                out.v[i] = (u8_t)(d & 0xFFu);
                out.v[i + 1] = (u8_t)(d >> 8);
            }
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i) out.v[i] = (u8_t)encode<CHECKED>(t[i], qb[i]);
        }
    }
    template <int V, typename M>
    static __device__ __forceinline__ void decode_vec(const Vec<u8_t, V / PACK>& in, const int (&zp)[V], M (&out)[V]) {
        (void)zp;
        if constexpr (HW) {
            if constexpr (V % 2 == 0) {
#pragma unroll
                for (int i = 0; i < V; i += 2) {    // one cvt.rn.f16x2.<f8>x2 per pair (exact)
                    float lo, hi;
                    fp8x2_decode_hw<F>(in.v[i], in.v[i + 1], lo, hi);
                    out[i] = (M)lo;
                    out[i + 1] = (M)hi;
                }
            } else {
#pragma unroll
                for (int i = 0; i < V; ++i) { float lo, hi; fp8x2_decode_hw<F>(in.v[i], 0u, lo, hi); out[i] = (M)lo; }
            }
        } else if constexpr (sizeof(M) == 8) {
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = fp8_decode_f64<F>(in.v[i]);
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i) out[i] = fp8_decode_f32<F>(in.v[i]);
        }
    }
};

// int4 codes: t -> clamp(rne(t) + zp, qmin, qmax) (NaN -> zp), as a nibble; decoded as q - zp.
template <bool SIGNED> struct Int4 {
    static constexpr int PACK = 2;
    static constexpr bool UNCHECKED_PATH = true;
    template <bool CHECKED = true, typename M>
    static __device__ __forceinline__ unsigned encode(M t, const QuantBounds<M>& qb) {
        return (unsigned)quant_code_bits<CHECKED>(t, qb) & 0xFu;
    }
    template <int V, bool CHECKED = true, typename M>
    static __device__ __forceinline__ void encode_vec(const M (&t)[V], const QuantBounds<M> (&qb)[V], Vec<u8_t, V / PACK>& out) {
#pragma unroll
        for (int i = 0; i < V; i += 2) out.v[i / 2] = int4_pack((int)encode<CHECKED>(t[i], qb[i]), (int)encode<CHECKED>(t[i + 1], qb[i + 1]));
    }
    static __device__ __forceinline__ int lo(unsigned b) { return SIGNED ? s4_lo(b) : u4_lo(b); }
    static __device__ __forceinline__ int hi(unsigned b) { return SIGNED ? s4_hi(b) : u4_hi(b); }
    template <int V, typename M>
    static __device__ __forceinline__ void decode_vec(const Vec<u8_t, V / PACK>& in, const int (&zp)[V], M (&out)[V]) {
#pragma unroll
        for (int i = 0; i < V; i += 2) {
            out[i] = (M)(lo(in.v[i / 2]) - zp[i]);
            out[i + 1] = (M)(hi(in.v[i / 2]) - zp[i + 1]);
        }
    }
};

// -- the static kernels' scale / zero point ------------------------------------------------------

// Per-element scale / zero point of the static kernels: index of the scale element of (row, c),
// whether a vector of VEC elements shares one, and the parameter itself (inv = 1 / scale once
// per scale element it is loaded for, as the s8/u8 kernels do), with its device-side check.
// E8M0: fp8 group-scope kernels also accept e8m0 block scales (a byte pointer; the launcher passes
// it for group 32). BAD_SCALE, BAD_ZP: the codes the kernel writes to the status word.
template <typename M> struct Param { M s, inv; int zp; };
template <Scope SCOPE, bool ASYM, bool E8M0, int VEC, u32_t BAD_SCALE, u32_t BAD_ZP, typename M>
struct Params {
    const M* scale; M scale_value; const u8_t* scale_e8m0; const i32_t* zero_point; int zp_value;
    i64_t cols, group_size, chan_inner, chan_count; int chan_last;
    u32_t* status; int qmin, qmax;   // status: the device's status word, or null (no value checks)

    __device__ __forceinline__ i64_t index(i64_t row, i64_t c) const {
        if constexpr (SCOPE == Scope::tensor) {
            (void)row; (void)c; return 0;
        } else if constexpr (SCOPE == Scope::token) {
            (void)c; return row;
        } else if constexpr (SCOPE == Scope::group) {
            return row * (cols / group_size) + c / group_size;
        } else {
            // 32-bit division when every operand fits (a 64-bit one is a call: registers live across it spill)
            return chan_last ? c : channel_of(row, chan_inner, chan_count, ((u64_t)row | (u64_t)chan_inner | (u64_t)chan_count) >> 32 == 0);
        }
    }
    // One scale element for the VEC elements of a vector starting at a multiple of VEC.
    __device__ __forceinline__ bool uniform() const {
        if constexpr (SCOPE == Scope::tensor || SCOPE == Scope::token) return true;
        else if constexpr (SCOPE == Scope::group) return group_size % VEC == 0;
        else return !chan_last;
    }
    // The scale element (and zero point) of (row, c) as loaded: kernels load those of a step's
    // vectors with their data, so that one memory latency covers both, and finish them after.
    struct Raw { M s; int zp; };
    __device__ __forceinline__ Raw raw(i64_t row, i64_t c) const {
        const i64_t i = index(row, c);
        Raw r;
        if constexpr (E8M0) {
            // e8m0 block scales (MX): 2^(code - 127), exact, so inv is exact too
            r.s = scale_e8m0 ? e8m0_to<M>(scale_e8m0[i]) : (scale ? scale[i] : scale_value);
        } else {
            r.s = scale ? scale[i] : scale_value;
        }
        if constexpr (ASYM) r.zp = zero_point ? zero_point[i] : zp_value;
        else r.zp = zp_value;
        return r;
    }
    // The parameter of a loaded scale element, with its device-side check and reciprocal.
    __device__ __forceinline__ Param<M> finish(const Raw& r) const {
        Param<M> p;
        p.s = r.s;
        p.zp = r.zp;
        // an invalid scale element (e8m0 code 255 is NaN) becomes s = NaN, zp = qmin: dequantize gives
        // NaN, quantize's t = x * NaN gives NaN (fp8) or the zero point qmin (int4)
        if (param_bad<ASYM>(status, p.s, p.zp, qmin, qmax, BAD_SCALE, BAD_ZP)) {
            p.s = poison_nan<M>();
            p.zp = qmin;
        }
        p.inv = recip(p.s);
        return p;
    }
    __device__ __forceinline__ Param<M> at(i64_t row, i64_t c) const { return finish(raw(row, c)); }
};

// -- static quantize: x (float) -> q (codes C) -----------------------------------------------------
// fp8: q = fp8_rne_satfinite(x * inv); int4: q = clamp(rne(x * inv) + zp, qmin, qmax), NaN -> zp.
// rows x cols view: rows may be strided, the last axis is contiguous; q has cols / PACK bytes
// per row. The grid strides over rows (any row count), 64-bit indices throughout.
// vec_ok: cols % VEC == 0 and x, q rows aligned to their vector widths (checked by the launcher).
// U: vectors each thread has in flight; SCOPE, ASYM, E8M0, BAD_SCALE, BAD_ZP: those of Params.
template <class C, Scope SCOPE, bool ASYM, bool E8M0, u32_t BAD_SCALE, u32_t BAD_ZP, int VEC, int U, typename T, typename M>
__device__ __forceinline__ void quantize(
    const T* __restrict__ x, i64_t x_rs, u8_t* __restrict__ q, i64_t q_rs, const M* __restrict__ scale, M scale_value,
    const u8_t* __restrict__ scale_e8m0, const i32_t* __restrict__ zero_point, int zp_value, i64_t rows, i64_t cols,
    i64_t group_size, i64_t chan_inner, i64_t chan_count, int chan_last, int qmin, int qmax, int vec_ok, u32_t* status)
{
    typedef Params<SCOPE, ASYM, E8M0, VEC, BAD_SCALE, BAD_ZP, M> Scales;
    constexpr int PACK = C::PACK;
    const Scales P{scale, scale_value, scale_e8m0, zero_point, zp_value, cols, group_size, chan_inner, chan_count, chan_last,
                   status, qmin, qmax};
    const int TX = blockDim.x, TY = blockDim.y;
    for (i64_t row = (i64_t)blockIdx.x * TY + threadIdx.y; row < rows; row += (i64_t)gridDim.x * blockDim.y) {   // blockDim.y re-read: cheaper than a register across the loop
        const T* xr = x + row * x_rs;
        u8_t* qr = q + row * q_rs;
        if (vec_ok) {
            // Vector path: each thread loads U vectors of x (U x 16 bytes in flight), then encodes and
            // stores VEC / PACK bytes per vector.
            const bool uniform = P.uniform();
            for (i64_t c0 = (i64_t)threadIdx.x * VEC; c0 < cols; c0 += (i64_t)TX * VEC * U) {
                Vec<T, VEC> xv[U];
                typename Scales::Raw pr[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const i64_t c = c0 + (i64_t)u * TX * VEC;
                    if (c < cols) {
                        xv[u] = load_vec<T, VEC>(xr + c);
                        if (uniform) pr[u] = P.raw(row, c);   // one scale element per vector: loaded with it
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const i64_t c = c0 + (i64_t)u * TX * VEC;
                    if (c >= cols) break;
                    M t[VEC];
                    QuantBounds<M> qb[VEC];
                    Param<M> p = uniform ? P.finish(pr[u]) : P.at(row, c);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) {
                        if (!uniform && i) p = P.at(row, c + i);
                        t[i] = to_math<M>(xv[u].v[i]) * p.inv;
                        qb[i] = quant_bounds<M>(p.zp, qmin, qmax);
                    }
                    Vec<u8_t, VEC / PACK> o;
                    C::template encode_vec<VEC>(t, qb, o);
                    store_vec<u8_t, VEC / PACK>(qr + c / PACK, o);
                }
            }
        } else {
            // Scalar path: PACK elements (one byte of q) per step; any cols (even for int4), any alignment.
            for (i64_t c = (i64_t)threadIdx.x * PACK; c < cols; c += (i64_t)TX * PACK) {
                M t[PACK];
                QuantBounds<M> qb[PACK];
#pragma unroll
                for (int i = 0; i < PACK; ++i) {
                    const Param<M> p = P.at(row, c + i);
                    t[i] = to_math<M>(xr[c + i]) * p.inv;
                    qb[i] = quant_bounds<M>(p.zp, qmin, qmax);
                }
                Vec<u8_t, 1> o;
                C::template encode_vec<PACK>(t, qb, o);
                qr[c / PACK] = o.v[0];
            }
        }
    }
}

// -- static dequantize: q (codes C) -> y (float) ---------------------------------------------------
// y = (q - zp) * scale in the math precision, rounded once to y's dtype (fp8: zp = 0, the value
// is decoded exactly). rows x cols view of y; q has cols / PACK bytes per row. An invalid scale
// element's outputs are NaN. Parameters as for quantize.
template <class C, Scope SCOPE, bool ASYM, bool E8M0, u32_t BAD_SCALE, u32_t BAD_ZP, int VEC, int U, typename T, typename M>
__device__ __forceinline__ void dequantize(
    const u8_t* __restrict__ q, i64_t q_rs, T* __restrict__ y, i64_t y_rs, const M* __restrict__ scale, M scale_value,
    const u8_t* __restrict__ scale_e8m0, const i32_t* __restrict__ zero_point, int zp_value, i64_t rows, i64_t cols,
    i64_t group_size, i64_t chan_inner, i64_t chan_count, int chan_last, int qmin, int qmax, int vec_ok, u32_t* status)
{
    typedef Params<SCOPE, ASYM, E8M0, VEC, BAD_SCALE, BAD_ZP, M> Scales;
    constexpr int PACK = C::PACK;
    const Scales P{scale, scale_value, scale_e8m0, zero_point, zp_value, cols, group_size, chan_inner, chan_count, chan_last,
                   status, qmin, qmax};
    const int TX = blockDim.x, TY = blockDim.y;
    for (i64_t row = (i64_t)blockIdx.x * TY + threadIdx.y; row < rows; row += (i64_t)gridDim.x * blockDim.y) {   // blockDim.y re-read: cheaper than a register across the loop
        const u8_t* qr = q + row * q_rs;
        T* yr = y + row * y_rs;
        if (vec_ok) {
            const bool uniform = P.uniform();
            for (i64_t c0 = (i64_t)threadIdx.x * VEC; c0 < cols; c0 += (i64_t)TX * VEC * U) {
                Vec<u8_t, VEC / PACK> qv[U];
                typename Scales::Raw pr[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const i64_t c = c0 + (i64_t)u * TX * VEC;
                    if (c < cols) {
                        qv[u] = load_vec<u8_t, VEC / PACK>(qr + c / PACK);
                        if (uniform) pr[u] = P.raw(row, c);   // one scale element per vector: loaded with it
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const i64_t c = c0 + (i64_t)u * TX * VEC;
                    if (c >= cols) break;
                    M s[VEC], v[VEC];
                    int zp[VEC];
                    Param<M> p = uniform ? P.finish(pr[u]) : P.at(row, c);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) {
                        if (!uniform && i) p = P.at(row, c + i);
                        s[i] = p.s;
                        zp[i] = p.zp;
                    }
                    C::template decode_vec<VEC>(qv[u], zp, v);
                    Vec<T, VEC> o;
#pragma unroll
                    for (int i = 0; i < VEC; ++i) o.v[i] = from_math<T>(v[i] * s[i]);
                    store_vec<T, VEC>(yr + c, o);
                }
            }
        } else {
            // Scalar path: one byte of q (PACK elements) per step; any alignment.
            for (i64_t c = (i64_t)threadIdx.x * PACK; c < cols; c += (i64_t)TX * PACK) {
                M s[PACK], v[PACK];
                int zp[PACK];
#pragma unroll
                for (int i = 0; i < PACK; ++i) {
                    const Param<M> p = P.at(row, c + i);
                    s[i] = p.s;
                    zp[i] = p.zp;
                }
                Vec<u8_t, 1> b;
                b.v[0] = qr[c / PACK];
                C::template decode_vec<PACK>(b, zp, v);
#pragma unroll
                for (int i = 0; i < PACK; ++i) yr[c + i] = from_math<T>(v[i] * s[i]);
            }
        }
    }
}

}  // namespace lowbit
// ---- end of low-bit kernels -----------------------------------------------------------------
