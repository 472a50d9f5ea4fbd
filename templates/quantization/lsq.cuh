// ---- skuforge LSQ backward (templates/quantization/lsq.cuh) ---------------------------------------
// fake_quantize_learnable_backward (LSQ), docs/numerics.md, with PyTorch's per-element terms
// (_fake_quantize_learnable_per_{tensor,channel}_affine_backward), g = grad_factor:
//     v = rne(x * inv) + zp,  dx = dy * (qmin <= v <= qmax)
//     v < qmin:   ds = (dy * (qmin - zp)) * g,               dz = (-dy * scale) * g
//     v > qmax:   ds = (dy * (qmax - zp)) * g,               dz = (-dy * scale) * g
//     otherwise:  ds = ((dy * ((clamp(v) - zp) * scale - x)) * inv) * g,  dz = 0
// ds and dz are summed per scale element in one fixed order (docs/training.md; the NumPy
// reference runtime.reference.lsq_* follows it step by step), never with atomics:
//   segment pass  a team of `team` lanes per (row, segment): lane l adds the vectors
//                 l, l + team, ... (VEC elements each, in order) to a sum that starts at +0;
//                 the lanes are combined by a halving tree over the 32 lanes of a warp
//                 (s[i] += s[i + o], o = 16 .. 1), then by one over the team's warps.
//   tile pass     (channel scope, channel = last axis) per column, the rows of each tile of
//                 `tile_rows` rows are added in order.
//   finish pass   (tensor, channel) the partials of one scale element, items j in order,
//                 with the same team scheme (kernel <symbol>_finish).
// `team` and `tile_rows` follow from the problem's shape alone, so the bits do not depend on
// the grid size or the alignment of the arrays.
// Value checks (runtime/status.py, docs/training.md): `status` non-null, each scale element is
// checked as it is loaded (param_bad: scale positive and finite; asymmetric: zero point in
// [qmin, qmax]). An invalid one writes BAD_SCALE / BAD_ZP to the status word and poisons what
// depends on it: its elements take dy = NaN, so dx = NaN and every ds term is NaN, and (asymmetric)
// each of its elements also adds NaN to the dz sum; every partial and sum of that scale element
// then holds at least one NaN term, so ds and dz are NaN whatever the reduction order. A null
// status checks nothing: the results are those of the unchecked kernel, bit for bit.
// Math in M (float64 for f64 inputs), storage T; ASYM: asymmetric (a zero point, the dz sums).
namespace lsq {


// One element: reads x and dy (dy only for a valid scale element), writes dx, adds its terms to the
// two sums. Its operands are references to the caller's values (the compiler sees the same
// expressions as in the caller's loop).
template <bool ASYM, typename M, typename T>
__device__ __forceinline__ void term(const T& xe, const T& dye, T& dxe, const M& s, const M& inv, const int& zp, M& acc_s,
                                     M& acc_z, const bool& bad, const M& qlo, const M& qhi, int qmin, int qmax, M grad_factor) {
    const M xv = to_math<M>(xe);
    const M gv = bad ? poison_nan<M>() : to_math<M>(dye);   // NaN: invalid scale element
    const M v = rne_bounded(xv * inv) + (M)zp;   // only compared or clamped
    dxe = from_math<T>(gv * ((v >= qlo && v <= qhi) ? (M)1 : (M)0));
    if (v < qlo || v > qhi) {
        acc_s = acc_s + (gv * (M)((v < qlo ? qmin : qmax) - zp)) * grad_factor;
        if constexpr (ASYM) acc_z = acc_z + ((-gv) * s) * grad_factor;
    } else {
        acc_s = acc_s + ((gv * ((clamp_q(v, qlo, qhi) - (M)zp) * s - xv)) * inv) * grad_factor;
        if constexpr (ASYM) {
            if (bad) acc_z = acc_z + gv;   // in range: dz term 0, but poisoned
        }
    }
}

// Combines the sums of a team's lanes (all threads of the block call it: uniform loops).
template <bool ASYM, typename M>
__device__ __forceinline__ void team_sum(M& acc_s, M& acc_z, M* sh_s, M* sh_z, int team, int lane) {
    const int wl = team < 32 ? team : 32;
    for (int o = wl >> 1; o > 0; o >>= 1) {
        acc_s = acc_s + __shfl_xor_sync(0xffffffffu, acc_s, o);
        if constexpr (ASYM) acc_z = acc_z + __shfl_xor_sync(0xffffffffu, acc_z, o);
    }
    if (team > 32) {
        const int warp = threadIdx.x >> 5, nw = team >> 5;
        __syncthreads();
        if ((threadIdx.x & 31) == 0) {
            sh_s[warp] = acc_s;
            if constexpr (ASYM) sh_z[warp] = acc_z;
        }
        __syncthreads();
        if (lane == 0) {
            M ts[8];
            M tz[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                ts[i] = i < nw ? sh_s[warp + i] : (M)0;
                if constexpr (ASYM) tz[i] = i < nw ? sh_z[warp + i] : (M)0;
            }
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) {
                if (o < nw) {
#pragma unroll
                    for (int i = 0; i < o; ++i) {
                        ts[i] = ts[i] + ts[i + o];
                        if constexpr (ASYM) tz[i] = tz[i] + tz[i + o];
                    }
                }
            }
            acc_s = ts[0];
            if constexpr (ASYM) acc_z = tz[0];
        }
    }
}

// The element pass (the SKU's symbol): the tile pass (channel on the last axis), else the segment
// pass; its parameters are the entry point's.
template <Scope S, bool ASYM, int VEC, u32_t BAD_SCALE, u32_t BAD_ZP, typename T, typename M>
__device__ __forceinline__ void backward(
    const T* dy, i64_t dy_rs, const T* x, i64_t x_rs, T* dx, i64_t dx_rs, const M* scale, M scale_value,
    const i32_t* zero_point, int zp_value, M* ds, float* dz, M* ds_part, M* dz_part, i64_t rows, i64_t cols,
    i64_t seg_len, i64_t chan_inner, i64_t chan_count, int chan_last, int team, i64_t tile_rows, int qmin,
    int qmax, M grad_factor, int vec_ok, u32_t* status)
{
    const M qlo = (M)qmin, qhi = (M)qmax;
    __shared__ M sh_s[8];
    __shared__ M sh_z[ASYM ? 8 : 1];
    if constexpr (S == Scope::channel) {
        if (chan_last) {
            // Tile pass: a thread owns VEC columns of one tile of rows and sums them down the rows.
            const i64_t ncv = (cols + VEC - 1) / VEC;
            const i64_t ntiles = (rows + tile_rows - 1) / tile_rows;
            for (i64_t w = (i64_t)blockIdx.x * blockDim.x + threadIdx.x; w < ntiles * ncv;
                 w += (i64_t)gridDim.x * blockDim.x) {
                const i64_t tile = w / ncv, c0 = (w - tile * ncv) * VEC;
                const int n = (int)(cols - c0 < VEC ? cols - c0 : VEC);
                M s[VEC], inv[VEC], acc_s[VEC], acc_z[VEC];
                int zp[VEC];
                bool bad[VEC];
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    const i64_t sidx = c0 + (i < n ? i : 0);
                    s[i] = scale ? scale[sidx] : scale_value;
                    inv[i] = recip(s[i]);   // correctly rounded: 1 / s
                    if constexpr (ASYM) zp[i] = zero_point ? zero_point[sidx] : zp_value;
                    else zp[i] = zp_value;
                    bad[i] = param_bad<ASYM>(status, s[i], zp[i], qmin, qmax, BAD_SCALE, BAD_ZP);
                    acc_s[i] = 0;
                    acc_z[i] = 0;
                }
                const i64_t r1 = (tile + 1) * tile_rows < rows ? (tile + 1) * tile_rows : rows;
                for (i64_t row = tile * tile_rows; row < r1; ++row) {
                    const T* dy_r = dy + row * dy_rs + c0;
                    const T* x_r = x + row * x_rs + c0;
                    T* dx_r = dx + row * dx_rs + c0;
                    if (vec_ok) {   // cols % VEC == 0 and every row start aligned: n == VEC
                        const Vec<T, VEC> dyv = load_vec<T, VEC>(dy_r), xv4 = load_vec<T, VEC>(x_r);
                        Vec<T, VEC> dxv;
#pragma unroll
                        for (int i = 0; i < VEC; ++i)
                            term<ASYM>(xv4.v[i], dyv.v[i], dxv.v[i], s[i], inv[i], zp[i], acc_s[i], acc_z[i], bad[i],
                                       qlo, qhi, qmin, qmax, grad_factor);
                        store_vec<T, VEC>(dx_r, dxv);
                    } else {
#pragma unroll
                        for (int i = 0; i < VEC; ++i) {
                            if (i < n)
                                term<ASYM>(x_r[i], dy_r[i], dx_r[i], s[i], inv[i], zp[i], acc_s[i], acc_z[i], bad[i],
                                           qlo, qhi, qmin, qmax, grad_factor);
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < VEC; ++i) {   // constant indices: the sums stay in registers
                    if (i < n) {
                        ds_part[tile * cols + c0 + i] = acc_s[i];
                        if constexpr (ASYM) dz_part[tile * cols + c0 + i] = acc_z[i];
                    }
                }
            }
            return;
        }
    }
    // Segment pass: a team of `team` lanes per (row, segment); the loop is uniform per block.
    const int lane = threadIdx.x & (team - 1);
    const int teams = blockDim.x / team;
    const i64_t nseg = cols / seg_len;
    const i64_t items = rows * nseg;
    const i64_t nvec = (seg_len + VEC - 1) / VEC;
    for (i64_t base = (i64_t)blockIdx.x * teams; base < items; base += (i64_t)gridDim.x * teams) {
        const i64_t item = base + threadIdx.x / team;
        M acc_s = 0, acc_z = 0;
        if (item < items) {
            i64_t row, c0, sidx;
            if constexpr (S == Scope::group) {
                row = item / nseg, c0 = (item - row * nseg) * seg_len;
            } else {
                row = item, c0 = 0;   // one segment per row (seg_len == cols)
            }
            if constexpr (S == Scope::tensor) sidx = 0;
            else if constexpr (S == Scope::token) sidx = row;
            else if constexpr (S == Scope::group) sidx = item;
            else sidx = (row / chan_inner) % chan_count;
            const M s = scale ? scale[sidx] : scale_value;
            const M inv = recip(s);   // correctly rounded: 1 / s
            int zp;
            if constexpr (ASYM) zp = zero_point ? zero_point[sidx] : zp_value;
            else zp = zp_value;  // symmetric: the implied zero point
            const bool bad = param_bad<ASYM>(status, s, zp, qmin, qmax, BAD_SCALE, BAD_ZP);
            const T* dy_r = dy + row * dy_rs + c0;
            const T* x_r = x + row * x_rs + c0;
            T* dx_r = dx + row * dx_rs + c0;
            for (i64_t j = lane; j < nvec; j += team) {
                const i64_t c = j * VEC;
                if (vec_ok) {   // seg_len % VEC == 0 and every segment start aligned
                    const Vec<T, VEC> dyv = load_vec<T, VEC>(dy_r + c), xv4 = load_vec<T, VEC>(x_r + c);
                    Vec<T, VEC> dxv;
#pragma unroll
                    for (int i = 0; i < VEC; ++i)
                        term<ASYM>(xv4.v[i], dyv.v[i], dxv.v[i], s, inv, zp, acc_s, acc_z, bad, qlo, qhi, qmin, qmax, grad_factor);
                    store_vec<T, VEC>(dx_r + c, dxv);
                } else {
                    const int n = (int)(seg_len - c < VEC ? seg_len - c : VEC);
                    for (int i = 0; i < n; ++i)
                        term<ASYM>(x_r[c + i], dy_r[c + i], dx_r[c + i], s, inv, zp, acc_s, acc_z, bad, qlo, qhi, qmin, qmax, grad_factor);
                }
            }
        }
        team_sum<ASYM>(acc_s, acc_z, sh_s, sh_z, team, lane);
        if (lane == 0 && item < items) {
            if constexpr (S == Scope::token || S == Scope::group) {
                ds[item] = acc_s;
                if constexpr (ASYM) dz[item] = (float)acc_z;
            } else {
                ds_part[item] = acc_s;
                if constexpr (ASYM) dz_part[item] = acc_z;
            }
        }
    }
}

// The finish pass (tensor, channel: <symbol>_finish): output o sums the partials
// p = ((j / inner) * count + o) * inner + j % inner, j = 0 .. n_items - 1, with the team scheme of the
// segment pass.
template <bool ASYM, typename M>
__device__ __forceinline__ void finish(const M* ds_part, const M* dz_part, M* ds, float* dz, i64_t count, i64_t inner,
                                       i64_t n_items, int team)
{
    __shared__ M sh_s[8];
    __shared__ M sh_z[ASYM ? 8 : 1];
    const int lane = threadIdx.x & (team - 1);
    const int teams = blockDim.x / team;
    for (i64_t base = (i64_t)blockIdx.x * teams; base < count; base += (i64_t)gridDim.x * teams) {
        const i64_t out = base + threadIdx.x / team;
        M acc_s = 0, acc_z = 0;
        if (out < count) {
            for (i64_t j = lane; j < n_items; j += team) {
                const i64_t p = ((j / inner) * count + out) * inner + j % inner;
                acc_s = acc_s + ds_part[p];
                if constexpr (ASYM) acc_z = acc_z + dz_part[p];
            }
        }
        team_sum<ASYM>(acc_s, acc_z, sh_s, sh_z, team, lane);
        if (lane == 0 && out < count) {
            ds[out] = acc_s;
            if constexpr (ASYM) dz[out] = (float)acc_z;
        }
    }
}

}  // namespace lsq
// ---- end of LSQ backward ------------------------------------------------------------------------
