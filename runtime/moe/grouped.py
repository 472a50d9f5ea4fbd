"""MoE grouped matmul (docs/numerics.md): functional API, routing workspace and the ``moe_gemm`` launcher.

    y      = grouped_matmul(x, w, row_experts=ids)              # y[m] = w[e(m)] @ x[m]
    dx, dw = grouped_matmul_backward(x, w, dy, offsets=offs)
    grouped_matmul(x, w, offsets=offs, out=y, workspace=ws)     # given arrays: nothing allocated
    plan   = select_plan("grouped_matmul", x, w, row_experts=ids)   # plan.sku: the kernel

``x [M, K]``, ``w [E, N, K]``, ``dy [M, N]``; f32, f16, bf16; fp32 accumulation, one rounding.
Rows go to experts by ``row_experts`` (int32/uint32 [M], any order, ids outside [0, E) are
padding: zero rows in y/dx, nothing in dw) or ``offsets`` (int32/int64 [E+1] prefix sums over
rows sorted by expert). Routing runs on the device in the same stream as the product, with
no host round trip (templates/moe/_routing.cu.j2): a stable counting sort for ``row_experts``,
a validating clamp for ``offsets``. Invalid offsets (not starting at 0, not ending at M, or
decreasing) make every element of the outputs NaN — checked on the device, never an
out-of-bounds access — and the routing kernel writes ``status.code(op, "offsets")`` to the
device's status word (runtime/status.py; ``op`` is the pass that routed: ``grouped_matmul``, or
``grouped_matmul_backward_input`` / ``_weight``, the first pass the backward runs): the next call
on the device, or ``runtime.check()``, raises :class:`runtime.DeviceValueError`, without a host
sync. ``validate_offsets`` gives a typed error at once instead, at the cost of a sync (every call
runs it under ``runtime.sync_checks()``).
``trusted_offsets=True`` (the only way) skips the validation: the offsets are then clamped into
[0, M] and made monotone, so accesses stay in bounds whatever they hold; nothing is reported.
``row_experts`` needs no check: ids outside [0, E) are padding rows (docs/numerics.md).

``out=`` (y, or (dx, dw)) and ``workspace=`` (uint8, ``grouped_matmul_workspace_size(M, E, routing)``
bytes; the routing tables) take caller arrays; a repeated call with same-layout arguments replays
the remembered launches (runtime/replay.py: routing + products as ``PreparedLaunch``es, every
pointer slot re-filled, workspace regions by offset). docs/moe.md says how a workspace may be shared.

Strategies are SKU backends: ``simt`` (every dtype, any shape), ``mma`` (tensor cores through
``mma.sync``, f16/bf16, sm_80+; needs N and K multiples of 8, 16-byte aligned operands and outputs
aligned to the accumulator pairs it stores: runtime/vectors.py) and
``wgmma`` (Hopper: warp-specialised wgmma + TMA kernels built for sm_90a, run on compute capability
9.0 only; the mma conditions plus offsets routing). ``auto`` picks ``wgmma`` on sm_90 whenever it can
implement the problem, else ``mma`` whenever it can, else ``simt``; failures are never hidden.
Every reduction runs in a fixed order (no float atomics): the same inputs give the same bits.

Tile configurations: each mma / wgmma SKU carries several (``launch["variants"]``, compiled into the
same unit; names like ``128x256x32s4p`` = BM x BN x BK, stages, producer/fragment pipelining, or
``wg128x256s4`` = a wgmma BM x BN tile with 4 stages). The launcher runs the SKU's rule
(:func:`default_variant`) unless ``CONFIG`` or the ``SKUFORGE_MOE_CONFIG`` environment variable names
another, per pass or for all: ``"128x128x32s5"`` or ``"fwd=128x256x32s4p,dgrad=wg64x256s5,wgrad=default"``
(passes ``fwd``, ``dgrad``, ``wgrad``; a name configures the backend that has it; ``CONFIG`` wins over
the environment; ``use_config(...)`` sets it for a ``with`` block).
"""
from __future__ import annotations

import numbers
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import config, kinds, replay, status, vectors
from ..axes import BACKENDS, OPS, PASSES
from ..arrays import ArrayRef, as_array, empty, kind_of, stream_handle, writable
from ..device import driver
from ..errors import InvalidProblemError, UnsupportedError
from ..launch import PreparedLaunch
from ..params import check_apart, same_device
from ..plans import Descriptor, Launcher, Preference, cached_plan
from ..tma import MapSpec, map_encoder

MOE_KINDS = ("f32",) + kinds.HALF    # the float kinds grouped_matmul takes (docs/numerics.md)
STRATEGIES = ("auto",) + BACKENDS
MAX_EXPERTS = 1024          # routing keeps one counter per expert per warp in shared memory
MAX_ROWS = 2**31            # row indices are stored as int32 in the routing permutation
HIST_BUDGET = 65536         # (E + 1) x chunks histogram entries, at most (about)
CONFIG_ENV = "SKUFORGE_MOE_CONFIG"
CONFIG: dict = {}           # pass ("fwd" / "dgrad" / "wgrad" / "*") -> variant name; wins over CONFIG_ENV
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
    return out + vectors.problems(vectors.moe_gemm(backend, element, args.out.kind), values,
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


# -- tile configurations (variants) -----------------------------------------------------------
_parsed: dict = {}


def parse_config(text: str) -> dict:
    """``"name"`` -> {"*": name}; ``"fwd=a,dgrad=b"`` -> {"fwd": "a", "dgrad": "b"}."""
    text = (text or "").strip()
    got = _parsed.get(text)
    if got is not None:
        return got
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part:
            key, _, name = (x.strip() for x in part.partition("="))
            if key not in ("fwd", "dgrad", "wgrad", "*"):
                raise InvalidProblemError(f"{CONFIG_ENV}: pass {key!r} in {text!r}; use fwd, dgrad, wgrad or *")
            out[key] = name
        else:
            out["*"] = part
    _parsed[text] = out
    return out


@contextmanager
def use_config(spec=None, **passes):
    """``with use_config("128x128x32s5"):`` or ``use_config(fwd=..., wgrad=...)``: the variants the
    launcher runs inside the block (restores ``CONFIG`` after)."""
    if not (spec is None or isinstance(spec, (str, dict))):
        raise InvalidProblemError(f"use_config({spec!r:.60}): a configuration name, 'fwd=...,wgrad=...' or a dict "
                                  "of pass -> name is required")
    saved = dict(CONFIG)
    if isinstance(spec, str):
        CONFIG.update(parse_config(spec))
    elif spec:
        CONFIG.update(spec)
    CONFIG.update(passes)
    try:
        yield
    finally:
        CONFIG.clear()
        CONFIG.update(saved)


def variant_names(plan) -> list:
    """The tile configurations of a plan's SKU, default first (["default"] for simt)."""
    v = plan.launch.get("variants")
    if not v:
        return ["default"]
    default = plan.launch["default_variant"]
    return [default] + sorted(n for n in v if n != default)


def default_variant(plan, rows_per_expert: Optional[float] = None, cols: Optional[int] = None) -> str:
    """The SKU's configuration for a problem when none is asked for: its ``short_variant`` when the
    experts average fewer than ``short_rows`` rows, else its ``narrow_variant`` when the output tile
    axis (``cols``: N for the forward, K for the gradients) is at most ``narrow_cols`` wide, else its
    ``default_variant`` (codegen/families/moe/blocks.py declares the rule per SKU; docs/moe.md)."""
    launch, variants = plan.launch, plan.launch["variants"]
    short, narrow = launch.get("short_variant"), launch.get("narrow_variant")
    if short in variants and rows_per_expert is not None and rows_per_expert < launch["short_rows"]:
        return short
    if narrow in variants and cols is not None and cols <= launch["narrow_cols"]:
        return narrow
    return launch["default_variant"]


def _names_elsewhere(plan) -> set:
    """Configuration names of the other moe SKUs of the plan's op (another backend's): a name asked for
    configures the backend that has it, and leaves the others on their defaults."""
    reg, sku = getattr(plan, "registry", None), getattr(plan, "sku", None)
    if reg is None or sku is None:
        return set()
    out = set()
    for other in reg.query(category="moe", op=sku.op):
        if other.backend != sku.backend:
            out.update(reg.lookup(other).launch.get("variants") or ())
    return out


def variant_for(plan, op: str, dev: Optional[int] = None, rows_per_expert: Optional[float] = None,
                cols: Optional[int] = None) -> tuple:
    """(name, {"symbol", "tile", "dynamic_smem", "static_smem"}) of the tile configuration that runs ``op``:
    ``CONFIG``, else ``SKUFORGE_MOE_CONFIG``, else :func:`default_variant` (from the experts' average
    rows and the output columns ``cols``). A name of another backend's configuration leaves this
    plan on its default; an unknown name is an error. With ``dev``, a default that does not fit the
    device's shared memory falls back to the first configuration that does; an asked-for one that
    does not fit is an error."""
    variants = plan.launch.get("variants")
    if not variants:
        return "default", {"symbol": plan.entry.symbol, "tile": plan.launch["tile"],
                           "dynamic_smem": plan.launch["dynamic_smem"], "static_smem": plan.launch["static_smem"]}
    default = default_variant(plan, rows_per_expert, cols)
    key = PASSES[op]
    want = None
    for src in (CONFIG, parse_config(config.settings().moe_config)):
        want = src.get(key) or src.get("*")
        if want:
            break
    if not (want is None or isinstance(want, str)):
        raise InvalidProblemError(f"tile configuration {want!r:.60} (runtime.moe.CONFIG / use_config) is not a "
                                  f"configuration name; {plan.sku}'s: {', '.join(variants)}")
    name = default if want in (None, "", "default") else want
    if name not in variants:
        if name in _names_elsewhere(plan):
            name = default
        else:
            raise InvalidProblemError(f"tile configuration {name!r} ({CONFIG_ENV} / runtime.moe.CONFIG) is not one "
                                      f"of {plan.sku}'s: {', '.join(variants)}")
    meta = variants[name]
    if dev is not None:
        optin = driver().properties(dev)["smem_optin"]

        def fits(m):      # the kernel's static shared memory (manifest) and its dynamic ring
            return m["dynamic_smem"] + m["static_smem"] <= optin
        if not fits(meta):
            if name != default:
                raise InvalidProblemError(f"tile configuration {name!r} needs {meta['dynamic_smem'] + meta['static_smem']} "
                                          f"bytes of shared memory; this device allows {optin} per block")
            name = next((n for n in variant_names(plan) if fits(variants[n])), name)
            meta = variants[name]
    return name, meta


# -- the launcher ------------------------------------------------------------------------------
@dataclass
class Step:
    """One prepared launch of a moe call, and where its pointer parameters come from: ``refs`` =
    ``((slot, ArrayRef, byte offset), ...)`` (the workspace regions are offsets into one array);
    ``maps`` = ``((slot, ArrayRef, MapSpec), ...)``: tensor-map parameters of an array (wgmma).
    The repeated-call fast path re-fills exactly these slots (``FastCall.add_launch(refs=, maps=)``)."""

    prep: PreparedLaunch
    refs: tuple
    maps: tuple = ()


def _step(plan, group: str, fn, grid, block, smem: int, ptrs: dict, maps: Optional[dict] = None, **scalars) -> Step:
    """A :class:`Step` of entry-point group ``group``: ``ptrs`` names each pointer parameter's
    ``(ArrayRef or None, byte offset)`` (None: a null pointer); ``maps`` each tensor-map parameter's
    ``(ArrayRef, MapSpec)``; ``scalars`` the other parameters (the status word's address is one: a
    constant of the device)."""
    abi = plan.abi(group)
    maps = maps or {}
    named = {k: 0 if r is None else r.ptr + off for k, (r, off) in ptrs.items()}
    named.update({k: map_encoder(spec)(r.ptr) for k, (r, spec) in maps.items()})
    prep = PreparedLaunch(fn, tuple(grid), tuple(block), abi, abi.values(**named, **scalars), smem)
    return Step(prep, tuple((abi.slot[k], r, off) for k, (r, off) in ptrs.items() if r is not None),
                tuple((abi.slot[k], r, spec) for k, (r, spec) in maps.items()))


class MoeLauncher(Launcher):
    """Routing prologue (<symbol>_route_*) then the persistent grouped-matmul kernel."""

    args_type = MoeArgs
    main = "gemm"

    def check(self, plan, args: MoeArgs) -> None:
        sku = plan.sku
        if args.op != sku.op:
            raise InvalidProblemError(f"{sku} runs {sku.op}, not {args.op}")
        src = args.x if args.x is not None else args.dy
        if src.kind != sku.element or args.out.kind != (sku.aux_element or sku.element):
            raise InvalidProblemError(f"{sku} takes {sku.element} -> {sku.aux_element or sku.element}; "
                                      f"got {src.kind} -> {args.out.kind}")
        if sku.backend in ("mma", "wgmma"):
            why = (mma_blockers if sku.backend == "mma" else wgmma_blockers)(args)
            if why:
                other = "'mma' or 'simt'" if sku.backend == "wgmma" else "'simt'"
                raise InvalidProblemError(f"{sku} (tensor cores) cannot take this problem: " + "; ".join(why)
                                          + f"; use strategy={other} (or 'auto')")

    def workspace_size(self, plan, args: MoeArgs) -> int:
        return workspace_layout(args.M, args.E, args.routing.mode)["total"]

    def route_steps(self, plan, args: MoeArgs, ws: ArrayRef, bm: Optional[int] = None) -> list:
        """The launches that route rows -> experts into the workspace (no host sync); m-tiles of
        ``bm`` rows."""
        r, dev = args.routing, args.out.device
        lay = workspace_layout(args.M, args.E, r.mode)
        at = {k: (ws, v) for k, v in lay.items() if k != "total"}
        bm = bm or plan.launch["tile"]["BM"]
        threads, warps = plan.launch["route_threads"], plan.launch["route_warps"]
        E, M = args.E, args.M

        def go(name, grid, block, smem=0, ptrs=None, **scalars):
            fn = driver().load_function(plan.registry, plan.entry.unit, plan.entry.entry_point("route_" + name), dev)
            return _step(plan, "route_" + name, fn, grid, block, smem, ptrs, **scalars)
        if r.mode == "offsets":
            name = "offsets_i64" if r.offsets.kind == "i64" else "offsets_i32"
            return [go(name, (1,), (threads,), ptrs=dict(off=(r.offsets, 0), ws_status=at["status"],
                                                          row_start=at["row_start"], tile_start=at["tile_start"],
                                                          counters=at["counters"]),
                       E=E, M=M, bm=bm, trusted=int(r.trusted), status=args.status)]
        chunks, rows = route_chunks(M, E)
        grid = (-(-chunks // warps),)
        smem = warps * (E + 1) * 4
        ids = (r.row_experts, 0)
        return [
            go("count", grid, (32 * warps,), smem, dict(ids=ids, hist=at["hist"]), M=M, E=E, chunk_rows=rows,
               chunks=chunks),
            go("scan", (1,), (threads,), 0, dict(hist=at["hist"], base=at["base"], row_start=at["row_start"],
                                                 tile_start=at["tile_start"], ws_status=at["status"],
                                                 counters=at["counters"]), E=E, M=M, chunks=chunks, bm=bm),
            go("scatter", grid, (32 * warps,), smem, dict(ids=ids, base=at["base"], perm=at["perm"]), M=M, E=E,
               chunk_rows=rows, chunks=chunks)]

    def steps(self, plan, args: MoeArgs, ws: ArrayRef) -> list:
        """Every launch of one pass (routing first unless ``args.routed``), prepared: the variant,
        the grid (occupancy) and the parameters, nothing launched."""
        dev = args.out.device
        cols = args.N if args.op == "grouped_matmul" else args.K
        _, meta = variant_for(plan, args.op, dev, args.M / max(args.E, 1), cols)
        tile = meta["tile"]
        out = [] if args.routed else self.route_steps(plan, args, ws, tile["BM"])
        lay = workspace_layout(args.M, args.E, args.routing.mode)
        drv = driver()
        fn = drv.load_function(plan.registry, plan.entry.unit, meta["symbol"], dev)
        threads, smem = tile["THREADS"], meta["dynamic_smem"]
        if args.op == "grouped_matmul_backward_weight":
            upper = args.E * -(-args.N // tile["BM"]) * -(-args.K // tile["BN"])
        else:
            cols = args.N if args.op == "grouped_matmul" else args.K
            upper = (-(-args.M // tile["BM"]) + args.E + 1) * -(-cols // tile["BN"])
        grid = max(1, min(upper, drv.properties(dev)["sms"] * drv.resident_blocks(fn, threads, smem)))
        x, w, dy = args.x, args.w, args.dy
        ptrs = dict(x=(x, 0), w=(w, 0), dy=(dy, 0), out=(args.out, 0),
                    perm=(ws if args.routing.mode == "row_experts" else None, lay.get("perm", 0)),
                    row_start=(ws, lay["row_start"]), tile_start=(ws, lay["tile_start"]),
                    ws_status=(ws, lay["status"]), counter=(ws, lay["counters"] + 8 * COUNTER_SLOT[args.op]))
        maps = tma_specs(args, tile) if plan.sku.backend == "wgmma" else None
        out.append(_step(plan, "gemm", fn, (grid,), (threads,), smem, ptrs, maps,
                         ldx=x.strides[0] if x is not None else 0,
                         w_se=w.strides[0] if w is not None else 0, w_sn=w.strides[1] if w is not None else 0,
                         lddy=dy.strides[0] if dy is not None else 0, M=args.M, N=args.N, K=args.K, E=args.E))
        return out

    def run(self, plan, args: MoeArgs, stream=None) -> None:
        if args.out.size == 0:
            return
        stream = stream if stream is not None else stream_handle(args.out)
        ws = args.workspace
        if ws is None:
            ws = as_array(empty(args.out, (self.workspace_size(plan, args),), "u8"), "workspace")
        elif ws.size < self.workspace_size(plan, args):
            raise InvalidProblemError(f"workspace has {ws.size} bytes; {self.workspace_size(plan, args)} needed")
        else:
            _workspace_aligned(ws)
        for st in self.steps(plan, args, ws):
            st.prep.launch(stream)


# -- plan selection ----------------------------------------------------------------------------
def _out_kind(op: str, element: str, dw_dtype) -> str:
    if op != "grouped_matmul_backward_weight":
        return element
    k = kind_of(dw_dtype, "dw_dtype")
    if k not in ("f32", element):
        raise UnsupportedError(f"dw_dtype={dw_dtype!r}; dw is float32 or the input dtype ({_dtype_name(element)})")
    return k


def plan_for(args: MoeArgs, strategy: str = "auto", arch: Optional[int] = None):
    """The plan that runs ``args``: ``strategy`` is a backend, or ``auto``: wgmma on sm_90 when it can
    implement the problem, else mma (sm_80+) when it can, else simt. Only these pre-launch checks
    decide; a failure is never retried on another backend."""
    if strategy not in STRATEGIES:
        raise InvalidProblemError(f"strategy={strategy!r}; supported: {', '.join(STRATEGIES)}")
    element = (args.x if args.x is not None else args.dy).kind
    aux = args.out.kind if args.out.kind != element else None
    desc = Descriptor(args.op, element=element, aux_element=aux, category="moe")
    if strategy == "auto":
        if element in kinds.HALF and (arch is None or arch >= 80):
            for backend in (("wgmma", "mma") if arch == WGMMA_ARCH else ("mma",)):
                plan = cached_plan(desc, Preference(backend, arch))
                if plan.can_implement(args):
                    return plan
        return cached_plan(desc, Preference("simt", arch))
    plan = cached_plan(desc, Preference(strategy, arch))
    plan.launcher.check(plan, args)  # a typed error says why the asked-for backend cannot run it
    return plan


def _prepare_op(op, x, w, dy, row_experts, offsets, trusted_offsets, strategy):
    """``_prepare`` for one op, plus the shape of its output."""
    if op not in OPS["moe"]:
        raise InvalidProblemError(f"op={op!r}; supported: {', '.join(OPS['moe'])}")
    xr, wr, dyr, routing, dims = _prepare(op, x, w, dy, row_experts, offsets, trusted_offsets, strategy)
    M, N, K, E = dims
    shape = {"grouped_matmul": (M, N), "grouped_matmul_backward_input": (M, K),
             "grouped_matmul_backward_weight": (E, N, K)}[op]
    return xr, wr, dyr, routing, dims, shape


def _prepare(op, x, w, dy, row_experts, offsets, trusted_offsets, strategy):
    if strategy not in STRATEGIES:
        raise InvalidProblemError(f"strategy={strategy!r}; supported: {', '.join(STRATEGIES)}")
    xr = as_array(x, "x")
    wr = as_array(w, "w")
    dyr = None if op == "grouped_matmul" else as_array(dy, "dy")
    re_ref = None if row_experts is None else as_array(row_experts, "row_experts")
    off_ref = None if offsets is None else as_array(offsets, "offsets")
    M, N, K, E = check_problem(xr, wr, dyr, re_ref, off_ref)
    trusted = bool(trusted_offsets)
    if off_ref is not None and not trusted and config.sync_checks_on():
        validate_offsets(off_ref.obj, M, E)      # the synchronous debug mode (runtime.sync_checks)
    routing = Routing(E, M, re_ref, off_ref, trusted)
    return xr, wr, dyr, routing, (M, N, K, E)


def _status(device: int) -> int:
    """Raise what an earlier call's kernels reported on ``device`` (no sync), then the address of
    its status word: the offsets routing reports invalid offsets there."""
    status.raise_pending(device)
    return status.pointer(device)


def _arch(ref: ArrayRef) -> int:
    return driver().compile_arch(ref.device)


def _args(op, xr, wr, dyr, out: ArrayRef, routing, dims) -> MoeArgs:
    M, N, K, E = dims
    use = {"grouped_matmul": (xr, wr, None), "grouped_matmul_backward_input": (None, wr, dyr),
           "grouped_matmul_backward_weight": (xr, None, dyr)}[op]
    return MoeArgs(op, *use, out, routing, M, N, K, E)


def _placeholder(like: ArrayRef, shape, kind) -> ArrayRef:
    """An output description for plan selection only (no allocation)."""
    return ArrayRef(None, 0, tuple(shape), (0,) * len(shape), kind, like.device, like.framework)


def select_plan(op: str, x, w, dy=None, *, row_experts=None, offsets=None, strategy="auto",
                dw_dtype="float32", trusted_offsets=False):
    """The plan (``plan.sku``: the chosen kernel) that ``grouped_matmul`` / ``_backward`` use."""
    xr, wr, dyr, routing, dims, shape = _prepare_op(op, x, w, dy, row_experts, offsets, trusted_offsets, strategy)
    out = _placeholder(xr, shape, _out_kind(op, xr.kind, dw_dtype))
    return plan_for(_args(op, xr, wr, dyr, out, routing, dims), strategy, _arch(xr))


def grouped_matmul_workspace_size(M: int, E: int, routing: str = "row_experts") -> int:
    """Bytes of the routing workspace that ``grouped_matmul`` / ``_backward`` need for ``M`` rows and
    ``E`` experts routed by ``routing`` (``"row_experts"`` or ``"offsets"``): the size of a
    ``workspace=`` array (uint8). One workspace serves forward and backward calls of that shape;
    the calls that share one must run in one stream (docs/moe.md)."""
    if routing not in ("row_experts", "offsets"):
        raise InvalidProblemError(f"routing={routing!r}; use 'row_experts' or 'offsets'")
    for name, v, lo, hi in (("M", M, 0, MAX_ROWS), ("E", E, 1, MAX_EXPERTS)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not lo <= v <= hi:
            raise InvalidProblemError(f"{name}={v!r}; an integer in [{lo}, {hi}] is required")
    return workspace_layout(int(M), int(E), routing)["total"]


# -- the functional API (runtime/replay.py: a repeated call replays the remembered launches) -------
def _config_key():
    """The tile configurations asked for in code (runtime.moe.CONFIG): part of the replay key, since
    the variant is chosen by the slow path (the settings' SKUFORGE_MOE_CONFIG clears the cache)."""
    return tuple(CONFIG.items()) if CONFIG else None


def grouped_matmul(x, w, *, row_experts=None, offsets=None, strategy="auto", trusted_offsets=False, out=None,
                   workspace=None):
    """``y[m, n] = sum_k x[m, k] * w[e(m), n, k]`` (fp32 accumulation, one rounding); padding rows -> 0.

    ``out``: a C-contiguous ``(M, N)`` array of x's dtype, framework and device, not overlapping
    the inputs, written and returned. ``workspace``: a uint8 array of at least
    ``grouped_matmul_workspace_size(M, E, routing)`` bytes for the routing tables (else one is
    allocated, and a graph replay keeps its own per stream); with both, a repeated call allocates
    nothing (docs/moe.md)."""
    return replay.call("grouped_matmul", (strategy, trusted_offsets, _config_key()),
                       (x, w, row_experts, offsets, out, workspace), _forward)


def _forward(fast, x, w, row_experts, offsets, out, workspace, strategy, trusted_offsets, _config):
    xr, wr, _, routing, dims = _prepare("grouped_matmul", x, w, None, row_experts, offsets, trusted_offsets,
                                        strategy)
    M, N, K, E = dims
    y = None if out is None else _given_out(out, xr, (M, N), xr.kind, "out")
    ws = None if workspace is None else _given_workspace(workspace, xr, M, E, routing.mode)
    if out is not None or workspace is not None:
        check_apart(fast, "grouped_matmul", [("x", xr), ("w", wr), ("row_experts", routing.row_experts),
                                             ("offsets", routing.offsets), ("out", y), ("workspace", ws)], (4, 5))
    if y is None:
        y = as_array(empty(xr, (M, N), xr.kind), "y")
    args = _args("grouped_matmul", xr, wr, None, y, routing, dims)
    plan = plan_for(args, strategy, _arch(xr))
    if y.size:
        _launch(fast, [(plan, args)], xr, ws, routing)
    result = y.obj if out is None else out
    fast.remember(result)
    return result


def grouped_matmul_backward(x, w, dy, *, row_experts=None, offsets=None, strategy="auto", need_input=True,
                            need_weight=True, dw_dtype="float32", trusted_offsets=False, out=None, workspace=None):
    """``(dx, dw)``: ``dx = dy @ w[e(m)]`` (padding rows -> 0), ``dw[e] = dy_e^T @ x_e`` (float32 by
    default, exact zeros for experts with no rows). Deterministic. A gradient not asked for is None.

    ``out=(dx, dw)``: C-contiguous arrays to write into (dx ``(M, K)`` of x's dtype, dw
    ``(E, N, K)`` of ``dw_dtype``; None exactly for a gradient not asked for), returned as given;
    ``workspace`` as for :func:`grouped_matmul` (docs/moe.md)."""
    dxo, dwo = _out_pair(out)
    return replay.call("grouped_matmul_backward",
                       (strategy, need_input, need_weight, dw_dtype, trusted_offsets, out is None, _config_key()),
                       (x, w, dy, row_experts, offsets, dxo, dwo, workspace), _backward)


def _out_pair(out) -> tuple:
    """``out`` of the backward as (dx, dw); (None, None) when absent. Checks its form only."""
    if out is None:
        return None, None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InvalidProblemError(f"out={type(out).__name__}: expected a tuple (dx, dw), None for a gradient "
                                  "not asked for")
    return out[0], out[1]


def _backward(fast, x, w, dy, row_experts, offsets, dxo, dwo, workspace, strategy, need_input, need_weight, dw_dtype,
              trusted_offsets, no_out, _config):
    xr, wr, dyr, routing, dims = _prepare("grouped_matmul_backward_input", x, w, dy, row_experts, offsets,
                                          trusted_offsets, strategy)
    M, N, K, E = dims
    dw_kind = _out_kind("grouped_matmul_backward_weight", xr.kind, dw_dtype)
    if not no_out:
        for arg, given, need, flag, shape in (("out[0] (dx)", dxo, need_input, "need_input", (M, K)),
                                              ("out[1] (dw)", dwo, need_weight, "need_weight", (E, N, K))):
            if need and given is None:
                raise InvalidProblemError(f"{arg} is None but {flag}=True; pass an array of shape {shape} "
                                          f"(or {flag}=False)")
            if given is not None and not need:
                raise InvalidProblemError(f"{arg} is given but {flag}=False: that gradient is not computed; "
                                          "pass None")
    dx = dw = None
    if dxo is not None:
        dx = _given_out(dxo, xr, (M, K), xr.kind, "out[0] (dx)")
    if dwo is not None:
        dw = _given_out(dwo, xr, (E, N, K), dw_kind, "out[1] (dw)", f" (dw_dtype={dw_dtype!r})")
    ws = None if workspace is None else _given_workspace(workspace, xr, M, E, routing.mode)
    if not no_out or workspace is not None:
        check_apart(fast, "grouped_matmul_backward",
                    [("x", xr), ("w", wr), ("dy", dyr), ("row_experts", routing.row_experts),
                     ("offsets", routing.offsets), ("out[0] (dx)", dx), ("out[1] (dw)", dw), ("workspace", ws)],
                    (5, 6, 7))
    if need_input and dx is None:
        dx = as_array(empty(xr, (M, K), xr.kind), "dx")
    if need_weight and dw is None:
        dw = as_array(empty(xr, (E, N, K), dw_kind), "dw")
    jobs = []
    arch = _arch(xr)
    if dx is not None:
        a = _args("grouped_matmul_backward_input", xr, wr, dyr, dx, routing, dims)
        jobs.append((plan_for(a, strategy, arch), a))
    if dw is not None:
        a = _args("grouped_matmul_backward_weight", xr, wr, dyr, dw, routing, dims)
        jobs.append((plan_for(a, strategy, arch), a))
    jobs = [(p, a) for p, a in jobs if a.out.size]
    if jobs:
        _launch(fast, jobs, xr, ws, routing)
    if not no_out:
        result = dxo, dwo
    else:
        result = (None if dx is None else dx.obj), (None if dw is None else dw.obj)
    fast.remember(result)
    return result


def _launch(fast, jobs, like: ArrayRef, ws: Optional[ArrayRef], routing: Routing) -> None:
    """Launch the passes ``jobs`` ([(plan, MoeArgs)], every output non-empty) in the caller's stream:
    the routing once, by the first pass, into ``ws`` (allocated when None), then each pass's
    product; recorded for replay (``fast``: runtime.replay.FastCall)."""
    word = _status(like.device)
    if ws is None:
        ws = as_array(empty(like, (workspace_layout(routing.M, routing.E, routing.mode)["total"],), "u8"),
                      "workspace")
    steps = []
    for i, (plan, a) in enumerate(jobs):
        # route once, with the first kernel's m-tile size (backward-weight does not use m-tiles)
        a.status, a.workspace, a.routed = word, ws, i > 0
        plan.launcher.check(plan, a)
        steps += plan.launcher.steps(plan, a, ws)
    stream = stream_handle(like)
    for st in steps:
        st.prep.launch(stream)
    if routing.offsets is not None and not routing.trusted:
        fast.checks_device_values()          # under runtime.sync_checks() a repeated call validates them
    for st in steps:                         # a replay re-fills the pointers and encodes the new arrays' maps
        fast.add_launch(st.prep, like, refs=st.refs,
                        maps=tuple((j, r, map_encoder(spec)) for j, r, spec in st.maps))


# -- given outputs and workspace ----------------------------------------------------------------
def _given_out(obj, like: ArrayRef, shape, kind: str, arg: str, why: str = "") -> ArrayRef:
    """A caller's output array, checked: framework, shape, dtype, device, C-contiguity."""
    ref = writable(as_array(obj, arg), arg)
    if (ref.framework == "torch") != (like.framework == "torch"):
        raise InvalidProblemError(f"{arg} is a {ref.framework} array but x is a {like.framework} array; "
                                  f"pass a {'torch tensor' if like.framework == 'torch' else 'CuPy array'}")
    if tuple(ref.shape) != tuple(shape) or ref.kind != kind:
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)} and dtype {_dtype_name(ref.kind)}; "
                                  f"expected shape {tuple(shape)} and dtype {_dtype_name(kind)}{why}")
    same_device(("x", like), (arg, ref))
    expect = 1
    for n, st in reversed(list(zip(ref.shape, ref.strides))):
        if n != 1 and st != expect:
            raise InvalidProblemError(f"{arg} must be C-contiguous; got strides {ref.strides} (elements) for "
                                      f"shape {tuple(ref.shape)}")
        expect *= n
    return ref


def _given_workspace(obj, like: ArrayRef, M: int, E: int, mode: str) -> ArrayRef:
    """A caller's routing workspace, checked: a contiguous 1-D uint8 array, 16-byte aligned, of x's
    framework and device, of at least grouped_matmul_workspace_size(M, E, mode) bytes."""
    ref = writable(as_array(obj, "workspace"), "workspace")
    need = workspace_layout(M, E, mode)["total"]
    if (ref.framework == "torch") != (like.framework == "torch"):
        raise InvalidProblemError(f"workspace is a {ref.framework} array but x is a {like.framework} array")
    if ref.kind != "u8" or ref.ndim != 1 or (ref.shape[0] > 1 and ref.strides[0] != 1):
        raise InvalidProblemError(f"workspace has shape {tuple(ref.shape)}, dtype {_dtype_name(ref.kind)} and strides "
                                  f"{ref.strides}; expected a contiguous 1-D uint8 array")
    if ref.shape[0] < need:
        raise InvalidProblemError(f"workspace has {ref.shape[0]} bytes; this call needs {need} "
                                  f"(runtime.moe.grouped_matmul_workspace_size(M={M}, E={E}, routing={mode!r}))")
    same_device(("x", like), ("workspace", ref))
    _workspace_aligned(ref)
    return ref


def _workspace_aligned(ref: ArrayRef) -> None:
    vectors.require_aligned("workspace", ref, WORKSPACE_ALIGN, "the routing tables (8-byte counters and row "
                            "starts, at offsets of 256 bytes)")


def validate_offsets(offsets, M: int, E: Optional[int] = None) -> None:
    """Host-side check of offsets (one device->host copy): a typed error when they are not
    E+1 non-decreasing prefix sums from 0 to M. The kernels check on the device anyway (unless
    ``trusted_offsets=True``) and report to the status word; this is the synchronous alternative."""
    ref = as_array(offsets, "offsets")
    if ref.ndim != 1 or (E is not None and ref.shape[0] != E + 1):
        raise InvalidProblemError(f"offsets must have shape (E+1,); got {tuple(ref.shape)}")
    if ref.framework == "torch":
        host = ref.obj.detach().cpu().numpy()
    else:
        host = ref.obj.get()
    host = host.astype(np.int64)
    if host.size == 0 or host[0] != 0 or host[-1] != M or np.any(np.diff(host) < 0):
        raise InvalidProblemError(f"offsets must rise from 0 to M = {M} without decreasing; "
                                  f"got {host[:8].tolist()}{' ...' if host.size > 8 else ''}")
