// ---- skuforge low-bit helpers (templates/common/lowbit.cuh) ---------------------------------
// FP8 (OCP e4m3fn, e5m2), e8m0 block-scale exponents (OCP MX) and packed int4.
// Included after the prelude, only by translation units that hold low-bit kernels.
// The conversion core works on IEEE bit patterns with integer arithmetic only, so it also
// compiles as host C++ (SF_HD is empty there): tests/test_lowbit_host.py builds it into a
// g++ harness and compares it with ml_dtypes (all 256 codes; every float32 of the fp8 range).
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define SF_HD __device__ __forceinline__
SF_HD unsigned           sf_f32_bits(float v)              { return __float_as_uint(v); }
SF_HD float              sf_f32_from(unsigned b)           { return __uint_as_float(b); }
SF_HD unsigned long long sf_f64_bits(double v)             { return (unsigned long long)__double_as_longlong(v); }
SF_HD double             sf_f64_from(unsigned long long b) { return __longlong_as_double((long long)b); }
SF_HD int                sf_clz32(unsigned v)              { return __clz(v); }
SF_HD int                sf_clz64(unsigned long long v)    { return __clzll(v); }
#else
#define SF_HD inline
inline unsigned           sf_f32_bits(float v)              { unsigned b; __builtin_memcpy(&b, &v, 4); return b; }
inline float              sf_f32_from(unsigned b)           { float v; __builtin_memcpy(&v, &b, 4); return v; }
inline unsigned long long sf_f64_bits(double v)             { unsigned long long b; __builtin_memcpy(&b, &v, 8); return b; }
inline double             sf_f64_from(unsigned long long b) { double v; __builtin_memcpy(&v, &b, 8); return v; }
inline int                sf_clz32(unsigned v)              { return v ? __builtin_clz(v) : 32; }
inline int                sf_clz64(unsigned long long v)    { return v ? __builtin_clzll(v) : 64; }
#endif

// -- fp8 formats: 1 sign bit, EBITS exponent bits (bias BIAS), MBITS mantissa bits ---------------
// e4m3fn: no infinities, NaN = S.1111.111, max 448 (0x7E). e5m2: IEEE-like, max 57344 (0x7B).
// EMAX: exponent of the largest normal (the OCP MX "emax_elem").
struct Fp8E4M3 {
    static constexpr int MBITS = 3, BIAS = 7, EMAX = 8;
    static constexpr unsigned MAX_CODE = 0x7Eu;
    static constexpr unsigned MAX_F32 = 0x43E00000u;                 // 448.0f
    static constexpr unsigned long long MAX_F64 = 0x407C000000000000ull;
    static SF_HD bool is_nan(unsigned a) { return a == 0x7Fu; }    // a: the code without its sign
    static SF_HD bool is_inf(unsigned)   { return false; }
};
struct Fp8E5M2 {
    static constexpr int MBITS = 2, BIAS = 15, EMAX = 15;
    static constexpr unsigned MAX_CODE = 0x7Bu;
    static constexpr unsigned MAX_F32 = 0x47600000u;                 // 57344.0f
    static constexpr unsigned long long MAX_F64 = 0x40EC000000000000ull;
    static SF_HD bool is_nan(unsigned a) { return a > 0x7Cu; }
    static SF_HD bool is_inf(unsigned a) { return a == 0x7Cu; }
};
// Source formats of the encoder: stored mantissa bits SM, exponent bias SB, width W.
struct SrcF32 { typedef unsigned U;           static constexpr int SM = 23, SB = 127, W = 32; };
struct SrcF64 { typedef unsigned long long U; static constexpr int SM = 52, SB = 1023, W = 64; };

// Round an IEEE value (its bits) once, to nearest even, into fp8 format F, saturating:
// |v| > max (±inf included) -> ±max (PTX .satfinite); NaN -> 0x7F, the canonical NaN (no sign);
// results that round to zero keep the sign (-0 = 0x80).
template <class F, class S>
SF_HD unsigned fp8_round_bits(typename S::U bits, typename S::U max_bits) {
    typedef typename S::U U;
    const U sign_bit = (U)1 << (S::W - 1);
    const unsigned sign = (bits & sign_bit) ? 0x80u : 0u;
    const U a = bits & ~sign_bit;
    const U inf = (((U)1 << (S::W - 1 - S::SM)) - 1) << S::SM;
    if (a > inf) return 0x7Fu;
    if (a > max_bits) return sign | F::MAX_CODE;      // values <= max never round above it
    int e = (int)(a >> S::SM);                          // biased exponent
    U m = a & (((U)1 << S::SM) - 1);
    if (e != 0) m |= (U)1 << S::SM; else e = 1;         // hidden bit; subnormals: the minimum exponent
    const int ue = e - S::SB, emin = 1 - F::BIAS;       // unbiased; smallest normal fp8 exponent
    // source bits below the fp8 quantum (2^(ue - MBITS), or 2^(emin - MBITS) for fp8 subnormals)
    int drop = S::SM - F::MBITS + (ue < emin ? emin - ue : 0);
    if (drop > S::SM + 2) drop = S::SM + 2;             // m < 2^(SM+1) < half: rounds to zero
    U q = m >> drop;
    const U rem = m & (((U)1 << drop) - 1), half = (U)1 << (drop - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;   // a carry moves into the exponent field
    // normal: q holds the hidden bit, so (ue - emin) << MBITS plus q is the biased code
    return sign | (((unsigned)(ue > emin ? ue - emin : 0) << F::MBITS) + (unsigned)q);
}
template <class F> SF_HD unsigned char fp8_encode(float v) {
    return (unsigned char)fp8_round_bits<F, SrcF32>(sf_f32_bits(v), F::MAX_F32);
}
template <class F> SF_HD unsigned char fp8_encode(double v) {
    return (unsigned char)fp8_round_bits<F, SrcF64>(sf_f64_bits(v), F::MAX_F64);
}

// Exact decode (every fp8 value is a float32 and a float64); NaN codes give a NaN.
template <class F> SF_HD float fp8_decode_f32(unsigned code) {
    const unsigned sign = (code & 0x80u) << 24, a = code & 0x7Fu;
    const unsigned e = a >> F::MBITS, m = a & ((1u << F::MBITS) - 1);
    if (F::is_nan(a)) return sf_f32_from(0x7FFFFFFFu);
    if (F::is_inf(a)) return sf_f32_from(sign | 0x7F800000u);
    if (e == 0)       // zero or subnormal: m * 2^(1 - BIAS - MBITS), exact
        return sf_f32_from(sign | sf_f32_bits((float)m * sf_f32_from((unsigned)(128 - F::BIAS - F::MBITS) << 23)));
    return sf_f32_from(sign | ((e - F::BIAS + 127) << 23) | (m << (23 - F::MBITS)));
}
template <class F> SF_HD double fp8_decode_f64(unsigned code) {
    const unsigned long long sign = (unsigned long long)(code & 0x80u) << 56;
    const unsigned a = code & 0x7Fu, e = a >> F::MBITS, m = a & ((1u << F::MBITS) - 1);
    if (F::is_nan(a)) return sf_f64_from(0x7FFFFFFFFFFFFFFFull);
    if (F::is_inf(a)) return sf_f64_from(sign | 0x7FF0000000000000ull);
    if (e == 0)
        return sf_f64_from(sign | sf_f64_bits((double)m * sf_f64_from((unsigned long long)(1024 - F::BIAS - F::MBITS) << 52)));
    return sf_f64_from(sign | ((unsigned long long)(e - F::BIAS + 1023) << 52) | ((unsigned long long)m << (52 - F::MBITS)));
}

// -- e8m0 block scales (OCP MX): the scale is 2^e, stored as the byte e + 127 (255 = NaN) ----------
// floor(log2(a)) of a >= 0, exactly; -2^20 for 0 and +2^20 for inf/NaN (both clamp below).
SF_HD int sf_floor_log2(float a) {
    const unsigned b = sf_f32_bits(a) & 0x7FFFFFFFu;
    if (b >= 0x7F800000u) return 1 << 20;
    if (b >= 0x00800000u) return (int)(b >> 23) - 127;
    return b ? (31 - sf_clz32(b)) - 149 : -(1 << 20);
}
SF_HD int sf_floor_log2(double a) {
    const unsigned long long b = sf_f64_bits(a) & 0x7FFFFFFFFFFFFFFFull;
    if (b >= 0x7FF0000000000000ull) return 1 << 20;
    if (b >= 0x0010000000000000ull) return (int)(b >> 52) - 1023;
    return b ? (63 - sf_clz64(b)) - 1074 : -(1 << 20);
}
// The MX rule (docs/numerics.md): e = floor(log2(amax)) - emax_elem, clamped to [-127, 127], stored as e + 127.
template <class F, typename M> SF_HD unsigned char e8m0_from_amax(M amax) {
    int e = sf_floor_log2(amax) - F::EMAX;
    e = e < -127 ? -127 : (e > 127 ? 127 : e);
    return (unsigned char)(e + 127);
}
// 2^(code - 127), exact: float32 reaches 2^-127 as a subnormal.
SF_HD float e8m0_to_f32(unsigned code) {
    if (code == 255u) return sf_f32_from(0x7FFFFFFFu);
    return sf_f32_from(code ? code << 23 : 0x00400000u);
}
SF_HD double e8m0_to_f64(unsigned code) {
    if (code == 255u) return sf_f64_from(0x7FFFFFFFFFFFFFFFull);
    return sf_f64_from((unsigned long long)(code + 896u) << 52);   // 896 = 1023 - 127
}

// -- packed int4: element 2i in the low nibble, 2i + 1 in the high nibble ----------------------------
SF_HD unsigned char int4_pack(int lo, int hi) { return (unsigned char)(((unsigned)lo & 0xFu) | (((unsigned)hi & 0xFu) << 4)); }
SF_HD int s4_lo(unsigned b) { return (int)(b << 28) >> 28; }   // arithmetic shifts sign-extend
SF_HD int s4_hi(unsigned b) { return (int)(b << 24) >> 28; }
SF_HD int u4_lo(unsigned b) { return (int)(b & 0xFu); }
SF_HD int u4_hi(unsigned b) { return (int)((b >> 4) & 0xFu); }

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
// -- sm_89+ conversion instructions (PTX ISA, cvt: .e4m3x2 / .e5m2x2) ----------------------------------
// cvt.rn.satfinite.<f8>x2.f32 d, a, b puts a in d[15:8] and b in d[7:0]; the same rounding,
// saturation and NaN code as fp8_encode above (tests/test_gpu_lowbit.py compares them on every
// float32). Templates: only sm89 kernels instantiate them, so sm_80 builds never see the opcodes.
template <class F> __device__ __forceinline__ unsigned fp8x2_encode_hw(float lo, float hi);
template <> __device__ __forceinline__ unsigned fp8x2_encode_hw<Fp8E4M3>(float lo, float hi) {
    unsigned short d; asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo)); return d;
}
template <> __device__ __forceinline__ unsigned fp8x2_encode_hw<Fp8E5M2>(float lo, float hi) {
    unsigned short d; asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo)); return d;
}
// cvt.rn.f16x2.<f8>x2 d, a: a[15:8] -> d[31:16], a[7:0] -> d[15:0] (exact), then f16 -> f32 (exact).
template <class F> __device__ __forceinline__ unsigned fp8x2_to_f16x2_hw(unsigned pair);
template <> __device__ __forceinline__ unsigned fp8x2_to_f16x2_hw<Fp8E4M3>(unsigned pair) {
    unsigned d; asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"((unsigned short)pair)); return d;
}
template <> __device__ __forceinline__ unsigned fp8x2_to_f16x2_hw<Fp8E5M2>(unsigned pair) {
    unsigned d; asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(d) : "h"((unsigned short)pair)); return d;
}
template <class F> __device__ __forceinline__ void fp8x2_decode_hw(unsigned lo, unsigned hi, float& flo, float& fhi) {
    const unsigned h2 = fp8x2_to_f16x2_hw<F>((lo & 0xFFu) | ((hi & 0xFFu) << 8));
    asm("cvt.f32.f16 %0, %1;" : "=f"(flo) : "h"((unsigned short)(h2 & 0xFFFFu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(fhi) : "h"((unsigned short)(h2 >> 16)));
}
#endif
// ---- end of low-bit helpers ------------------------------------------------------------------
