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

// -- rounding and saturation (NaN handled by the caller: it never reaches a float->int cast) ----
__device__ __forceinline__ float  rne(float v)  { return rintf(v); }
__device__ __forceinline__ double rne(double v) { return rint(v); }
// Correctly rounded reciprocal: bit-identical to 1 / s in IEEE arithmetic (and to NumPy).
__device__ __forceinline__ float  recip(float v)  { return __frcp_rn(v); }
__device__ __forceinline__ double recip(double v) { return __drcp_rn(v); }
template <typename M> __device__ __forceinline__ M clamp_q(M v, M lo, M hi) { return v < lo ? lo : (v > hi ? hi : v); }
__device__ __forceinline__ bool is_nan(float v)  { return v != v; }
__device__ __forceinline__ bool is_nan(double v) { return v != v; }

// -- integer storage (the value is already clamped to the kind's range) -----------------------
template <typename Q> __device__ __forceinline__ Q to_q(int v) { return (Q)v; }
__device__ __forceinline__ int q_to_int(s8_t v) { return (int)v; }
__device__ __forceinline__ int q_to_int(u8_t v) { return (int)v; }

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
