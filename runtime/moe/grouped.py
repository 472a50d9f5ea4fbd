"""MoE grouped matmul (docs/numerics.md): functional API, routing workspace and the ``moe_gemm`` launcher.

    y      = grouped_matmul(x, w, row_experts=ids)              # y[m] = w[e(m)] @ x[m]
    dx, dw = grouped_matmul_backward(x, w, dy, offsets=offs)
    grouped_matmul(x, w, offsets=offs, out=y, workspace=ws)     # given arrays: nothing allocated
    plan   = select_plan("grouped_matmul", x, w, row_experts=ids)   # plan.sku: the kernel

``x [M, K]``, ``w [E, N, K]``, ``dy [M, N]``; f32, f16, bf16; fp32 accumulation, one rounding.
Rows go to experts by ``row_experts`` (int32/uint32 [M], any order, ids outside [0, E) are
padding: zero rows in y/dx, nothing in dw) or ``offsets`` (int32/int64 [E+1] prefix sums over
rows sorted by expert). Routing runs on the device in the same stream as the product, with
no host round trip (templates/moe/routing.cuh): a stable counting sort for ``row_experts``,
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
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import config, kinds, status, vectors
from ..axes import OPS
from ..arrays import ArrayRef, as_array, empty, kind_of, stream_handle, writable
from ..device import driver
from ..errors import InvalidProblemError, UnsupportedError
from ..launch import PreparedLaunch
from ..params import check_apart, same_device
from ..plans import Descriptor, Launcher, Preference, cached_plan
from ..signatures import functional
from ..tma import map_encoder

from .problem import (COUNTER_SLOT, MAX_EXPERTS, MAX_ROWS, STRATEGIES, WGMMA_ARCH, WORKSPACE_ALIGN, MoeArgs, Routing,
                      _dtype_name, check_problem, gemm_accesses, mma_blockers, route_chunks, tma_specs, wgmma_blockers,
                      workspace_layout)
from .signatures import GROUPED_MATMUL, GROUPED_MATMUL_BACKWARD
from .variants import CONFIG, variant_for


# -- the launcher ------------------------------------------------------------------------------
@dataclass
class Step:
    """One prepared launch of a moe call, and where its pointer parameters come from: ``refs`` =
    ``((slot, ArrayRef, byte offset), ...)`` (the workspace regions are offsets into one array);
    ``maps`` = ``((slot, ArrayRef, MapSpec), ...)``: tensor-map parameters of an array (wgmma).
    The replay of repeated calls re-fills exactly these slots (``Recording.add_launch(refs=, maps=)``)."""

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

    def accesses(self, sku, launch: dict) -> dict:
        """The grouped-matmul kernel's operand copies and output stores; the routing kernels move
        single elements."""
        return {"gemm": gemm_accesses(sku.backend, sku.element, launch["out"])}

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
    the variant is chosen by the full path (the settings' SKUFORGE_MOE_CONFIG clears the cache)."""
    return tuple(CONFIG.items()) if CONFIG else None




def _forward(rec, x, w, row_experts, offsets, out, workspace, strategy, trusted_offsets, _config):
    xr, wr, _, routing, dims = _prepare("grouped_matmul", x, w, None, row_experts, offsets, trusted_offsets,
                                        strategy)
    M, N, K, E = dims
    y = None if out is None else _given_out(out, xr, (M, N), xr.kind, "out")
    ws = None if workspace is None else _given_workspace(workspace, xr, M, E, routing.mode)
    if out is not None or workspace is not None:
        check_apart(rec, {"x": xr, "w": wr, "row_experts": routing.row_experts, "offsets": routing.offsets,
                          "out": y, "workspace": ws}, ("out", "workspace"))
    if y is None:
        y = as_array(empty(xr, (M, N), xr.kind), "y")
    args = _args("grouped_matmul", xr, wr, None, y, routing, dims)
    plan = plan_for(args, strategy, _arch(xr))
    if y.size:
        _launch(rec, [(plan, args)], xr, ws, routing)
    result = y.obj if out is None else out
    rec.remember(result)
    return result


def _forward_key() -> tuple:
    return (_config_key(),)


grouped_matmul = functional(GROUPED_MATMUL, _forward, __name__, key=_forward_key)




def _out_pair(out) -> tuple:
    """``out`` of the backward as (dx, dw); (None, None) when absent. Checks its form only."""
    if out is None:
        return None, None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InvalidProblemError(f"out={type(out).__name__}: expected a tuple (dx, dw), None for a gradient "
                                  "not asked for")
    return out[0], out[1]


def _backward(rec, x, w, dy, row_experts, offsets, dx_out, dw_out, workspace, strategy, need_input, need_weight, dw_dtype,
              trusted_offsets, no_out, _config):
    xr, wr, dyr, routing, dims = _prepare("grouped_matmul_backward_input", x, w, dy, row_experts, offsets,
                                          trusted_offsets, strategy)
    M, N, K, E = dims
    dw_kind = _out_kind("grouped_matmul_backward_weight", xr.kind, dw_dtype)
    if not no_out:
        for arg, given, need, flag, shape in (("out[0] (dx)", dx_out, need_input, "need_input", (M, K)),
                                              ("out[1] (dw)", dw_out, need_weight, "need_weight", (E, N, K))):
            if need and given is None:
                raise InvalidProblemError(f"{arg} is None but {flag}=True; pass an array of shape {shape} "
                                          f"(or {flag}=False)")
            if given is not None and not need:
                raise InvalidProblemError(f"{arg} is given but {flag}=False: that gradient is not computed; "
                                          "pass None")
    dx = dw = None
    if dx_out is not None:
        dx = _given_out(dx_out, xr, (M, K), xr.kind, "out[0] (dx)")
    if dw_out is not None:
        dw = _given_out(dw_out, xr, (E, N, K), dw_kind, "out[1] (dw)", f" (dw_dtype={dw_dtype!r})")
    ws = None if workspace is None else _given_workspace(workspace, xr, M, E, routing.mode)
    if not no_out or workspace is not None:
        check_apart(rec, {"x": xr, "w": wr, "dy": dyr, "row_experts": routing.row_experts,
                          "offsets": routing.offsets, "dx_out": dx, "dw_out": dw, "workspace": ws},
                    ("dx_out", "dw_out", "workspace"), labels={"dx_out": "out[0] (dx)", "dw_out": "out[1] (dw)"})
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
        _launch(rec, jobs, xr, ws, routing)
    if not no_out:
        result = dx_out, dw_out
    else:
        result = (None if dx is None else dx.obj), (None if dw is None else dw.obj)
    rec.remember(result)
    return result


def _backward_key(out) -> tuple:
    """The backward's replay key besides the arguments: whether ``out=`` was given, the tile
    configurations asked for in code."""
    return out is None, _config_key()


grouped_matmul_backward = functional(GROUPED_MATMUL_BACKWARD, _backward, __name__, key=_backward_key,
                                     unpack_out=_out_pair)


def _launch(rec, jobs, like: ArrayRef, ws: Optional[ArrayRef], routing: Routing) -> None:
    """Launch the passes ``jobs`` ([(plan, MoeArgs)], every output non-empty) in the caller's stream:
    the routing once, by the first pass, into ``ws`` (allocated when None), then each pass's
    product; recorded for replay (``rec``: runtime.replay.Recording)."""
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
        rec.checks_device_values()          # under runtime.sync_checks() a repeated call validates them
    for st in steps:                         # a replay re-fills the pointers and encodes the new arrays' maps
        rec.add_launch(st.prep, like, refs=st.refs,
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
