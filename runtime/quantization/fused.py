"""The fused per-token / per-group dynamic launch (launch kinds ``dynamic_fused`` and
``lowbit_dynamic_fused``): the launch arguments every dynamic launcher takes, the launch
configuration language (``FusedConfig``: team kernels, block kernel), its size rule and grid
(docs/dynamic.md)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from .. import kinds
from ..arrays import ArrayRef, stream_handle
from ..config import CACHES, settings
from ..device import driver
from ..errors import InvalidProblemError, UnsupportedError
from ..launch import PreparedLaunch, next_pow2, ptr, row_grid
from ..plans import Launcher
from ..tuning import schedule
from ..vectors import fits, streams, stream_word
from . import lowbit


@dataclass
class DynamicArgs:
    """Launch arguments of a dynamic_quantize SKU (both launch kinds)."""

    x: ArrayRef
    xv: object                   # RowsView of x
    q: ArrayRef
    qv: object                   # RowsView of q
    scale: ArrayRef              # math precision, param shape (token / group: strided, p_rs / p_gs)
    zero_point: Optional[ArrayRef]   # int32 (asymmetric), else None
    scope: str
    mode: str
    qmin: int
    qmax: int
    zp_value: int                # symmetric: the implied zero point
    eps: float
    axis: Optional[int] = None
    group_size: Optional[int] = None
    workspace: Optional[ArrayRef] = None   # dynamic_reduce: >= workspace_size bytes
    # token / group: element (row, group) of scale and zero_point at row * p_rs + group * p_gs
    # (runtime.scopes.param_layout); None: C order (p_rs = the groups of a row, p_gs = 1)
    p_rs: Optional[int] = None
    p_gs: int = 1

    def param_strides(self, ngroups: int) -> tuple:
        return (ngroups if self.p_rs is None else self.p_rs), self.p_gs


def _check_kinds(plan, args: DynamicArgs):
    sku = plan.sku
    if args.x.kind != sku.element or args.q.kind != sku.aux_element:
        raise InvalidProblemError(f"{sku} takes {sku.element} -> {sku.aux_element}, got {args.x.kind} -> {args.q.kind}")
    m = sku.precision.math
    if args.scale.kind != m:
        raise InvalidProblemError(f"{sku}: scale must be {m}, got {args.scale.kind}")
    if (sku.mode == "asymmetric") != (args.zero_point is not None):
        raise InvalidProblemError(f"{sku}: zero_point array is required exactly in asymmetric mode")


def _vec_ok(vec: int, refs_views, cols: int) -> bool:
    """The vector path is possible: cols % vec == 0 and every stream's address and row stride
    aligned to one vector's word (runtime/vectors.py)."""
    return cols % vec == 0 and all(fits(a, view.row_stride, stream_word(a.kind, vec)) for a, view in refs_views)


def _param_strides(args: DynamicArgs) -> dict:
    """The kernels' ``p_rs`` / ``p_gs``: where row group (row, group) keeps its parameters."""
    rs, gs = args.param_strides(args.xv.cols // (args.group_size if args.scope == "group" else args.xv.cols))
    return {"p_rs": rs, "p_gs": gs}


def _scalar(kind: str, value):
    return np.float64(value) if kind == "f64" else np.float32(value)






# -- the fused per-token / per-group launch (dynamic_fused, lowbit_dynamic_fused) -----------------
@dataclass(frozen=True)
class FusedConfig:
    """How the fused per-token / per-group kernels are launched, chosen at run time among kernels
    compiled into the same SKU: text like ``"auto"``, ``"t16"``, ``"t8,ch=4,threads=256,grid=full"``,
    ``"block"``. Kernels: ``block`` (TX threads per row group up to 512, 64 bytes of x per thread,
    block-wide barriers when TX > 32), ``t16`` / ``t8`` / ``t4`` / ``t2`` (team kernels: P chunks of 16 bytes
    per thread in registers, no block barrier), ``auto`` (a team kernel chosen by row-group length and
    problem size, see :func:`team_launch`).
    ``ch``: chunks per thread and row group of a team kernel (P or P / 2; default by row-group
    length); ``threads``: per block of a team kernel (default 128); ``grid``: ``persistent`` (as
    many blocks as are resident) or ``full`` (one block per unit of work); ``index``: ``div``
    forbids the team kernels' division-free indexing of contiguous rows (to measure it); ``fixed``:
    ``0`` keeps the run-time-TX entry point where a fixed-TX one (``<symbol>_t<P>_tx<TX>``) exists
    (to measure it; default ``1``)."""

    kernel: str = "auto"
    ch: Optional[int] = None
    threads: Optional[int] = None
    persistent: Optional[bool] = None     # None: full grid for t16, persistent otherwise (measured)
    index: str = "auto"
    fixed: bool = True    # the fixed-TX team entry point where the SKU has one for (P, ch, TX)

    @staticmethod
    @lru_cache(maxsize=64)
    def parse(text: str) -> "FusedConfig":
        words = [w.strip() for w in (text or "").split(",") if w.strip()]
        fields: dict = {}
        if words and "=" not in words[0]:
            fields["kernel"] = words.pop(0)
        for w in words:
            key, _, value = w.partition("=")
            if key in ("ch", "threads") and value.strip().lstrip("+-").isdigit():
                fields[key] = int(value)
            elif key == "grid" and value in ("persistent", "full"):
                fields["persistent"] = value == "persistent"
            elif key == "index" and value in ("auto", "div"):
                fields["index"] = value
            elif key == "fixed" and value in ("0", "1"):
                fields["fixed"] = value == "1"
            else:
                raise UnsupportedError(f"SKUFORGE_DYNAMIC_CONFIG={text!r}: {w!r} is not ch=N, threads=N, "
                                       "grid=persistent|full, index=auto|div or fixed=0|1")
        cfg = FusedConfig(**fields)
        k = cfg.kernel
        if not (k in ("auto", "block") or (k[:1] == "t" and k[1:] in ("16", "8", "4", "2"))):
            raise UnsupportedError(f"SKUFORGE_DYNAMIC_CONFIG={text!r}: kernel {k!r}; one of auto, block, t16, t8, t4, t2")
        if cfg.ch is not None and (k[:1] != "t" or cfg.ch not in (int(k[1:]), int(k[1:]) // 2)):
            raise UnsupportedError(f"SKUFORGE_DYNAMIC_CONFIG={text!r}: ch={cfg.ch}; a team kernel tP takes ch=P or P/2")
        if cfg.threads is not None and not (32 <= cfg.threads <= 512 and cfg.threads % 32 == 0):
            raise UnsupportedError(f"SKUFORGE_DYNAMIC_CONFIG={text!r}: threads={cfg.threads}; a multiple of 32, <= 512")
        return cfg


@dataclass(frozen=True)
class TeamLaunch:
    """A resolved launch of a team kernel (``dyn::team``, templates/quantization/dynamic.cuh)."""

    chunks: int            # P: the entry point <symbol>_t<P>
    tx: int                # threads per row group (a power of two <= 512)
    ch: int                # chunks per thread and row group
    threads: int           # per block
    per_block: int         # row groups a block takes per step
    dense: bool            # contiguous rows: row-group offsets without division

    @property
    def rg(self) -> int:   # row groups one after the other in a thread
        return self.chunks // self.ch


def team_launch(plan, args, cfg: FusedConfig, vec_ok: bool, pack: int = 1) -> Optional[TeamLaunch]:
    """The team kernel launch for this problem, or None when the block kernel takes it: config
    ``block``, no team kernel in the SKU (f64), the scalar path, row groups longer than 512 x P
    chunks, or strided rows that the layout cannot index (several row groups per thread, or 2^31
    row groups and more). ``auto`` takes the most chunks per thread (16 for row groups of >= 256
    chunks, else 8) that still gives the problem two warps per SM, else the one with the most warps
    (t2 for the smallest problems)."""
    chunks = plan.launch.get("team_chunks") or []
    if cfg.kernel == "block" or not chunks or not vec_ok:
        return None
    cols = args.xv.cols
    gs = args.group_size if args.scope == "group" else cols
    u = gs // plan.launch["vec"]                       # 16-byte chunks per row group
    vrows = args.xv.rows * (cols // gs)
    dense = cfg.index != "div" and (args.xv.rows == 1 or (args.xv.row_stride == cols
                                                           and args.qv.row_stride * pack == cols))
    if vrows >= 1 << 31 and args.param_strides(cols // gs) != (cols // gs, 1):
        return None            # the team kernels place columns of parameters by a 32-bit division
    if cfg.kernel != "auto":
        return _team(int(cfg.kernel[1:]), cfg.ch, cfg.threads, u, vrows, dense, chunks)
    # auto, from tools/probe_dynamic.py on an H200 (docs/dynamic.md): rows of >= 256
    # chunks take t16 (on a full grid, see fused_launch); shorter row groups (group 128) take t8 in
    # 256-thread blocks (128 for fp8, whose measured best that was); problems too small for two
    # warps per SM step down to the kernel with the most warps, t2 last, in 128-thread blocks
    # (tools/probe_small.py, (16, 4096) bf16: token t2 5.18 us against t4 5.41,
    # group 4.70 against 5.38; 32- or 64-thread blocks measured the same or slower).
    group_threads = 128 if plan.sku.aux_element in kinds.FP8 else 256
    enough, best = 2 * driver().properties(args.x.device)["sms"], None
    for p in (16, 8, 4, 2) if u >= 256 else (8, 4, 2):
        threads = cfg.threads or (None if u >= 256 or p == 2 else group_threads)
        best = _team(p, None, threads, u, vrows, dense, chunks) or best
        if best is not None and -(-vrows // best.per_block) * best.threads // 32 >= enough:
            break
    return best


def team_symbol(plan, team: TeamLaunch, cfg: FusedConfig) -> str:
    """The entry point of a team launch: ``<symbol>_t<P>``, or the fixed-TX ``<symbol>_t<P>_tx<TX>``
    where the SKU has one for (P, ch, TX) (codegen.families.quantization.blocks.TEAM_FIXED) and ``cfg.fixed``; ``symbol``:
    the SKU's team entry points' (a token SKU's are its group SKU's, compiled once)."""
    fixed = [team.chunks, team.ch, team.tx] in (plan.launch.get("team_fixed") or [])
    return plan.entry.entry_point(f"t{team.chunks}_tx{team.tx}" if cfg.fixed and fixed else f"t{team.chunks}")


def _team(p, ch, threads, u, vrows, dense, chunks) -> Optional[TeamLaunch]:
    if p not in chunks:
        return None
    ch = ch or (p if u >= 8 * p else p // 2)
    tx = next_pow2(-(-u // ch))
    if tx > 512 or (not dense and (p // ch > 1 or vrows >= 1 << 31)):
        return None
    threads = max(threads or 128, tx)
    threads -= threads % max(32, tx)
    per_block = threads // max(32, tx) * (32 // tx if tx < 32 else 1) * (p // ch)
    return TeamLaunch(p, tx, ch, threads, per_block, dense)


def fused_config() -> FusedConfig:
    return FusedConfig.parse(settings().dynamic_config)


def fused_grid(fn, work: int, per_block: int, threads: int, device: int, persistent: bool) -> int:
    """One block per ``per_block`` units of ``work``, or (persistent) at most the resident blocks
    (the block kernel measured 2-5 % faster so on H200)."""
    grid = row_grid(work, per_block)
    if not persistent:
        return grid
    drv = driver()
    return min(grid, drv.properties(device)["sms"] * drv.resident_blocks(fn, threads))


def block_config(plan, args, vec_ok: bool, unit: int) -> tuple:
    """(TX, TY, grid) of a block kernel (dynamic_fused / lowbit_dynamic_fused): TX threads per row
    group, each moving ``unit`` elements per access and holding at most the largest register chunk
    count; wider rows for small problems (more parallelism)."""
    cols = args.xv.cols
    gs = args.group_size if args.scope == "group" else cols
    chs = plan.launch["ch_vec"] if vec_ok else plan.launch["ch_scalar"]
    max_tx = plan.launch["max_threads"]
    units = -(-gs // unit)
    tx = min(max_tx, next_pow2(-(-units // chs[-1])))
    vrows = args.xv.rows * (cols // gs)
    props = driver().properties(args.x.device)
    while tx < max_tx and tx < next_pow2(units) and vrows * tx < props["sms"] * props["max_threads_per_sm"]:
        tx *= 2
    threads = max(256, tx)
    ty = threads // tx
    return tx, ty, row_grid(vrows, ty)


_LAUNCHES = CACHES.new()


def fused_launch(launcher, plan, args, pack: int):
    """(function, grid, block, parameter list, its kernel-specific parameters) of a fused launch: a
    team kernel (tx, ch, dense, ngroups) or the block kernel (vec_ok). Cached per plan,
    configuration text and everything the choice depends on (sizes, strides, alignment, device):
    the host cost of a call."""
    s = settings()
    text = s.dynamic_config
    if text == "auto" or s.schedule:
        # the schedule variant (runtime/tuning.py) names the configuration; a configuration set with
        # SKUFORGE_DYNAMIC_CONFIG (anything but auto) wins over the table, a forced schedule over both
        text = schedule(plan, args.xv.rows * args.xv.cols, driver().properties(args.x.device)).get("config", text)
    key = (plan, text, args.xv.rows, args.xv.cols, args.group_size, args.xv.row_stride, args.qv.row_stride,
           args.p_rs, args.p_gs, args.x.ptr % 16, args.q.ptr % 16, args.x.device)
    hit = _LAUNCHES.get(key)
    if hit is None:
        cfg, dev = FusedConfig.parse(text), args.x.device
        vec_ok, tx, ty, _ = launcher.config(plan, args)
        ngroups = args.xv.cols // (args.group_size if args.scope == "group" else args.xv.cols)
        work = args.xv.rows * ngroups
        team = team_launch(plan, args, cfg, vec_ok, pack)
        if team is not None:
            fn = driver().load_function(plan.registry, plan.entry.unit, team_symbol(plan, team, cfg), dev)
            persistent = cfg.persistent if cfg.persistent is not None else team.chunks != 16
            hit = (fn, fused_grid(fn, work, team.per_block, team.threads, dev, persistent), (team.threads,),
                   plan.abi("team"), dict(tx=team.tx, ch=team.ch, dense=int(team.dense), ngroups=ngroups))
        else:
            fn = plan.registry.kernel(plan.sku, dev)
            hit = (fn, fused_grid(fn, work, ty, tx * ty, dev, cfg.persistent is not False), (tx, ty), plan.abi(),
                   dict(vec_ok=int(vec_ok)))
        if len(_LAUNCHES) > 4096:
            _LAUNCHES.clear()
        _LAUNCHES[key] = hit
    return hit


class DynamicFusedLauncher(Launcher):
    """Per-token / per-group: one launch of a fused kernel (templates/quantization/dynamic_int8.cuh), as runtime.config's
    ``dynamic_config`` says (a :class:`FusedConfig`; the low-bit fused launcher follows it too)."""

    one_launch = True

    args_type = DynamicArgs

    def check(self, plan, args: DynamicArgs):
        _check_kinds(plan, args)

    def config(self, plan, args: DynamicArgs):
        """The block kernel's (vec_ok, TX, TY, grid): TX threads per row group, chosen so that each
        thread holds at most the largest register chunk count; wider rows for small problems."""
        cols = args.xv.cols
        gs = args.group_size if args.scope == "group" else cols
        vec = plan.launch["vec"]
        vec_ok = gs % vec == 0 and _vec_ok(vec, [(args.x, args.xv), (args.q, args.qv)], cols)
        return (vec_ok, *block_config(plan, args, vec_ok, vec if vec_ok else 1))

    def prepare(self, plan, args: DynamicArgs) -> PreparedLaunch:
        """The launch as a :class:`PreparedLaunch` (its pointer slots can be re-filled for a repeated
        call on same-shaped, same-aligned arrays: the replay of repeated calls)."""
        rows, cols = args.xv.rows, args.xv.cols
        fn, grid, block, abi, own = fused_launch(self, plan, args, 1)
        values = abi.values(x=args.x.ptr, x_rs=args.xv.row_stride, q=args.q.ptr, q_rs=args.qv.row_stride,
                            scale=args.scale.ptr, zero_point=ptr(args.zero_point), **_param_strides(args),
                            rows=rows, cols=cols,
                            group_size=args.group_size if args.scope == "group" else cols,
                            eps=float(_scalar(plan.sku.precision.math, args.eps)), qmin=args.qmin, qmax=args.qmax,
                            zp_value=args.zp_value, **own)
        return PreparedLaunch(fn, (grid,), block, abi, values)

    def run(self, plan, args: DynamicArgs, stream=None):
        if args.xv.rows == 0 or args.xv.cols == 0:
            return
        self.prepare(plan, args).launch(stream if stream is not None else stream_handle(args.x))


    def accesses(self, sku, launch: dict) -> dict:
        """The data streams as vectors; the team kernels take the vector path only."""
        vec = launch["vec"]
        return {"main": tuple(streams(launch, vec)), "team": tuple(streams(launch, vec, ()))}


class LowBitFusedLauncher(Launcher):
    """Per-token / per-group low-bit dynamic quantization: one launch of the fused kernel
    (templates/quantization/lowbit_dynamic.cuh), configured as runtime.quantization.dynamic.DynamicFusedLauncher does."""

    one_launch = True

    accesses = DynamicFusedLauncher.accesses

    args_type = DynamicArgs

    def check(self, plan, args):
        sku = plan.sku
        if args.x.kind != sku.element or args.q.kind != sku.aux_element:
            raise InvalidProblemError(f"{sku} takes {sku.element} -> {sku.aux_element}, got {args.x.kind} -> {args.q.kind}")
        if args.scale.kind == lowbit.E8M0:
            if not plan.launch.get("mx") or args.group_size != lowbit.MX_GROUP:
                raise InvalidProblemError(f"{sku}: e8m0 scales need an fp8 group-{lowbit.MX_GROUP} kernel")
        elif args.scale.kind != sku.precision.math:
            raise InvalidProblemError(f"{sku}: scale must be {sku.precision.math} (or e8m0), got {args.scale.kind}")
        if (sku.mode == "asymmetric") != (args.zero_point is not None):
            raise InvalidProblemError(f"{sku}: zero_point array is required exactly in asymmetric mode")

    def config(self, plan, args):
        """(vec_ok, TX, TY, grid), as DynamicFusedLauncher.config; the scalar path moves PACK elements."""
        gs = args.group_size if args.scope == "group" else args.xv.cols
        vec, pack = plan.launch["vec"], plan.launch["pack"]
        vec_ok = gs % vec == 0 and _vec_ok(vec, [(args.x, args.xv), (args.q, args.qv)], args.xv.cols)
        return (vec_ok, *block_config(plan, args, vec_ok, vec if vec_ok else pack))

    def prepare(self, plan, args) -> PreparedLaunch:
        """The launch as a :class:`PreparedLaunch` (the replay of repeated calls re-fills its pointers)."""
        rows, cols = args.xv.rows, args.xv.cols
        fn, grid, block, abi, own = fused_launch(self, plan, args, plan.launch["pack"])
        mx = args.scale.kind == lowbit.E8M0
        values = abi.values(x=args.x.ptr, x_rs=args.xv.row_stride, q=args.q.ptr, q_rs=args.qv.row_stride,
                            scale=0 if mx else args.scale.ptr, scale_e8m0=args.scale.ptr if mx else 0,
                            zero_point=ptr(args.zero_point), **_param_strides(args), rows=rows, cols=cols,
                            group_size=args.group_size if args.scope == "group" else cols,
                            eps=float(_scalar(plan.sku.precision.math, args.eps)), qmin=args.qmin, qmax=args.qmax,
                            zp_value=args.zp_value, **own)
        return PreparedLaunch(fn, (grid,), block, abi, values)

    def run(self, plan, args, stream=None):
        if args.xv.rows == 0 or args.xv.cols == 0:
            return
        self.prepare(plan, args).launch(stream if stream is not None else stream_handle(args.x))
