// ---- skuforge backward from a bit mask (templates/quantization/mask_backward.cuh) ---------------
// fake_quantize_backward_from_mask, docs/numerics.md "Mask bits": dx = dy * bit, where bit j of byte b
// of a row of `mask` is element 8 * b + j of that row (fake_quantize(..., return_mask="bits")).
// A product, as PyTorch's `dy * mask`: a negative dy where the bit is 0 gives -0, a non-finite dy NaN.
// A rows x cols view (strided rows, contiguous last axis), grid-stride over rows.
// Vector path (vec_ok: cols % 8 == 0 and dy / dx rows aligned to 16 bytes): a thread takes U vectors
// of 8 elements of a row (16-byte accesses of dy and dx) and one mask byte for each. Scalar path (any
// shape and alignment): a thread takes 8 consecutive elements and their one mask byte.
// Math in M (double for f64), storage T; VEC: the elements a mask byte holds; U: vectors in flight
// per thread.
namespace mask_bits {

template <typename M, int VEC, int U, typename T>
__device__ __forceinline__ void backward(const T* dy, i64_t dy_rs, const u8_t* mask, i64_t mask_rs, T* dx, i64_t dx_rs,
                                         i64_t rows, i64_t cols, int vec_ok)
{
    static_assert(VEC == 8, "one mask byte a vector");
    const int TX = blockDim.x, TY = blockDim.y;
    const i64_t row0 = (i64_t)blockIdx.x * TY + threadIdx.y, row_step = (i64_t)gridDim.x * TY;
    for (i64_t row = row0; row < rows; row += row_step) {
        const T* dy_row = dy + row * dy_rs;
        const u8_t* mask_row = mask + row * mask_rs;
        T* dx_row = dx + row * dx_rs;
        if (vec_ok) {
            for (i64_t c0 = (i64_t)threadIdx.x * VEC; c0 < cols; c0 += (i64_t)TX * VEC * U) {
                Vec<T, VEC> dy_v[U];
                u32_t m[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const i64_t c = c0 + (i64_t)u * TX * VEC;
                    if (c < cols) {
                        dy_v[u] = load_vec<T, VEC>(dy_row + c);
                        m[u] = __ldg(mask_row + (c >> 3));
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const i64_t c = c0 + (i64_t)u * TX * VEC;
                    if (c >= cols) break;
                    Vec<T, VEC> dx_o;
#pragma unroll
                    for (int i = 0; i < VEC; ++i)
                        dx_o.v[i] = from_math<T>(to_math<M>(dy_v[u].v[i]) * (M)((m[u] >> i) & 1u));
                    store_vec<T, VEC>(dx_row + c, dx_o);
                }
            }
        } else {
            for (i64_t c0 = (i64_t)threadIdx.x * 8; c0 < cols; c0 += (i64_t)TX * 8) {
                const u32_t m = mask_row[c0 >> 3];
#pragma unroll 1
                for (int i = 0; i < 8 && c0 + i < cols; ++i)
                    dx_row[c0 + i] = from_math<T>(to_math<M>(dy_row[c0 + i]) * (M)((m >> i) & 1u));
            }
        }
    }
}

}  // namespace mask_bits
// ---- end of backward from a bit mask ------------------------------------------------------------
