"""A grouped-matmul problem: its routing and arguments, the workspace layout, and the checks that
need no device (shapes, dtypes, strides, what the mma and wgmma kernels can take)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


from .. import kinds, vectors
from ..axes import BACKENDS
from ..arrays import ArrayRef
from ..errors import InvalidProblemError, UnsupportedError
from ..params import same_device
from ..tma import MapSpec


MOE_KINDS = ("f32",) + kinds.HALF    # the float kinds grouped_matmul takes (docs/numerics.md)
STRATEGIES = ("auto",) + BACKENDS
MAX_EXPERTS = 1024          # routing keeps one counter per expert per warp in shared memory
MAX_ROWS = 2**31            # row indices are stored as int32 in the routing permutation
HIST_BUDGET = 65536         # (E + 1) x chunks histogram entries, at most (about)
MAX_MMA_EXTENT = 2**31 - 256   # the mma kernels index the reduction / columns with 32-bit integers
WGMMA_ARCH = 90             # the wgmma kernels are built for sm_90a: they run on compute capability 9.0 only
WORKSPACE_ALIGN = 16        # a caller's workspace: its regions lie at multiples of 256 bytes past it
COUNTER_SLOT = {"grouped_matmul": 0, "grouped_matmul_backward_input": 1, "grouped_matmul_backward_weight": 2}


# -- problem description ---------------------------------------------------------------------
@dataclass
class Routing:
    """Rows -> experts: exactly one of ``row_experts`` / ``offsets``."""

    E: int
    M: int
    row_experts: Optional[ArrayRef] = None
    offsets: Optional[ArrayRef] = None
    trusted: bool = False

    @property
    def mode(self) -> str:
        return "offsets" if self.offsets is not None else "row_experts"


@dataclass
class MoeArgs:
    """Launch arguments of one moe kernel. ``routed``: the workspace already holds the routing
    of these rows (the backward routes once for both gradients)."""

    op: str
    x: Optional[ArrayRef]
    w: Optional[ArrayRef]
    dy: Optional[ArrayRef]
    out: ArrayRef
    routing: Routing
    M: int
    N: int
    K: int
    E: int
    workspace: Optional[ArrayRef] = None
    routed: bool = False
    status: int = 0     # the device's status word (runtime/status.py) for invalid offsets; 0: not reported


# -- workspace ---------------------------------------------------------------------------------
def route_chunks(M: int, E: int) -> tuple:
    """(chunks, rows per chunk) of the row_experts counting sort: one warp per chunk, a chunk a
    multiple of 32 rows, the (E + 1) x chunks histogram bounded by about HIST_BUDGET entries."""
    limit = max(1, HIST_BUDGET // (E + 1))
    want = max(1, min(-(-M // 256), limit))
    rows = max(32, -(-(-(-M // want)) // 32) * 32)
    return max(1, -(-M // rows)), rows


def _align(n: int) -> int:
    return -(-n // 256) * 256


def workspace_layout(M: int, E: int, mode: str) -> dict:
    """Byte offsets of the workspace regions, and ``total``. Only int regions: no float state."""
    regions = [("status", 4), ("counters", 8 * 4), ("row_start", 8 * (E + 2)), ("tile_start", 8 * (E + 2))]
    if mode == "row_experts":
        chunks, _ = route_chunks(M, E)
        regions += [("perm", 4 * M), ("hist", 4 * (E + 1) * chunks), ("base", 4 * (E + 1) * chunks)]
    out, off = {}, 0
    for name, size in regions:
        out[name] = off
        off += _align(size)
    out["total"] = off
    return out


# -- validation (pure: works on ArrayRef descriptions, no device needed) ----------------------
def _contiguous_last(ref: ArrayRef, arg: str):
    if any(s < 0 for s in ref.strides):
        raise InvalidProblemError(f"{arg} has negative strides {ref.strides}; skuforge does not copy: "
                                  "pass a view with non-negative strides")
    if ref.size and ref.shape[-1] > 1 and ref.strides[-1] != 1:
        raise InvalidProblemError(f"{arg} must have a contiguous last axis (stride 1); got strides {ref.strides}")


def _dtype_name(kind: str) -> str:
    k = kinds.BY_NAME.get(kind)
    return k.numpy if k is not None and k.numpy else kind


def check_problem(x: ArrayRef, w: ArrayRef, dy: Optional[ArrayRef], row_experts, offsets) -> tuple:
    """Validate shapes, dtypes, strides and the routing arguments; returns (M, N, K, E).
    Raises InvalidProblemError / UnsupportedError naming the argument before any launch."""
    if x.kind not in MOE_KINDS:
        raise UnsupportedError(f"x has dtype {x.kind}; grouped_matmul takes "
                               + ", ".join(_dtype_name(k) for k in MOE_KINDS))
    if x.ndim != 2:
        raise InvalidProblemError(f"x must be 2-D [M, K]; got shape {tuple(x.shape)}")
    if w.ndim != 3:
        raise InvalidProblemError(f"w must be 3-D [E, N, K]; got shape {tuple(w.shape)}")
    if w.kind != x.kind:
        raise InvalidProblemError(f"w has dtype {_dtype_name(w.kind)} but x has {_dtype_name(x.kind)}; "
                                  "x, w (and dy) must share one dtype")
    M, K = x.shape
    E, N, Kw = w.shape
    if Kw != K:
        raise InvalidProblemError(f"mismatched K: x.shape[1] = {K} but w.shape[2] = {Kw} (w is [E, N, K])")
    if K < 1:
        raise InvalidProblemError(f"K = {K}; grouped_matmul needs K >= 1")
    if E < 1:
        raise InvalidProblemError(f"w has E = {E} experts; at least 1 is needed")
    if E > MAX_EXPERTS:
        raise UnsupportedError(f"w has E = {E} experts; supported: 1 to {MAX_EXPERTS}")
    if M > MAX_ROWS:
        raise UnsupportedError(f"x has M = {M} rows; supported: up to 2**31")
    _contiguous_last(x, "x")
    _contiguous_last(w, "w")
    if dy is not None:
        if dy.kind != x.kind:
            raise InvalidProblemError(f"dy has dtype {_dtype_name(dy.kind)} but x has {_dtype_name(x.kind)}; "
                                      "x, w and dy must share one dtype")
        if dy.ndim != 2 or tuple(dy.shape) != (M, N):
            raise InvalidProblemError(f"dy must be [M, N] = {(M, N)}; got shape {tuple(dy.shape)}")
        _contiguous_last(dy, "dy")
    if (row_experts is None) == (offsets is None):
        raise InvalidProblemError("pass exactly one of row_experts= (int32/uint32 [M]) or offsets= "
                                  "(int32/int64 [E+1]); got " + ("both" if row_experts is not None else "neither"))
    if row_experts is not None:
        if row_experts.kind not in ("i32", "u32"):
            raise InvalidProblemError(f"row_experts has dtype {row_experts.kind}; int32 or uint32 is required")
        if row_experts.ndim != 1 or row_experts.shape[0] != M:
            raise InvalidProblemError(f"row_experts must have shape (M,) = ({M},); got {tuple(row_experts.shape)}")
        if M > 1 and row_experts.strides[0] != 1:
            raise InvalidProblemError(f"row_experts must be contiguous; got stride {row_experts.strides[0]}")
    else:
        if offsets.kind not in ("i32", "i64"):
            raise InvalidProblemError(f"offsets has dtype {offsets.kind}; int32 or int64 is required")
        if offsets.ndim != 1 or offsets.shape[0] != E + 1:
            raise InvalidProblemError(f"offsets must have shape (E+1,) = ({E + 1},) for E = {E} experts; "
                                      f"got {tuple(offsets.shape)}")
        if offsets.strides[0] != 1:
            raise InvalidProblemError(f"offsets must be contiguous; got stride {offsets.strides[0]}")
    same_device(("x", x), ("w", w), ("dy", dy), ("row_experts", row_experts), ("offsets", offsets))
    frameworks = {r.framework for r in (x, w, dy) if r is not None}
    if len(frameworks) > 1:
        raise InvalidProblemError(f"x, w and dy mix array types ({', '.join(sorted(frameworks))}); pass one kind")
    return M, N, K, E


def gemm_accesses(backend: str, element: str, out_kind: str) -> tuple:
    """The vector accesses of a grouped-matmul kernel of ``backend`` (the ``gemm`` group): the mma and
    wgmma kernels copy their operands 16 bytes at a time (row strides too) and store accumulator
    pairs as one word; the wgmma kernels store whole tiles through the output's tensor map."""
    if backend == "simt":
        return ()
    item, out_item = kinds.SIZE[element], kinds.SIZE[out_kind]
    copies = "the tensor-core kernels' 16-byte operand copies"
    ops = tuple(vectors.Access(p, vectors.CP_ASYNC, item, copies, st)
                for p, st in (("x", ("ldx",)), ("w", ("w_se", "w_sn")), ("dy", ("lddy",))))
    if backend == "wgmma":
        return ops + (vectors.Access("out", vectors.TMA, out_item, "the wgmma kernels' tensor-map stores"),)
    pair = vectors.word(out_item, 2)
    return ops + (vectors.Access("out", pair, out_item, f"the mma kernels' {pair}-byte stores of output pairs"),)


def mma_blockers(args: MoeArgs, backend: str = "mma") -> list:
    """Why the mma kernels (``backend``: or the wgmma ones, as far as their pointers go) cannot
    take these arguments (empty: they can): extents, and every operand and output the kernel
    moves in words wider than an element (runtime/vectors.py), named as the caller passed it."""
    out = []
    if args.K % 8:
        out.append(f"K = {args.K} is not a multiple of 8")
    if args.N % 8:
        out.append(f"N = {args.N} is not a multiple of 8")
    if max(args.N, args.K) > MAX_MMA_EXTENT:
        out.append(f"N = {args.N}, K = {args.K}: the tensor-core kernels take N and K up to 2**31 - 256")
    x, w, dy = args.x, args.w, args.dy
    values = dict(x=_ptr(x), ldx=x.strides[0] if x is not None else 0, w=_ptr(w),
                  w_se=w.strides[0] if w is not None else 0, w_sn=w.strides[1] if w is not None else 0,
                  dy=_ptr(dy), lddy=dy.strides[0] if dy is not None else 0, out=args.out.ptr)
    element = (x if x is not None else dy).kind
    return out + vectors.problems(gemm_accesses(backend, element, args.out.kind), values,
                                  {"out": OUT_ARG[args.op]})


# how the functional API names each pass's output (grouped_matmul's out=, grouped_matmul_backward's out=(dx, dw))
OUT_ARG = {"grouped_matmul": "out", "grouped_matmul_backward_input": "out[0] (dx)",
           "grouped_matmul_backward_weight": "out[1] (dw)"}


def _ptr(ref: Optional[ArrayRef]) -> int:
    return 0 if ref is None else ref.ptr


def tma_specs(args: MoeArgs, tile: dict) -> dict:
    """The tensor maps of a wgmma pass (kernel parameter -> (array, MapSpec)): the two operands and
    the output as whole arrays, 128-byte boxes along the contiguous axis. Forward: x rows and w[e]
    rows n (K-major); input gradient: dy rows and w[e] as [n][k] (k MN-major); weight gradient: dy
    and x as [m][n] / [m][k] (both MN-major), 64 rows of the reduction a box. The output (``tmap_c``):
    y / dx as [M][cols], dw as [E][N][K], stored in boxes of 64 rows x 128 bytes."""
    M, N, K, E = args.M, args.N, args.K, args.E
    BM, BN = tile["BM"], tile["BN"]

    def rows(ref, cols, box_rows, contiguous=False):     # a 2-D [M][cols] array
        ld = cols if contiguous else ref.strides[0]
        return ref, MapSpec(ref.kind, (cols, M), (ld * ref.itemsize,), (128 // ref.itemsize, box_rows))

    def weights(ref, box_rows, contiguous=False):        # a 3-D [E][N][K] array (w, dw)
        st = (K, N * K) if contiguous else (ref.strides[1], ref.strides[0])
        return ref, MapSpec(ref.kind, (K, N, E), tuple(v * ref.itemsize for v in st), (128 // ref.itemsize, box_rows, 1))
    out = args.out                                       # C-contiguous (checked), whatever strides its extents of 1 carry
    if args.op == "grouped_matmul":
        return {"tmap_a": rows(args.x, K, BM), "tmap_b": weights(args.w, BN), "tmap_c": rows(out, N, 64, True)}
    if args.op == "grouped_matmul_backward_input":
        return {"tmap_a": rows(args.dy, N, BM), "tmap_b": weights(args.w, 64), "tmap_c": rows(out, K, 64, True)}
    return {"tmap_a": rows(args.dy, N, 64), "tmap_b": rows(args.x, K, 64), "tmap_c": weights(out, 64, True)}


def wgmma_blockers(args: MoeArgs) -> list:
    """Why the wgmma kernels (sm_90a) cannot take these arguments (empty: they can): those of the
    mma kernels, rows routed by ``row_experts`` (the copy engine loads an expert's rows as one box:
    they must be consecutive, as ``offsets`` routing gives them; a row gather is the mma path's),
    and what a tensor map cannot describe (no rows: M = 0; a zero row stride)."""
    out = mma_blockers(args, "wgmma")
    if args.routing.mode != "offsets":
        out.append("rows are routed by row_experts: the wgmma kernels load each expert's rows as one block "
                   "(tensor maps), which needs offsets routing (rows sorted by expert)")
    if not out:
        for param, (ref, spec) in tma_specs(args, {"BM": 128, "BN": 128}).items():
            out += [f"{_OPERAND[args.op][param]}: {why}" for why in spec.problems(ref.ptr)]
    return out


_OPERAND = {op: {"tmap_a": a, "tmap_b": b, "tmap_c": OUT_ARG[op]}
            for op, a, b in (("grouped_matmul", "x", "w"), ("grouped_matmul_backward_input", "dy", "w"),
                             ("grouped_matmul_backward_weight", "dy", "x"))}
