// ---- skuforge MoE grouped matmul, mma backend (templates/moe/mma.cuh) -------------------------
// sm_80+: tensor cores through mma.sync.aligned.m16n8k16 (f16/bf16 in, fp32 accumulate), fragments
// with ldmatrix (.trans for operands whose contiguous axis is the output axis), a STAGES-deep
// cp.async pipeline and XOR-swizzled shared memory (no bank conflicts for ldmatrix, no padding).
// One body, instantiated per tile configuration (launch["variants"], Tile<S, BM, BN, BK, STAGES, PIPE>):
// warps of 64 x 64 outputs in a (BM / 64) x (BN / 64) grid, so THREADS = 32 * BM * BN / 4096.
// PIPE: the fragments of the next k16 step are loaded while the current one is multiplied,
// across the stage boundary too (the barrier sits before the last k16 step of a slice).
// Operand layouts by pass: A is K-major for FWD and DGRAD (rows of x / dy), MN-major for WGRAD (dy);
// B is K-major for FWD (w[e] rows n), MN-major for DGRAD (w[e]) and WGRAD (x).
// Shared tiles per stage, 8-element (16-byte) chunks:
//   "K-major" [ROWS][BK]  : chunk (r, c) at r * BK + ((c ^ swz(r)) * 8),
//                           swz(r) = r & 7 (BK = 64) or (r >> 1) & 3 (BK = 32)
//   "MN-major" [BK][W]    : chunk (r, c) at r * W + ((c ^ (r & 7)) * 8), W = BM or BN
// Producers keep 64-bit row pointers in registers and advance them by a constant per slice:
// no per-slice 64-bit multiplies (the rows of an MN-major operand are consecutive, except
// for backward-weight with a row permutation, which reads it per slice).
// Needs (host-checked): the contiguous axis of every operand a multiple of 8 elements,
// 16-byte aligned base pointers and row strides.
namespace moe {
namespace mma {

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

template <class S, int BM_, int BN_, int BK_, int STAGES_, int PIPE_>
struct Tile {
    using T = typename S::T;
    static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_;
    static constexpr int PIPE = PIPE_;
    static constexpr int WARPS_N = BN / 64, THREADS = 32 * (BM / 64) * (BN / 64);
    static constexpr int KSTEPS = BK / 16;
    static constexpr int A_ELEMS = BM * BK, B_ELEMS = BN * BK, STAGE_ELEMS = A_ELEMS + B_ELEMS;
    static constexpr unsigned STAGE_BYTES = STAGE_ELEMS * sizeof(T), A_BYTES = A_ELEMS * sizeof(T);
    static constexpr bool A_KMAJ = S::PASS != WGRAD, B_KMAJ = S::PASS == FWD;   // operand layouts (above)
    static_assert(BM % 64 == 0 && BN % 64 == 0 && (BK == 32 || BK == 64) && STAGES >= 2 && PIPE >= 0 && PIPE <= 2,
                  "tile shape");
    static_assert(THREADS >= 128 && THREADS <= 256, "4 or 8 warps");
};

// Swizzled element offsets (see above).
template <int BK> __device__ __forceinline__ int kmaj_swz(int r) { return BK == 64 ? (r & 7) : ((r >> 1) & 3); }
template <int BK> __device__ __forceinline__ int kmaj_off(int r, int c) { return r * BK + ((c ^ kmaj_swz<BK>(r)) << 3); }
template <int W> __device__ __forceinline__ int mnmaj_off(int r, int c) { return r * W + ((c ^ (r & 7)) << 3); }

// Producer maps. K-major [ROWS][BK]: 4 threads a row, BK / 32 chunks each (c = kc + 4 j),
// rows kr0 + RPP i. MN-major [BK][W]: W / 8 threads a row, one chunk each (column cc), rows rr0 + RPP i.
// CHUNKS: the copies of one thread per slice.
template <int ROWS, int BK, int THREADS> struct KMap {
    static constexpr int KCOLS = BK / 32, RPP = THREADS / 4, PASSES = ROWS / RPP, CHUNKS = PASSES * KCOLS;
    static_assert(ROWS % RPP == 0 && RPP % 8 == 0, "K-major producer map");
};
template <int W, int BK, int THREADS> struct MNMap {
    static constexpr int WCH = W / 8, RPP = THREADS / WCH, PASSES = BK / RPP, CHUNKS = PASSES;
    static_assert(THREADS % WCH == 0 && BK % RPP == 0 && RPP % 8 == 0, "MN-major producer map");
};
template <bool K, class A, class B> struct PickMap { using type = A; };
template <class A, class B> struct PickMap<false, A, B> { using type = B; };

template <class T>
__device__ __forceinline__ void cp_async16(unsigned dst, const T* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// d += a b, inputs of type T (bf16_t or f16_t).
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (same_type<T, bf16_t>)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{ %0, %1, %2, %3}, { %4, %5, %6, %7}, { %8, %9}, { %0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{ %0, %1, %2, %3}, { %4, %5, %6, %7}, { %8, %9}, { %0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Per-lane byte offsets of the warp's ldmatrix reads inside a stage (stage-independent).
// K-major operand: one offset per k16 step (row, plus the chunk: its swizzle depends on the lane
// only; row block i adds 16 i rows). MN-major: one per 16-wide column block (step ks adds 16 ks rows).
template <class C>
struct Frag {
    using T = typename C::T;
    unsigned a_off[C::A_KMAJ ? C::KSTEPS : 4], b_off[C::B_KMAJ ? C::KSTEPS : 4];
    __device__ __forceinline__ Frag(int m_w, int n_w, int lane) {
        constexpr int BK = C::BK;
        const int li = lane & 7, lj = lane >> 3;
        if constexpr (C::A_KMAJ) {   // A: rows m_w + 16 mi + (lane & 15), chunk 2 ks + (lane >> 4)
            const int lr = lane & 15;
#pragma unroll
            for (int ks = 0; ks < C::KSTEPS; ++ks)
                a_off[ks] = (unsigned)(((m_w + lr) * BK + (((2 * ks + (lane >> 4)) ^ kmaj_swz<BK>(lr)) << 3)) * sizeof(T));
        } else {   // A (.trans): rows 16 ks + li + 8 (lj >> 1), chunk (m_w + 16 mi) / 8 + (lj & 1)
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
                a_off[mi] = (unsigned)(mnmaj_off<C::BM>(li + ((lj >> 1) << 3), ((m_w + 16 * mi) >> 3) + (lj & 1)) * sizeof(T));
        }
        if constexpr (C::B_KMAJ) {   // B: rows n_w + 16 np + li + 8 (lj >> 1), chunk 2 ks + (lj & 1)
            const int lr = li + ((lj >> 1) << 3);
#pragma unroll
            for (int ks = 0; ks < C::KSTEPS; ++ks)
                b_off[ks] = (unsigned)(((n_w + lr) * BK + (((2 * ks + (lj & 1)) ^ kmaj_swz<BK>(lr)) << 3)) * sizeof(T));
        } else {   // B (.trans): rows 16 ks + li + 8 (lj & 1), chunk (n_w + 16 np) / 8 + (lj >> 1)
#pragma unroll
            for (int np = 0; np < 4; ++np)
                b_off[np] = (unsigned)(mnmaj_off<C::BN>(li + ((lj & 1) << 3), ((n_w + 16 * np) >> 3) + (lj >> 1)) * sizeof(T));
        }
        (void)li; (void)lj; (void)BK; (void)m_w; (void)n_w;
    }

    // Fragments of k16 step ks of the stage at shared address sA (B follows A in the stage).
    __device__ __forceinline__ void load(unsigned (&a)[4][4], unsigned (&b)[4][4], unsigned sA, int ks) const {
        const unsigned sB = sA + C::A_BYTES;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            if constexpr (C::A_KMAJ) ldsm_x4(a[mi], sA + a_off[ks] + mi * 16 * C::BK * (unsigned)sizeof(T));
            else ldsm_x4_t(a[mi], sA + a_off[mi] + ks * 16 * C::BM * (unsigned)sizeof(T));
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            if constexpr (C::B_KMAJ) ldsm_x4(b[np], sB + b_off[ks] + np * 16 * C::BK * (unsigned)sizeof(T));
            else ldsm_x4_t(b[np], sB + b_off[np] + ks * 16 * C::BN * (unsigned)sizeof(T));
        }
    }
};

// One k16 step of the warp tile: 4 x 8 mma. hook(mi) runs after row mi: the producer's copies
// of the next slice are issued between the tensor-core instructions instead of before them.
template <class T, class Hook>
__device__ __forceinline__ void mma_step(float (&acc)[4][8][4], const unsigned (&a)[4][4], const unsigned (&b)[4][4],
                                         Hook& hook) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (int nj = 0; nj < 8; ++nj)
            mma16816<T>(acc[mi][nj], a[mi], b[nj >> 1][(nj & 1) * 2], b[nj >> 1][(nj & 1) * 2 + 1]);
        hook(mi);
    }
}

// The pipelined reduction over KT slices. load(stage_byte_offset, slice, piece): piece -1
// prepares a slice (per-slice scalars), pieces 0..3 issue its cp.async copies; slices 0, 1, 2, ...
// are loaded in that order, each exactly once (running pointers advance in piece 3).
//   PIPE 0: wait, barrier, the whole next slice, then fragments and mma of this slice.
//   PIPE 1: the same, but the copies of the next slice are interleaved with the mma of the
//           first k16 step (the tensor cores are not idle while the producer issues).
//   PIPE 2: as 1, and the fragments are double-buffered across k16 steps and slices: the
//           barrier precedes the last k16 step of a slice, whose mma then hide the ldmatrix
//           latency of the next slice's first step.
template <class C, class Load>
__device__ __forceinline__ void mainloop(float (&acc)[4][8][4], const Frag<C>& fr, unsigned s_base, int KT, Load& load) {
    using T = typename C::T;
    constexpr unsigned RING = C::STAGES * C::STAGE_BYTES;
    auto none = [](int) {};
#pragma unroll
    for (int s = 0; s < C::STAGES - 1; ++s) {
        if (s < KT) {
#pragma unroll
            for (int q = -1; q < 4; ++q) load(s * C::STAGE_BYTES, s, q);
        }
        cp_async_commit();
    }
    unsigned rd = 0, wr = (C::STAGES - 1) * C::STAGE_BYTES;   // byte offsets of the slots read / written next
    if constexpr (C::PIPE == 2) {
        unsigned a[2][4][4], b[2][4][4];
        cp_async_wait<C::STAGES - 2>();
        __syncthreads();
        if (KT > 0) fr.load(a[0], b[0], s_base + rd, 0);
        for (int kt = 0; kt < KT; ++kt) {
            const int nk = kt + C::STAGES - 1;
            const bool issue = nk < KT;
#pragma unroll
            for (int ks = 0; ks < C::KSTEPS; ++ks) {
                if (ks == C::KSTEPS - 1) {
                    // slice kt + 1 is visible to all; every warp has read its last fragments of slot rd
                    cp_async_wait<C::STAGES - 2>();
                    __syncthreads();
                    rd = rd + C::STAGE_BYTES == RING ? 0 : rd + C::STAGE_BYTES;
                    if (kt + 1 < KT) fr.load(a[(ks + 1) & 1], b[(ks + 1) & 1], s_base + rd, 0);
                } else {
                    fr.load(a[(ks + 1) & 1], b[(ks + 1) & 1], s_base + rd, ks + 1);
                }
                if (ks == 0) {   // the slot of slice kt - 1 is free (barrier of the previous slice)
                    if (issue) load(wr, nk, -1);
                    auto copy = [&](int q) { if (issue) load(wr, nk, q); };
                    mma_step<T>(acc, a[ks & 1], b[ks & 1], copy);
                    cp_async_commit();
                    wr = wr + C::STAGE_BYTES == RING ? 0 : wr + C::STAGE_BYTES;
                } else {
                    mma_step<T>(acc, a[ks & 1], b[ks & 1], none);
                }
            }
        }
    } else {
        for (int kt = 0; kt < KT; ++kt) {
            cp_async_wait<C::STAGES - 2>();
            __syncthreads();   // slice kt is visible to all; slice kt - 1 is no longer read
            const int nk = kt + C::STAGES - 1;
            const bool issue = nk < KT;
            if (C::PIPE == 0 && issue) {
#pragma unroll
                for (int q = -1; q < 4; ++q) load(wr, nk, q);
            }
            if (C::PIPE == 1 && issue) load(wr, nk, -1);
#pragma unroll
            for (int ks = 0; ks < C::KSTEPS; ++ks) {
                unsigned a[4][4], b[4][4];
                fr.load(a, b, s_base + rd, ks);
                if (C::PIPE == 1 && ks == 0) {
                    auto copy = [&](int q) { if (issue) load(wr, nk, q); };
                    mma_step<T>(acc, a, b, copy);
                } else {
                    mma_step<T>(acc, a, b, none);
                }
            }
            cp_async_commit();
            wr = wr + C::STAGE_BYTES == RING ? 0 : wr + C::STAGE_BYTES;
            rd = rd + C::STAGE_BYTES == RING ? 0 : rd + C::STAGE_BYTES;
        }
    }
    cp_async_wait<0>();
}

// Copy q of NC per thread and slice belongs to piece (4 q) / NC.
template <int NC> __device__ __forceinline__ constexpr bool in_piece(int q, int piece) { return (q * 4) / NC == piece; }
__device__ __forceinline__ int clamp_int(i64_t v) { return v < 0 ? 0 : (v > 0x7fffffff ? 0x7fffffff : (int)v); }

template <class S, class C>
__device__ void run(const Problem<S>& p) {
    using T = typename S::T;
    using OutT = typename S::OutT;
    constexpr int BM = C::BM, BN = C::BN, BK = C::BK, THREADS = C::THREADS;
    constexpr unsigned TS = sizeof(T);
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const unsigned s_base = smem_addr(smem_raw);
    __shared__ i64_t rows_s[BM];   // fwd / bwd-input: the tile's output rows (-1: none)
    __shared__ i64_t slot;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m_w = (warp / C::WARPS_N) * 64, n_w = (warp % C::WARPS_N) * 64;
    const Frag<C> fr(m_w, n_w, lane);
    if constexpr (S::PASS == WGRAD) {
        // dw[e, n, k]: tiles (e, n-tile, k-tile); the reduction walks the rows of expert e in order.
        // Both operands MN-major: A = dy [BK rows][BM columns n], B = x [BK rows][BN columns k].
        using MA = MNMap<BM, BK, THREADS>;
        using MB = MNMap<BN, BK, THREADS>;
        constexpr int NC = MA::PASSES + MB::PASSES;
        const int acc_ = tid % MA::WCH, ar0 = tid / MA::WCH;
        const int bcc = tid % MB::WCH, br0 = tid / MB::WCH;
        const unsigned a_dst = (unsigned)mnmaj_off<BM>(ar0, acc_) * TS;
        const unsigned b_dst = C::A_BYTES + (unsigned)mnmaj_off<BN>(br0, bcc) * TS;
        const i64_t tiles_n = (p.N + BM - 1) / BM, tiles_k = (p.K + BN - 1) / BN;
        const i64_t per_expert = tiles_n * tiles_k, total = (i64_t)p.E * per_expert;
        (void)rows_s;
        for (;;) {
            const i64_t t = next_tile(p.counter, &slot);
            if (t >= total) break;
            float acc[4][8][4];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int nj = 0; nj < 8; ++nj)
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[mi][nj][q] = 0.0f;
            const int e = (int)(t / per_expert);
            const i64_t row0 = (t % per_expert) / tiles_k * BM, col0 = (t % per_expert) % tiles_k * BN;
            const i64_t p0 = p.row_start[e], p1 = p.row_start[e + 1];
            const i64_t R = p1 - p0;
            const bool a_col_ok = row0 + acc_ * 8 < p.N, b_col_ok = col0 + bcc * 8 < p.K;
            const int KT = (int)((R + BK - 1) / BK);
            i64_t left = R;   // rows of the expert from the next slice on
            if (p.perm == nullptr) {
                // Offsets routing: the rows of expert e are consecutive; running pointers at rows
                // p0 + ar0 / br0 of the next slice.
                const T* a_next = p.dy + (p0 + ar0) * p.lddy + row0 + acc_ * 8;
                const T* b_next = p.x + (p0 + br0) * p.ldx + col0 + bcc * 8;
                const i64_t a_step = (i64_t)MA::RPP * p.lddy, b_step = (i64_t)MB::RPP * p.ldx;
                int a_left = 0, b_left = 0;   // per slice: rows left (0 past the columns of the operand)
                auto load = [&](unsigned stage, int kt, int piece) {
                    (void)kt;
                    if (piece < 0) {
                        const int l = clamp_int(left);
                        a_left = a_col_ok ? l : 0;
                        b_left = b_col_ok ? l : 0;
                        return;
                    }
                    const unsigned sA = s_base + stage;
#pragma unroll
                    for (int q = 0; q < NC; ++q) {
                        if (!in_piece<NC>(q, piece)) continue;
                        if (q < MA::PASSES) {
                            const int i = q;
                            cp_async16(sA + a_dst + i * MA::RPP * BM * TS, a_next + i * a_step, ar0 + MA::RPP * i < a_left);
                        } else {
                            const int i = q - MA::PASSES;
                            cp_async16(sA + b_dst + i * MB::RPP * BN * TS, b_next + i * b_step, br0 + MB::RPP * i < b_left);
                        }
                    }
                    if (piece == 3) {
                        a_next += BK * p.lddy;
                        b_next += BK * p.ldx;
                        left -= BK;
                    }
                };
                mainloop<C>(acc, fr, s_base, KT, load);
            } else {
                // Row permutation (row_experts routing): rows through perm, read per slice.
                int a_left = 0, b_left = 0;
                i64_t pos0 = p0;
                auto load = [&](unsigned stage, int kt, int piece) {
                    if (piece < 0) {
                        const int l = clamp_int(left);
                        a_left = a_col_ok ? l : 0;
                        b_left = b_col_ok ? l : 0;
                        pos0 = p0 + (i64_t)kt * BK;
                        return;
                    }
                    const unsigned sA = s_base + stage;
#pragma unroll
                    for (int q = 0; q < NC; ++q) {
                        if (!in_piece<NC>(q, piece)) continue;
                        if (q < MA::PASSES) {
                            const int r = ar0 + MA::RPP * q;
                            const bool ok = r < a_left;
                            const T* src = ok ? p.dy + (i64_t)p.perm[pos0 + r] * p.lddy + row0 + acc_ * 8 : p.dy;
                            cp_async16(sA + a_dst + q * MA::RPP * BM * TS, src, ok);
                        } else {
                            const int i = q - MA::PASSES, r = br0 + MB::RPP * i;
                            const bool ok = r < b_left;
                            const T* src = ok ? p.x + (i64_t)p.perm[pos0 + r] * p.ldx + col0 + bcc * 8 : p.x;
                            cp_async16(sA + b_dst + i * MB::RPP * BN * TS, src, ok);
                        }
                    }
                    if (piece == 3) left -= BK;
                };
                mainloop<C>(acc, fr, s_base, KT, load);
            }

            // Epilogue: accumulator (row lane / 4 (+8), columns 2 (lane % 4) + {0, 1}) -> output pairs.
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int lr = m_w + 16 * mi + (lane >> 2) + 8 * h;
                    const i64_t n = row0 + lr;
                    if (n >= p.N) continue;
                    OutT* o = p.out + ((i64_t)e * p.N + n) * p.K;
                    const i64_t COLS = p.K;
#pragma unroll
                    for (int nj = 0; nj < 8; ++nj) {
                        const i64_t c = col0 + n_w + 8 * nj + 2 * (lane & 3);
                        if (c < COLS) store2(o + c, acc[mi][nj][2 * h], acc[mi][nj][2 * h + 1]);
                    }
                }
            }
        }
    } else {
        // FWD: A = x, B = w[e] rows n, both K-major. DGRAD: A = dy (K-major), B = w[e] (MN-major).
        constexpr bool F = S::PASS == FWD;
        const T* A = F ? p.x : p.dy; const i64_t lda = F ? p.ldx : p.lddy;
        const i64_t R = F ? p.K : p.N, COLS = F ? p.N : p.K;
        using MB = typename PickMap<F, KMap<BN, BK, THREADS>, MNMap<BN, BK, THREADS>>::type;
        constexpr int NB = MB::CHUNKS;
        int bcc = 0, br0 = 0;   // DGRAD: the MN-major producer of B (column chunk bcc, rows br0 + RPP i)
        unsigned b_dst = 0;
        if constexpr (!F) {
            bcc = tid % MB::WCH, br0 = tid / MB::WCH;
            b_dst = C::A_BYTES + (unsigned)mnmaj_off<BN>(br0, bcc) * TS;
        }
        using MA = KMap<BM, BK, THREADS>;
        constexpr int NA = MA::CHUNKS, NC = NA + NB;
        const int kc = tid & 3, kr0 = tid >> 2;          // K-major producer: chunks kc + 4 j, rows kr0 + RPP i
        // (RPP is a multiple of 8, so row kr0 + RPP i has the swizzle of row kr0)
        unsigned k_dst[MA::KCOLS];
#pragma unroll
        for (int j = 0; j < MA::KCOLS; ++j) k_dst[j] = (unsigned)kmaj_off<BK>(kr0, kc + 4 * j) * TS;
        const i64_t n_tiles = (COLS + BN - 1) / BN;
        const i64_t total = p.tile_start[p.E + 1] * n_tiles;
        for (;;) {
            const i64_t t = next_tile(p.counter, &slot);
            if (t >= total) break;
            float acc[4][8][4];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int nj = 0; nj < 8; ++nj)
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[mi][nj][q] = 0.0f;
            const MTile mt = decode_mtile(p, t, n_tiles, BM);
            const i64_t col0 = mt.nt * BN;
            const int nrows = (int)(mt.p1 - mt.p0);
            for (int i = tid; i < BM; i += THREADS) rows_s[i] = i < nrows ? row_of(p, mt.p0 + i) : -1;
            __syncthreads();
            if (mt.bucket == p.E) {   // padding rows: zeros
                zero_rows(p, rows_s, nrows, col0, BN, COLS);
                continue;
            }
            const T* B = p.w + (i64_t)mt.bucket * p.w_se;
            const int Rk = clamp_int(R);   // < 2^31 (host-checked)
            // K-major producer rows, as pointers held in registers. A row past the tile's rows (or
            // past N for w) reads row 0 instead: it only feeds outputs that are never stored, so
            // only the reduction tail (k >= R, which feeds every output) needs the zero fill.
            const T* a_row[MA::PASSES];
#pragma unroll
            for (int i = 0; i < MA::PASSES; ++i) {
                const i64_t row = rows_s[kr0 + MA::RPP * i];
                a_row[i] = A + (row >= 0 ? row : 0) * lda;
            }
            const T* b_row[MB::PASSES];   // FWD: B = w[e] rows n
            // DGRAD: B = w[e] (MN-major: rows are the reduction index n, columns the output k): a
            // running pointer at row br0 of the next slice.
            bool b_col_ok = false;
            const T* b_next = nullptr;
            i64_t b_step = 0, left = 0;
            if constexpr (F) {
#pragma unroll
                for (int i = 0; i < MB::PASSES; ++i) {
                    const i64_t n = col0 + kr0 + MB::RPP * i;
                    b_row[i] = B + (n < COLS ? n : 0) * p.w_sn;
                }
            } else {
                b_col_ok = col0 + bcc * 8 < COLS;
                b_next = B + br0 * p.w_sn + col0 + bcc * 8;
                b_step = (i64_t)MB::RPP * p.w_sn;
                left = R;
            }
            int kk0 = 0;                 // per slice: reduction index of this thread's chunk j = 0,
            bool k_ok[MA::KCOLS] = {};   // and whether chunk j is inside the reduction
            int b_left = 0;              // DGRAD, per slice: rows of B left (0 past its columns)
            auto load = [&](unsigned stage, int kt, int piece) {
                if (piece < 0) {
                    kk0 = kt * BK + kc * 8;
#pragma unroll
                    for (int j = 0; j < MA::KCOLS; ++j) k_ok[j] = kk0 + 32 * j < Rk;
                    if constexpr (!F) b_left = b_col_ok ? clamp_int(left) : 0;
                    return;
                }
                const unsigned sA = s_base + stage;
#pragma unroll
                for (int q = 0; q < NC; ++q) {
                    if (!in_piece<NC>(q, piece)) continue;
                    if (q < NA) {   // A (rows of x / dy, K-major): a warp moves 8 rows x 64 contiguous bytes
                        const int i = q / MA::KCOLS, j = q % MA::KCOLS;
                        cp_async16(sA + k_dst[j] + i * MA::RPP * BK * TS, a_row[i] + kk0 + 32 * j, k_ok[j]);
                    } else if constexpr (F) {
                        // B = w[e] rows n (K-major): same map as A.
                        const int i = (q - NA) / MB::KCOLS, j = (q - NA) % MB::KCOLS;
                        cp_async16(sA + C::A_BYTES + k_dst[j] + i * MB::RPP * BK * TS, b_row[i] + kk0 + 32 * j, k_ok[j]);
                    } else {
                        const int i = q - NA;
                        cp_async16(sA + b_dst + i * MB::RPP * BN * TS, b_next + i * b_step, br0 + MB::RPP * i < b_left);
                    }
                }
                if constexpr (!F) {
                    if (piece == 3) {
                        b_next += BK * p.w_sn;
                        left -= BK;
                    }
                }
            };
            mainloop<C>(acc, fr, s_base, (int)((R + BK - 1) / BK), load);

            // Epilogue: accumulator (row lane / 4 (+8), columns 2 (lane % 4) + {0, 1}) -> output pairs.
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int lr = m_w + 16 * mi + (lane >> 2) + 8 * h;
                    const i64_t row = rows_s[lr];
                    if (row < 0) continue;
                    OutT* o = p.out + row * COLS;
#pragma unroll
                    for (int nj = 0; nj < 8; ++nj) {
                        const i64_t c = col0 + n_w + 8 * nj + 2 * (lane & 3);
                        if (c < COLS) store2(o + c, acc[mi][nj][2 * h], acc[mi][nj][2 * h + 1]);
                    }
                }
            }
        }
    }
}

}  // namespace mma
}  // namespace moe
// ---- end of MoE mma backend ------------------------------------------------------------------
