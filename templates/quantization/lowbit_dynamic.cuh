// ---- skuforge low-bit dynamic quantization (templates/quantization/lowbit_dynamic.cuh) -----
// The fused per-token / per-group low-bit dynamic_quantize kernels (docs/lowbit.md), after
// templates/quantization/dynamic.cuh and lowbit_kernels.cuh: the structure of the s8 / u8 fused
// kernels (a row group = one scale element, TX threads each; its x stays in registers between the
// reduction and the quantize, so x is read once from DRAM), with packed low-bit stores (codes C:
// lowbit::Fp8 / lowbit::Int4) and, for fp8 group 32, MX e8m0 scales (MX; scale_e8m0 non-null: 2^e
// with e from the OCP floor rule). Vector path: V = VEC elements per 16-byte load. Scalar path (any
// alignment): V = PACK elements loaded one by one, one byte of q stored per step.
namespace lowbit {

template <int V, bool VIO, typename T>
__device__ __forceinline__ Vec<T, V> load_x(const T* p) {
    if constexpr (VIO) {
        return load_vec<T, V>(p);
    } else {
        Vec<T, V> r;
#pragma unroll
        for (int i = 0; i < V; ++i) r.v[i] = p[i];
        return r;
    }
}

// The block kernel's row groups. CH > 0: the thread's CH chunks of V elements stay in registers;
// CH == 0: loop over the row group, then read it a second time (from L2) to quantize.
template <class C, bool ASYM, bool MX, bool VIO> struct RowGroups {
    template <int V, int CH, typename T, typename M>
    static __device__ __forceinline__ void run(
        const T* __restrict__ x, i64_t x_rs, u8_t* __restrict__ q, i64_t q_rs,
        M* __restrict__ scale, u8_t* __restrict__ scale_e8m0, i32_t* __restrict__ zero_point, dyn::ParamAt at,
        i64_t vrows, i64_t ngroups, i64_t gs, M eps, int qmin, int qmax, int zp_value, M* smem)
    {
        constexpr int PACK = C::PACK;
        const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x;
        (void)scale_e8m0;
        // `base` is uniform over the block, so every thread reaches the barriers in row_reduce.
        for (i64_t base = (i64_t)blockIdx.x * TY; base < vrows; base += (i64_t)gridDim.x * TY) {
            const i64_t vr = base + threadIdx.y;   // row group index = row * ngroups + group
            const bool live = vr < vrows;
            const i64_t row = vr / ngroups, grp = vr - row * ngroups;
            const T* xr = x + row * x_rs + grp * gs;
            u8_t* qr = q + row * q_rs + grp * gs / PACK;
            Vec<T, V> buf[CH > 0 ? CH : 1];
            dyn::Acc<M> a = {(M)0, (M)0};
            if (live) {
                if constexpr (CH > 0) {
#pragma unroll
                    for (int j = 0; j < CH; ++j) {
                        const int c = (j * TX + tx) * V;   // < 512 * 16 * 8: int is enough here
                        if (c < gs) buf[j] = load_x<V, VIO>(xr + c);
                    }
#pragma unroll
                    for (int j = 0; j < CH; ++j) {
                        if ((j * TX + tx) * V < gs) {
#pragma unroll
                            for (int i = 0; i < V; ++i) dyn::accumulate<ASYM>(a, to_math<M>(buf[j].v[i]));
                        }
                    }
                } else {
                    for (i64_t c = (i64_t)tx * V; c < gs; c += (i64_t)TX * V) {
                        const Vec<T, V> v = load_x<V, VIO>(xr + c);
#pragma unroll
                        for (int i = 0; i < V; ++i) dyn::accumulate<ASYM>(a, to_math<M>(v.v[i]));
                    }
                }
            }
            if (ASYM) a.lo = dyn::row_reduce(a.lo, dyn::MinOp<M>(), smem);
            a.hi = dyn::row_reduce(a.hi, dyn::MaxOp<M>(), smem);
            M s;
            int zp;
            unsigned char e8 = 0;
            if constexpr (MX) {
                if (scale_e8m0) {                      // MX: scale = 2^(floor(log2(amax)) - emax_elem)
                    e8 = e8m0_from_amax<typename C::Format>(a.hi);
                    s = e8m0_to<M>(e8);
                    zp = zp_value;
                } else {
                    dyn::finish<ASYM>(a, eps, qmin, qmax, zp_value, s, zp);
                }
            } else {
                dyn::finish<ASYM>(a, eps, qmin, qmax, zp_value, s, zp);
            }
            const M inv = (M)1 / s;                // once per scale element, as the static kernel does
            if (live) {
                if (tx == 0) {
                    const i64_t pi = at.cell(row, grp);
                    if constexpr (MX) {
                        if (scale_e8m0) scale_e8m0[pi] = e8;
                        else scale[pi] = s;
                    } else {
                        scale[pi] = s;
                    }
                    if (ASYM) zero_point[pi] = zp;
                }
                QuantBounds<M> qv[V];
#pragma unroll
                for (int i = 0; i < V; ++i) qv[i] = quant_bounds<M>(zp, qmin, qmax);
                if constexpr (CH > 0) {
#pragma unroll
                    for (int j = 0; j < CH; ++j) {
                        const int c = (j * TX + tx) * V;
                        if (c < gs) {
                            M t[V];
#pragma unroll
                            for (int i = 0; i < V; ++i) t[i] = to_math<M>(buf[j].v[i]) * inv;
                            Vec<u8_t, V / PACK> o;
                            C::template encode_vec<V>(t, qv, o);
                            store_vec<u8_t, V / PACK>(qr + c / PACK, o);
                        }
                    }
                } else {
                    for (i64_t c = (i64_t)tx * V; c < gs; c += (i64_t)TX * V) {   // second read: L2
                        const Vec<T, V> v = load_x<V, VIO>(xr + c);
                        M t[V];
#pragma unroll
                        for (int i = 0; i < V; ++i) t[i] = to_math<M>(v.v[i]) * inv;
                        Vec<u8_t, V / PACK> o;
                        C::template encode_vec<V>(t, qv, o);
                        store_vec<u8_t, V / PACK>(qr + c / PACK, o);
                    }
                }
            }
        }
    }
};

// The block kernel: x rows x cols (row stride x_rs elements, last axis contiguous); q rows x
// cols / PACK bytes (row stride q_rs bytes); scale (or scale_e8m0 for MX) / zero_point rows x
// (cols / group_size), element (row, group) at row * p_rs + group * p_gs (dyn::ParamAt). vec_ok: group_size % VEC == 0 and x, q rows aligned (checked by
// the launcher). CHV / CHS: the chunk counts compiled for the vector / scalar path (dyn::Chunks).
template <class C, bool ASYM, bool MX, int VEC, class CHV, class CHS, typename T, typename M>
__device__ __forceinline__ void fused(
    const T* __restrict__ x, i64_t x_rs, u8_t* __restrict__ q, i64_t q_rs, M* __restrict__ scale,
    u8_t* __restrict__ scale_e8m0, i32_t* __restrict__ zero_point, i64_t p_rs, i64_t p_gs, i64_t rows, i64_t cols,
    i64_t group_size, M eps, int qmin, int qmax, int zp_value, int vec_ok)
{
    constexpr int PACK = C::PACK;
    __shared__ M smem[16];                     // one slot per warp of a 512-thread block
    const i64_t ngroups = cols / group_size, vrows = rows * ngroups;
    const dyn::ParamAt at{p_rs, p_gs};
    const int TX = blockDim.x;
    if (vec_ok) {
        const i64_t per = ((group_size + VEC - 1) / VEC + TX - 1) / TX;   // chunks per thread
        dyn::by_chunks<RowGroups<C, ASYM, MX, true>, VEC>(CHV(), per, x, x_rs, q, q_rs, scale, scale_e8m0, zero_point, at, vrows, ngroups, group_size, eps, qmin, qmax, zp_value, smem);
    } else {
        const i64_t per = ((group_size + PACK - 1) / PACK + TX - 1) / TX;
        dyn::by_chunks<RowGroups<C, ASYM, MX, false>, PACK>(CHS(), per, x, x_rs, q, q_rs, scale, scale_e8m0, zero_point, at, vrows, ngroups, group_size, eps, qmin, qmax, zp_value, smem);
    }
}

// -- the team kernels' pieces (dyn::team) ---------------------------------------------------------
// Where a row group's parameters go: (scale, zero point) of docs/numerics.md, or (MX, scale_e8m0
// set) the e8m0 code, stored at its place in their layout (dyn::ParamAt) by `lead`.
template <class C, bool ASYM, bool MX, typename M> struct Sink {
    M* scale; u8_t* scale_e8m0; i32_t* zero_point; dyn::ParamAt at; M eps; int qmin, qmax, zp_value;
    __device__ __forceinline__ M params(const dyn::Acc<M>& a, i64_t vr, i64_t ngroups, bool lead, int& zp) const {
        M s;
        if constexpr (MX) {
            if (scale_e8m0) {                      // MX: scale = 2^(floor(log2(amax)) - emax_elem)
                const unsigned char e8 = e8m0_from_amax<typename C::Format>(a.hi);
                s = e8m0_to<M>(e8);
                zp = zp_value;
                if (lead) scale_e8m0[at.row_group(vr, ngroups)] = e8;
                return s;
            }
        }
        dyn::finish<ASYM>(a, eps, qmin, qmax, zp_value, s, zp);
        if (lead) {
            const i64_t i = at.row_group(vr, ngroups);
            scale[i] = s;
            if (ASYM) zero_point[i] = zp;
        }
        return s;
    }
};

// The team kernels' codes: C with one chunk of V elements quantized and stored (V / PACK bytes of q).
template <class C> struct TeamCodes {
    static constexpr int PACK = C::PACK;
    static constexpr bool UNCHECKED_PATH = C::UNCHECKED_PATH;
    template <int V, bool CHECKED = true, typename T, typename M>
    static __device__ __forceinline__ void quant_store(u8_t* p, const Vec<T, V>& b, M inv, const QuantBounds<M>& qb) {
        M t[V];
        QuantBounds<M> qv[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
            t[i] = dyn::elem<M>(b, i) * inv;
            qv[i] = qb;
        }
        Vec<u8_t, V / PACK> o;
        C::template encode_vec<V, CHECKED>(t, qv, o);
        store_vec<u8_t, V / PACK>(p, o);
    }
};

}  // namespace lowbit
// ---- end of low-bit dynamic quantization kernels --------------------------------------------
