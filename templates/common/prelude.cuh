// ---- skuforge device helpers (templates/common/prelude.cuh) -------------------------------
// Self-contained: no CUDA headers, so NVRTC needs no include path and compiles fast.
// Storage types are tagged structs so that overloads tell bf16 from f16.
typedef signed char        s8_t;
typedef unsigned char      u8_t;
typedef int                i32_t;
typedef unsigned int       u32_t;
typedef long long          i64_t;
typedef unsigned long long u64_t;
struct __align__(2) bf16_t { unsigned short bits; };
struct __align__(2) f16_t  { unsigned short bits; };

// -- element conversion: storage -> math precision ---------------------------------------------
__device__ __forceinline__ float  to_f32(float v)  { return v; }
__device__ __forceinline__ float  to_f32(double v) { return (float)v; }
__device__ __forceinline__ float  to_f32(bf16_t v) { return __uint_as_float(((unsigned)v.bits) << 16); }
__device__ __forceinline__ float  to_f32(f16_t v)  { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits)); return f; }
__device__ __forceinline__ double to_f64(double v) { return v; }

// -- element conversion: math precision -> storage, round to nearest even once -----------------
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float  from_f32<float>(float v)  { return v; }
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float v) { bf16_t r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v)); return r; }
template <> __device__ __forceinline__ f16_t  from_f32<f16_t>(float v)  { f16_t r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v)); return r; }
template <typename T> __device__ __forceinline__ T from_f64(double v);
template <> __device__ __forceinline__ double from_f64<double>(double v) { return v; }

// -- the scope axis of a quantization kernel's parameters (runtime/axes.py SCOPES) ----------------
enum class Scope { tensor, token, group, channel };

// -- compile-time type tests, and the conversions of a kernel templated on its math precision M ----
template <typename A, typename B> constexpr bool same_type = false;
template <typename A> constexpr bool same_type<A, A> = true;
template <typename M, typename T> __device__ __forceinline__ M to_math(T v) {   // storage -> M
    if constexpr (same_type<M, double>) return to_f64(v); else return to_f32(v);
}
template <typename T, typename M> __device__ __forceinline__ T from_math(M v) { // M -> storage, rounded once
    if constexpr (same_type<M, double>) return from_f64<T>(v); else return from_f32<T>(v);
}

// -- rounding and saturation (NaN handled by the caller: it never reaches a float->int cast) ----
__device__ __forceinline__ float  rne(float v)  { return rintf(v); }
__device__ __forceinline__ double rne(double v) { return rint(v); }
// Correctly rounded reciprocal: bit-identical to 1 / s in IEEE arithmetic (and to NumPy).
__device__ __forceinline__ float  recip(float v)  { return __frcp_rn(v); }
__device__ __forceinline__ double recip(double v) { return __drcp_rn(v); }
template <typename M> __device__ __forceinline__ M clamp_q(M v, M lo, M hi) { return v < lo ? lo : (v > hi ? hi : v); }
__device__ __forceinline__ bool is_nan(float v)  { return v != v; }
__device__ __forceinline__ bool is_nan(double v) { return v != v; }
// IEEE maxNum / minNum (one FMNMX): a NaN operand is ignored (the reductions ignore NaN, docs/numerics.md).
__device__ __forceinline__ float  vmax(float a, float b)   { return fmaxf(a, b); }
__device__ __forceinline__ double vmax(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float  vmin(float a, float b)   { return fminf(a, b); }
__device__ __forceinline__ double vmin(double a, double b) { return fmin(a, b); }
__device__ __forceinline__ float  vabs(float a)  { return fabsf(a); }
__device__ __forceinline__ double vabs(double a) { return fabs(a); }
// NaN-propagating max / min (one FMNMX.NAN on sm_80+; f64 has no such instruction).
__device__ __forceinline__ float vmax_nan(float a, float b) { float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float vmin_nan(float a, float b) { float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ double vmax_nan(double a, double b) { return a != a ? a : (b != b ? b : fmax(a, b)); }
__device__ __forceinline__ double vmin_nan(double a, double b) { return a != a ? a : (b != b ? b : fmin(a, b)); }

// -- rounding to integers without a conversion instruction ------------------------------------
// cvt (F2I, I2F, FRND) runs at a quarter of the FP32 rate on sm_80 / sm_90, and an element of a
// 16-bit tensor leaves time for about 20 instructions at full memory bandwidth: one or two cvts per
// element made those kernels issue-bound (docs/perf-notes.md, ncu + SASS). Adding MAGIC = 1.5 * 2^p
// (p: stored mantissa bits) to |v| <= 2^(p-1) rounds once, to nearest even, to an integer that sits
// in the low mantissa bits; MAGIC's low p - 1 bits are zero, so those bits are the integer's own.
constexpr float  RNE_MAGIC_F32 = 12582912.0f;          // 1.5 * 2^23: integers of |v| <= 2^22
constexpr double RNE_MAGIC_F64 = 6755399441055744.0;   // 1.5 * 2^52: integers of |v| <= 2^51
__device__ __forceinline__ float  rne_magic(float)  { return RNE_MAGIC_F32; }
__device__ __forceinline__ double rne_magic(double) { return RNE_MAGIC_F64; }
__device__ __forceinline__ int magic_low_bits(float v)  { return __float_as_int(v); }
__device__ __forceinline__ int magic_low_bits(double v) { return __double2loint(v); }
// rne(v) with two adds, exact for |v| <= 2^22 (2^51 for double). A larger |v| gives a value of v's
// sign and magnitude >= 2^22, not rne(v): enough for a clamp to, or a test against, a quantized
// range (|qmin|, |qmax| < 2^22). NaN stays NaN, +-inf stay.
template <typename M> __device__ __forceinline__ M rne_bounded(M v) { return (v + rne_magic(v)) - rne_magic(v); }

// The integer range of t = x * inv before the zero point is added: [qmin - zp, qmax - zp].
template <typename M> struct QuantBounds { M lo, hi; int zp; };
template <typename M> __device__ __forceinline__ QuantBounds<M> quant_bounds(int zp, int qmin, int qmax) {
    return QuantBounds<M>{(M)(qmin - zp), (M)(qmax - zp), zp};
}
// q = clamp(rne(t) + zp, qmin, qmax), NaN -> zp, as an int whose low 8 bits are the code's byte (its
// low 4 bits the int4 nibble); the upper bits are not the value. Clamping t to the integer bounds
// before rounding equals clamping after it (rne is monotone and keeps integers), and a clamped t is
// small enough for the magic add. No cvt: 2 FMNMX, 1 FADD, 1 IADD and a NaN select.
// CHECKED = false: the caller knows that t is not NaN and that rne(t) lies in [b.lo, b.hi]
// (clamp_free, and a NaN-propagating reduction that found none): 1 FADD and 1 IADD.
template <bool CHECKED = true, typename M> __device__ __forceinline__ int quant_code_bits(M t, const QuantBounds<M>& b) {
    const M c = CHECKED ? vmin(vmax(t, b.lo), b.hi) : t;                 // NaN: b.lo, selected away
    const int bits = magic_low_bits(c + rne_magic(t)) + b.zp;
    return CHECKED && is_nan(t) ? b.zp : bits;
}
// Whether every x in [lo, hi] quantizes inside the bounds, so that the clamp can be left out: the
// dynamic kernels know their slice's range before they quantize it, and x * inv is monotone in x.
// False for non-finite products (inv = inf after a tiny scale, an infinite range) and NaN.
template <typename M> __device__ __forceinline__ bool clamp_free(M lo, M hi, M inv, const QuantBounds<M>& b) {
    return rne_bounded(lo * inv) >= b.lo && rne_bounded(hi * inv) <= b.hi;
}

// -- integer storage (the value is already clamped to the kind's range) -----------------------
template <typename Q> __device__ __forceinline__ Q to_q(int v) { return (Q)v; }
__device__ __forceinline__ int q_to_int(s8_t v) { return (int)v; }
__device__ __forceinline__ int q_to_int(u8_t v) { return (int)v; }

// -- device-side value checks (runtime/status.py, docs/errors.md) ------------------------------
// A scale element is valid when its scale is positive and finite (s - s is 0 only for finite s)
// and, asymmetric, its zero point lies in [qmin, qmax]. An invalid one writes its code to the
// status word (mapped host memory, read by the host without a sync) and poisons its outputs.
// status == null: no check (parameters the runtime computed itself).
// param_invalid: the test alone (no status write), for a kernel that checks its rows as it goes and
// records and poisons them in a second sweep only when one failed.
template <bool ASYM, typename M>
__device__ __forceinline__ bool param_invalid(M s, int zp, int qmin, int qmax) {
    return !(s > (M)0 && s - s == (M)0) || (ASYM && (zp < qmin || zp > qmax));
}
template <bool ASYM, typename M>
__device__ __forceinline__ bool param_bad(u32_t* status, M s, int zp, int qmin, int qmax, u32_t bad_scale, u32_t bad_zp) {
    if (!status) return false;
    const bool s_bad = !(s > (M)0 && s - s == (M)0);
    const bool z_bad = ASYM && (zp < qmin || zp > qmax);
    if (s_bad || z_bad) *(volatile u32_t*)status = s_bad ? bad_scale : bad_zp;
    return s_bad || z_bad;
}
// The quiet NaN of the math precision: the poison of floating outputs.
template <typename M> __device__ __forceinline__ M poison_nan();
template <> __device__ __forceinline__ float  poison_nan<float>()  { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double poison_nan<double>() { return __longlong_as_double(0x7ff8000000000000ll); }

// -- index arithmetic ---------------------------------------------------------------------------
// (row / inner) % count: the channel of a row in a rows x cols view; 32-bit division when the
// caller says every operand fits (several times cheaper than 64-bit).
__device__ __forceinline__ i64_t channel_of(i64_t row, i64_t inner, i64_t count, bool narrow) {
    return narrow ? (i64_t)((u32_t)row / (u32_t)inner % (u32_t)count) : (row / inner) % count;
}

// -- vector memory access: N elements per thread, moved as 16/8/4-byte words ------------------
template <typename T, int N> struct __align__(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Vec { T v[N]; };

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
    Vec<T, N> r;
    constexpr int BYTES = sizeof(T) * N;
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) reinterpret_cast<uint4*>(&r)[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
    } else if constexpr (BYTES == 8) {
        *reinterpret_cast<uint2*>(&r) = __ldg(reinterpret_cast<const uint2*>(p));
    } else if constexpr (BYTES == 4) {
        *reinterpret_cast<unsigned*>(&r) = __ldg(reinterpret_cast<const unsigned*>(p));
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) r.v[i] = p[i];
    }
    return r;
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& r) {
    constexpr int BYTES = sizeof(T) * N;
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<const uint4*>(&r)[i];
    } else if constexpr (BYTES == 8) {
        *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(&r);
    } else if constexpr (BYTES == 4) {
        *reinterpret_cast<unsigned*>(p) = *reinterpret_cast<const unsigned*>(&r);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = r.v[i];
    }
}

// Element i of a vector, read from the 32-bit word that holds it. A vector of 1-byte codes read
// element by element is split by the compiler into one register per code right at the load
// (dequantize: 8 registers per 8-byte load, 74 registers per thread, 3 blocks per SM); read through
// its words, it stays in words until each code is used (40 registers). For 2-byte elements the
// compiler does well without it (the quantize kernels gained registers through it).
template <typename T, int N> __device__ __forceinline__ T vec_at(const Vec<T, N>& v, int i) {
    if constexpr (sizeof(T) >= 4 || sizeof(T) * N % 4 != 0) {
        return v.v[i];
    } else {
        constexpr int PER = 4 / sizeof(T);
        const u32_t w = reinterpret_cast<const u32_t*>(&v)[i / PER] >> (8 * sizeof(T) * (i % PER));
        return *reinterpret_cast<const T*>(&w);   // its low bytes (little endian)
    }
}

// -- warp / block reductions (fixed order: the same bits on every run) ------------------------
template <typename M, typename Op>
__device__ __forceinline__ M warp_reduce(M v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Reduces over all threads of the block; every thread gets the result. `smem` holds 32 slots.
template <typename M, typename Op>
__device__ __forceinline__ M block_reduce(M v, Op op, M identity, M* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = lane < nwarps ? smem[lane] : identity;
    return warp_reduce(v, op);
}
// ---- end of helpers ---------------------------------------------------------------------------
