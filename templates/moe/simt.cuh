// ---- skuforge MoE grouped matmul, simt backend (templates/moe/simt.cuh) -----------------------
// The reference-grade path for every dtype and any shape or alignment. fp32 math on CUDA cores;
// tiles BM x BN, reduction steps of BK staged in shared memory as float; each of the 256 threads
// owns a 4 x 4 block of outputs (rows ty + 16 i, cols tx + 16 j). Each output is summed over the
// reduction in increasing order. The tile shape comes from the SKU's launch
// (codegen/families/moe/blocks.py MOE_TILES) as template arguments.
namespace moe {
namespace simt {

template <int BM, int BN, int BK>
__device__ __forceinline__ void fma_tile(float (&acc)[4][4], const float (*As)[BM + 1], const float (*Bs)[BN + 1],
                                         int tx, int ty) {
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
        float a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
}

template <class S, int BM, int BN, int BK, int THREADS>
__device__ void run(const Problem<S>& p) {
    static_assert(BM == 64 && BN == 64 && THREADS == 256, "4 x 4 outputs per thread");
    using T = typename S::T;
    using OutT = typename S::OutT;
    __shared__ float As[BK][BM + 1];   // reduction-major: As[r][row]
    __shared__ float Bs[BK][BN + 1];   // reduction-major: Bs[r][col]
    __shared__ i64_t rows_s[BM > BK ? BM : BK];
    __shared__ i64_t slot;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    if constexpr (S::PASS == WGRAD) {
        // dw[e, n, k]: tiles (e, n-tile, k-tile); reduction over the rows of expert e, in order.
        const i64_t tiles_n = (p.N + BM - 1) / BM, tiles_k = (p.K + BN - 1) / BN;
        const i64_t per_expert = tiles_n * tiles_k, total = (i64_t)p.E * per_expert;
        for (;;) {
            const i64_t t = next_tile(p.counter, &slot);
            if (t >= total) break;
            const int e = (int)(t / per_expert);
            const i64_t n0 = (t % per_expert) / tiles_k * BM, k0 = (t % per_expert) % tiles_k * BN;
            const i64_t p0 = p.row_start[e], p1 = p.row_start[e + 1];
            float acc[4][4] = {};
            for (i64_t q0 = p0; q0 < p1; q0 += BK) {
                if (tid < BK) rows_s[tid] = q0 + tid < p1 ? row_of(p, q0 + tid) : -1;
                __syncthreads();
                for (int idx = tid; idx < BK * BM; idx += THREADS) {
                    const int kk = idx / BM, i = idx % BM;
                    const i64_t r = rows_s[kk], n = n0 + i, kc = k0 + i;
                    As[kk][i] = (r >= 0 && n < p.N) ? to_f32(p.dy[r * p.lddy + n]) : 0.0f;
                    Bs[kk][i] = (r >= 0 && kc < p.K) ? to_f32(p.x[r * p.ldx + kc]) : 0.0f;
                }
                __syncthreads();
                fma_tile<BM, BN, BK>(acc, As, Bs, tx, ty);
                __syncthreads();
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const i64_t n = n0 + ty + 16 * i;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const i64_t kc = k0 + tx + 16 * j;
                    if (n < p.N && kc < p.K) p.out[((i64_t)e * p.N + n) * p.K + kc] = from_f32<OutT>(acc[i][j]);
                }
            }
        }
    } else {
        // FWD: y[m, n] = sum_k x[m, k] w[e, n, k]; DGRAD: dx[m, k] = sum_n dy[m, n] w[e, n, k]
        constexpr bool F = S::PASS == FWD;
        const T* A = F ? p.x : p.dy; const i64_t lda = F ? p.ldx : p.lddy;
        const i64_t R = F ? p.K : p.N, COLS = F ? p.N : p.K;
        const i64_t n_tiles = (COLS + BN - 1) / BN;
        const i64_t total = p.tile_start[p.E + 1] * n_tiles;
        for (;;) {
            const i64_t t = next_tile(p.counter, &slot);
            if (t >= total) break;
            const MTile mt = decode_mtile(p, t, n_tiles, BM);
            const i64_t c0 = mt.nt * BN;
            const int nrows = (int)(mt.p1 - mt.p0);
            if (tid < BM) rows_s[tid] = tid < nrows ? row_of(p, mt.p0 + tid) : -1;
            __syncthreads();
            if (mt.bucket == p.E) {   // padding rows: zeros
                zero_rows(p, rows_s, nrows, c0, BN, COLS);
                continue;
            }
            const T* B = p.w + (i64_t)mt.bucket * p.w_se;
            float acc[4][4] = {};
            for (i64_t r0 = 0; r0 < R; r0 += BK) {
                for (int idx = tid; idx < BK * BM; idx += THREADS) {
                    const int i = idx / BK, kk = idx % BK;    // consecutive threads walk the reduction
                    const i64_t row = rows_s[i], r = r0 + kk;
                    As[kk][i] = (row >= 0 && r < R) ? to_f32(A[row * lda + r]) : 0.0f;
                }
                for (int idx = tid; idx < BK * BN; idx += THREADS) {
                    if constexpr (F) {
                        const int j = idx / BK, kk = idx % BK;    // w[e, n, k]: k contiguous
                        const i64_t c = c0 + j, r = r0 + kk;
                        Bs[kk][j] = (c < COLS && r < R) ? to_f32(B[c * p.w_sn + r]) : 0.0f;
                    } else {
                        const int kk = idx / BN, j = idx % BN;    // w[e, n, k]: k (the output column) contiguous
                        const i64_t c = c0 + j, r = r0 + kk;
                        Bs[kk][j] = (c < COLS && r < R) ? to_f32(B[r * p.w_sn + c]) : 0.0f;
                    }
                }
                __syncthreads();
                fma_tile<BM, BN, BK>(acc, As, Bs, tx, ty);
                __syncthreads();
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const i64_t row = rows_s[ty + 16 * i];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const i64_t c = c0 + tx + 16 * j;
                    if (row >= 0 && c < COLS) p.out[row * COLS + c] = from_f32<OutT>(acc[i][j]);
                }
            }
        }
    }
}

}  // namespace simt
}  // namespace moe
// ---- end of MoE simt backend -----------------------------------------------------------------
