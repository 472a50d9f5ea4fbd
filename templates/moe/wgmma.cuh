// ---- skuforge MoE grouped matmul, wgmma backend (templates/moe/wgmma.cuh) ---------------------
// sm_90a: Hopper warpgroup MMA fed by the copy engine (TMA), on the helpers of templates/common/hopper.cuh.
// One body, instantiated per tile configuration (launch["variants"], WTile<S, BM, BN, STAGES, EPI>),
// 384 threads:
//   warpgroup 0  producer: one thread issues the TMA loads of every k-slice (BK = 64) of every
//                tile into a STAGES-deep ring of 128-byte-swizzled shared-memory stages, each
//                stage guarded by a "full" (transaction) and an "empty" mbarrier; 40 registers.
//   warpgroups 1, 2  consumers: wgmma.mma_async m64nWNk16 from shared memory (descriptors), fp32
//                accumulators in registers (232 registers): BM = 128: 64 rows each, all BN
//                columns (WN = BN); BM = 64: all 64 rows, half of the columns each (WN = BN / 2).
//                Each k-slice's wgmma group is committed and left in flight while the next
//                slice's is issued (wgmma.wait_group 1): the tensor cores never drain between
//                slices, and a stage goes back to the producer once the group reading it is done.
// Persistent grid, static schedule: block b runs tiles b, b + grid, b + 2 grid, ... of the
// routing's tile list (forward / input gradient: (m-tile of one expert, n-tile) from tile_start,
// rasterised in groups of 8 m-tiles; weight gradient: (expert, n-tile, k-tile)). Each output is
// one tile's sum over all k-slices in order: the same bits whichever block runs it.
// Operand tiles, loaded at global coordinates through tensor maps of the whole arrays (nothing
// is rewritten per expert):
//   K-major [ROWS][64]        one box {64, ROWS}: x / dy rows (FWD, DGRAD), w[e] rows n (FWD)
//   MN-major [64][W] as W/64 boxes {64, 64} of 8 KB: w[e] (DGRAD), dy and x (WGRAD)
// Rows past an expert in an m-tile are computed and never stored (rows past M read as zeros);
// the weight gradient zeroes the rows past its expert in the last k-slice's stage before the
// wgmma reads it, so rows of the next expert never enter dw. Reduction tails past K (forward) or
// N (input gradient) and columns past the arrays read as zeros (the tensor maps' bounds).
// Needs (host-checked, runtime/moe/grouped.py wgmma_blockers): offsets routing (rows sorted by expert),
// f16/bf16, N and K multiples of 8, 16-byte aligned operands with row strides of 16-byte multiples.
namespace moe {
namespace wgmma {

template <class S, int BM_, int BN_, int STAGES_, int EPI_>
struct WTile {
    using T = typename S::T;
    using OutT = typename S::OutT;
    static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_;
    static constexpr int WN = BM == 128 ? BN : BN / 2;     // columns of one consumer warpgroup
    static constexpr int EPI = EPI_;                       // output staging buffers of a consumer warpgroup
    static constexpr u32_t A_BYTES = BM * BK * sizeof(T), B_BYTES = BN * BK * sizeof(T);
    static constexpr u32_t STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr u32_t BOX_BYTES = 64 * 64 * sizeof(T);   // one 64 x 64 box of an MN-major operand
    static constexpr u32_t ROW_BYTES = 64 * sizeof(T);        // one 128-byte swizzled row
    static constexpr u32_t GROUP_BYTES = 8 * ROW_BYTES;       // 8 rows: one swizzle atom
    static constexpr int OUT_CW = 128 / sizeof(OutT);         // output columns of one 128-byte swizzled row
    static_assert((BM == 64 || BM == 128) && BN % 64 == 0 && BN <= 256 && (WN == 64 || WN == 128 || WN == 256),
                  "tile shape");
    static_assert(EPI >= 1 && EPI <= 8, "one to eight staging buffers (bulk_wait_read takes EPI - 1)");
};
constexpr u32_t OUT_BUF_BYTES = 64 * 128;          // one staged output box: 64 rows x 128 bytes

// wgmma.mma_async.m64nNk16, fp32 += T x T (bf16_t or f16_t), both operands from shared memory.
// TA / TB = 1: the operand is MN-major (its contiguous axis is the output axis).
template <int TA, int TB, class T>
__device__ __forceinline__ void wgmma_m64n64(float (&d)[32], u64_t da, u64_t db) {
    if constexpr (same_type<T, bf16_t>)
        asm volatile(
            "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\n {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
            "},\n %32, %33, p, 1, 1, %35, %36;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
    else
        asm volatile(
            "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16\n {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
            "},\n %32, %33, p, 1, 1, %35, %36;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}
template <int TA, int TB, class T>
__device__ __forceinline__ void wgmma_m64n128(float (&d)[64], u64_t da, u64_t db) {
    if constexpr (same_type<T, bf16_t>)
        asm volatile(
            "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
            "},\n %64, %65, p, 1, 1, %67, %68;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
    else
        asm volatile(
            "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16\n {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
            "},\n %64, %65, p, 1, 1, %67, %68;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}
template <int TA, int TB, class T>
__device__ __forceinline__ void wgmma_m64n256(float (&d)[128], u64_t da, u64_t db) {
    if constexpr (same_type<T, bf16_t>)
        asm volatile(
            "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16\n {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
            "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
            "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
            "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
            "},\n %128, %129, p, 1, 1, %131, %132;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
              "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
              "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
              "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
              "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
              "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
              "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
              "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
              "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
            : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
    else
        asm volatile(
            "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16\n {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
            "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
            "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
            "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
            "},\n %128, %129, p, 1, 1, %131, %132;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
              "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
              "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
              "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
              "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
              "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
              "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
              "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
              "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
            : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}

// The consumer's wgmma of one k16 step: A is MN-major for WGRAD, B for DGRAD and WGRAD.
template <class S, int WN>
__device__ __forceinline__ void wgmma_tile(float (&d)[WN / 2], u64_t da, u64_t db) {
    using T = typename S::T;
    constexpr int TA = S::PASS == WGRAD ? 1 : 0, TB = S::PASS == FWD ? 0 : 1;
    if constexpr (WN == 64) wgmma_m64n64<TA, TB, T>(d, da, db);
    else if constexpr (WN == 128) wgmma_m64n128<TA, TB, T>(d, da, db);
    else if constexpr (WN == 256) wgmma_m64n256<TA, TB, T>(d, da, db);
}

// One tile of the schedule, as both roles decode it.
struct WJob {
    int e;           // expert (forward / input gradient: the bucket; E = padding rows)
    int KT;          // k-slices of 64 (0: nothing to load; the tile stores zeros)
    i64_t p0, rows;  // first (sorted) row and row count: of the m-tile, or (weight gradient) of the expert
    i64_t r0, c0;    // first output row (weight gradient: n) and first output column
};

template <class S, class C>
__device__ __forceinline__ WJob job_of(const Problem<S>& p, i64_t t, i64_t tiles_r, i64_t tiles_c) {
    WJob j;
    if constexpr (S::PASS == WGRAD) {
        const i64_t per = tiles_r * tiles_c;             // tiles (e, n-tile, k-tile)
        j.e = (int)(t / per);
        const i64_t in = t - (i64_t)j.e * per;
        j.r0 = in / tiles_c * C::BM;
        j.c0 = in % tiles_c * C::BN;
        j.p0 = p.row_start[j.e];
        j.rows = p.row_start[j.e + 1] - j.p0;
        j.KT = (int)((j.rows + C::BK - 1) / C::BK);
    } else {
        const MTile mt = decode_mtile(p, t, tiles_c, C::BM);
        j.e = mt.bucket;
        j.p0 = mt.p0;
        j.rows = mt.p1 - mt.p0;
        j.r0 = 0;
        j.c0 = mt.nt * C::BN;
        if constexpr (S::PASS == FWD) j.KT = j.e == p.E ? 0 : (int)((p.K + C::BK - 1) / C::BK);
        else j.KT = j.e == p.E ? 0 : (int)((p.N + C::BK - 1) / C::BK);
    }
    return j;
}

// The TMA loads of k-slice k0 of tile j into the stage at sA (B at sB), announced to barrier full.
template <class S, class C>
__device__ __forceinline__ void load_stage(const CUtensorMap* ta, const CUtensorMap* tb, u32_t full, u32_t sA, u32_t sB,
                                           const WJob& j, int k0) {
    if constexpr (S::PASS == FWD) {
        tma_load_2d(sA, ta, full, k0, (int)j.p0);                    // x [rows of the m-tile][k]
        tma_load_3d(sB, tb, full, k0, (int)j.c0, j.e);               // w[e] [n][k]
    } else if constexpr (S::PASS == DGRAD) {
        tma_load_2d(sA, ta, full, k0, (int)j.p0);                    // dy [rows of the m-tile][n]
#pragma unroll
        for (int b = 0; b < C::BN / 64; ++b)                         // w[e] [n][k], 64 k-columns a box
            tma_load_3d(sB + b * C::BOX_BYTES, tb, full, (int)j.c0 + 64 * b, k0, j.e);
    } else {
        const int m0 = (int)(j.p0 + k0);                             // rows m of expert e
#pragma unroll
        for (int b = 0; b < C::BM / 64; ++b)                         // dy [m][n], 64 n-columns a box
            tma_load_2d(sA + b * C::BOX_BYTES, ta, full, (int)j.r0 + 64 * b, m0);
#pragma unroll
        for (int b = 0; b < C::BN / 64; ++b)                         // x [m][k], 64 k-columns a box
            tma_load_2d(sB + b * C::BOX_BYTES, tb, full, (int)j.c0 + 64 * b, m0);
    }
}

// The producer thread: every k-slice of every tile of this block into the ring, in order.
template <class S, class C>
__device__ void produce(const Problem<S>& p, const CUtensorMap* ta, const CUtensorMap* tb, u32_t ring, u32_t full0,
                        u32_t empty0, i64_t total, i64_t tiles_r, i64_t tiles_c) {
    u32_t s = 0, ph = 0;
    for (i64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const WJob j = job_of<S, C>(p, t, tiles_r, tiles_c);
        for (int kt = 0; kt < j.KT; ++kt) {
            mbar_wait(empty0 + 8 * s, ph ^ 1);             // the consumers are done with this stage
            const u32_t full = full0 + 8 * s, sA = ring + s * C::STAGE_BYTES, sB = sA + C::A_BYTES;
            mbar_expect_tx(full, C::STAGE_BYTES);          // whole boxes count, out-of-bounds parts too
            load_stage<S, C>(ta, tb, full, sA, sB, j, kt * C::BK);
            if (++s == C::STAGES) { s = 0; ph ^= 1; }
        }
    }
}

// WGRAD: rows [valid, 64) of every box of a stage (the rows past the expert in its last k-slice)
// become zeros, by all 256 consumer threads, visible to the tensor cores before any of them reads
// the stage.
template <class C>
__device__ __forceinline__ void zero_tail(u32_t stage, int valid, int ctid) {
    constexpr int BOXES = (C::BM + C::BN) / 64;      // A then B: consecutive boxes
    const int chunks = (64 - valid) * (C::ROW_BYTES / 16);
    for (int i = ctid; i < BOXES * chunks; i += 256) {
        const u32_t at = stage + (i / chunks) * C::BOX_BYTES + valid * C::ROW_BYTES + (i % chunks) * 16;
        asm volatile("st.shared.v4.u32 [%0], { %1, %1, %1, %1 };\n" ::"r"(at), "r"(0) : "memory");
    }
    fence_proxy_async();
    named_sync(1, 256);
}

// Two adjacent outputs (an accumulator pair), rounded once to the output type, into shared memory.
template <class OutT>
__device__ __forceinline__ void store2_shared(u32_t at, float lo, float hi) {
    if constexpr (same_type<OutT, float>)
        asm volatile("st.shared.v2.f32 [%0], { %1, %2 };\n" ::"r"(at), "f"(lo), "f"(hi) : "memory");
    else
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(pack2<OutT>(lo, hi)) : "memory");
}

// A warpgroup's 64 x WN outputs through shared memory: boxes of 64 rows x 128 bytes (OUT_CW columns),
// each written in the 128-byte swizzled layout the tensor map names (16-byte chunk c of row r at
// c ^ (r % 8): the four lanes of a row hit one chunk, the 8 rows of a warp 8 different ones, no bank
// conflicts), then stored by one thread with one TMA store. C::EPI buffers a warpgroup, reused once
// the copy engine has read them; the thread that issues the stores is the one that waits for them.
// Output (c0, r0) (and e: the weight gradient's expert) is the box's first column and row.
template <class S, class C>
__device__ __forceinline__ void store_tma(const float (&acc)[C::WN / 2], const CUtensorMap* tc, u32_t ebuf, int& eb,
                                          int wg, int tid, int c0, int r0, int e) {
    using OutT = typename S::OutT;
    constexpr int OUT_CW = C::OUT_CW;
    const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
    for (int box = 0; box < C::WN / OUT_CW; ++box) {
        const u32_t buf = ebuf + eb * OUT_BUF_BYTES;
        if (tid == 0) bulk_wait_read<C::EPI - 1>();      // this buffer's previous box has been read
        named_sync(2 + wg, 128);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = 16 * warp + (lane >> 2) + 8 * h;
#pragma unroll
            for (int qq = 0; qq < OUT_CW / 8; ++qq) {
                const int q = box * (OUT_CW / 8) + qq;     // accumulator column group (8 columns)
                const u32_t byte = (8 * qq + 2 * (lane & 3)) * sizeof(OutT);
                store2_shared<OutT>(buf + r * 128 + ((((byte >> 4) ^ (r & 7))) << 4) + (byte & 15),
                                    acc[4 * q + 2 * h], acc[4 * q + 2 * h + 1]);
            }
        }
        fence_proxy_async();                               // visible to the copy engine
        named_sync(2 + wg, 128);
        if (tid == 0) {
            if constexpr (S::PASS == WGRAD) {
                tma_store_3d(tc, buf, c0 + box * OUT_CW, r0, e, l2_evict_first());   // dw: E N K values, never re-read
            } else {
                tma_store_2d(tc, buf, c0 + box * OUT_CW, r0);
                (void)e;
            }
            bulk_commit();
        }
        eb = eb + 1 == C::EPI ? 0 : eb + 1;
    }
}

// FWD / DGRAD: a warpgroup's outputs from registers, rows past the tile's expert left out.
// Accumulator d[4 q + 2 h + c]: row 16 warp + lane / 4 + 8 h, column 8 q + 2 (lane % 4) + c.
template <class S, class C>
__device__ __forceinline__ void store_regs(const Problem<S>& p, const WJob& j, const float (&acc)[C::WN / 2], int m_off,
                                           int n_off, int warp, int lane) {
    using OutT = typename S::OutT;
    const i64_t COLS = S::PASS == FWD ? p.N : p.K;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = m_off + 16 * warp + (lane >> 2) + 8 * h;
        if (r >= j.rows) continue;                         // rows of the next expert: computed, never stored
        OutT* o = p.out + (j.p0 + r) * COLS;
#pragma unroll
        for (int q = 0; q < C::WN / 8; ++q) {
            const i64_t c = j.c0 + n_off + 8 * q + 2 * (lane & 3);
            if (c < COLS) store2(o + c, acc[4 * q + 2 * h], acc[4 * q + 2 * h + 1]);
        }
    }
}

// A consumer warpgroup (wg 0 or 1; tid 0..127 inside it): its part of every tile of this block.
template <class S, class C>
__device__ void consume(const Problem<S>& p, const CUtensorMap* tc, u32_t ring, u32_t full0, u32_t empty0, i64_t total,
                        i64_t tiles_r, i64_t tiles_c, int wg, int tid) {
    constexpr int WN = C::WN;
    const int m_off = C::BM == 128 ? 64 * wg : 0, n_off = C::BM == 128 ? 0 : WN * wg;
    const int warp = tid >> 5, lane = tid & 31;
    (void)warp; (void)lane;
    const u32_t ebuf = ring + C::STAGES * C::STAGE_BYTES + wg * C::EPI * OUT_BUF_BYTES;   // this warpgroup's staging
    int eb = 0;                                            // the staging buffer the next box uses
    u32_t s = 0, ph = 0;
    for (i64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const WJob j = job_of<S, C>(p, t, tiles_r, tiles_c);
        float acc[WN / 2];
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) acc[i] = 0.0f;
        // One k-slice's wgmma group stays in flight while the next one is issued: a stage is
        // released once the group after it has been issued and its own group has completed.
        u32_t held = 0xffffffffu;                          // the stage the in-flight group reads
        for (int kt = 0; kt < j.KT; ++kt) {
            mbar_wait(full0 + 8 * s, ph);                  // the stage's copies have landed
            const u32_t sA = ring + s * C::STAGE_BYTES, sB = sA + C::A_BYTES;
            if constexpr (S::PASS == WGRAD) {
                const i64_t valid = j.rows - (i64_t)kt * C::BK;
                if (valid < C::BK) zero_tail<C>(sA, (int)valid, 128 * wg + tid);
            }
            wg_fence_regs(acc);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < C::BK / 16; ++ks) {
                // K-major operands: the 64 rows of this warpgroup, 16 columns (32 bytes) a step;
                // MN-major: the warpgroup's 64-column box, 16 rows (two swizzle atoms) a step.
                const u64_t da = S::PASS == WGRAD
                    ? wg_desc(sA + (m_off / 64) * C::BOX_BYTES + ks * 2 * C::GROUP_BYTES, C::BOX_BYTES, C::GROUP_BYTES)
                    : wg_desc(sA + m_off * C::ROW_BYTES + ks * 32, 16, C::GROUP_BYTES);
                const u64_t db = S::PASS == FWD
                    ? wg_desc(sB + n_off * C::ROW_BYTES + ks * 32, 16, C::GROUP_BYTES)
                    : wg_desc(sB + (n_off / 64) * C::BOX_BYTES + ks * 2 * C::GROUP_BYTES, C::BOX_BYTES, C::GROUP_BYTES);
                wgmma_tile<S, WN>(acc, da, db);
            }
            wg_commit();
            wg_wait<1>();                                  // the previous k-slice's group has completed
            wg_fence_regs(acc);
            if (lane == 0 && held != 0xffffffffu) mbar_arrive(empty0 + 8 * held);   // this warp no longer reads it
            held = s;
            if (++s == C::STAGES) { s = 0; ph ^= 1; }
        }
        wg_wait<0>();
        wg_fence_regs(acc);
        if (lane == 0 && held != 0xffffffffu) mbar_arrive(empty0 + 8 * held);
        // The tile's outputs. A warpgroup whose 64 rows all lie in the tile's expert (every
        // weight-gradient tile: the tensor map's bounds cut rows past N and columns past K) stages
        // them in shared memory and stores them by TMA, which overlaps the next tile's main loop;
        // one whose rows end inside the tile (an expert's last m-tile) stores from registers, rows
        // of the next expert computed and never stored.
        if constexpr (S::PASS == WGRAD) {
            store_tma<S, C>(acc, tc, ebuf, eb, wg, tid, (int)(j.c0 + n_off), (int)(j.r0 + m_off), j.e);
        } else {
            if (j.rows >= m_off + 64) store_tma<S, C>(acc, tc, ebuf, eb, wg, tid, (int)(j.c0 + n_off), (int)(j.p0 + m_off), 0);
            else store_regs<S, C>(p, j, acc, m_off, n_off, warp, lane);
        }
    }
    if (tid == 0) bulk_wait_all();                         // the staged stores have left shared memory
}

template <class S, class C>
__device__ void run(const Problem<S>& p, const CUtensorMap* ta, const CUtensorMap* tb, const CUtensorMap* tc) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) u64_t bars[2 * C::STAGES];
    const u32_t ring = (smem_u32(smem_raw) + 1023u) & ~1023u;   // the swizzle atoms need 1024-byte alignment
    const u32_t full0 = smem_u32(bars), empty0 = full0 + 8 * C::STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < C::STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);                   // the producer's arrival (+ the bytes)
            mbar_init(empty0 + 8 * s, 8);                  // one arrival per consumer warp
        }
        mbar_init_fence();
        tma_prefetch(ta);
        tma_prefetch(tb);
        tma_prefetch(tc);
    }
    __syncthreads();
    // WGRAD: tiles (e, n-tile, k-tile); FWD / DGRAD: (m-tile, n-tile), the m-tiles from the routing.
    i64_t tiles_r = 0, tiles_c, total;
    if constexpr (S::PASS == WGRAD) {
        tiles_r = (p.N + C::BM - 1) / C::BM, tiles_c = (p.K + C::BN - 1) / C::BN;
        total = (i64_t)p.E * tiles_r * tiles_c;
    } else {
        tiles_c = ((S::PASS == FWD ? p.N : p.K) + C::BN - 1) / C::BN;
        total = p.tile_start[p.E + 1] * tiles_c;
    }
    const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    if (wg == 0) {
        regs_shrink<40>();
        if (tid == 0) produce<S, C>(p, ta, tb, ring, full0, empty0, total, tiles_r, tiles_c);
    } else {
        regs_grow<232>();
        consume<S, C>(p, tc, ring, full0, empty0, total, tiles_r, tiles_c, wg - 1, tid);
    }
}

}  // namespace wgmma
}  // namespace moe
// ---- end of MoE wgmma backend ----------------------------------------------------------------
