"""Dynamic-range quantization: ``q, scale, zero_point = dynamic_quantize(x, ...)``.

Per scope element, the kernels reduce the slice of ``x`` (max |x|, or min/max including 0;
NaN ignored), derive ``scale`` (and ``zero_point``) exactly as docs/numerics.md defines them and quantize, so that
``q == quantize(x, scale, zero_point, qmin=qmin, qmax=qmax)`` bit for bit.

Two launch kinds:

* ``dynamic_fused`` (token, group): one kernel, one launch; a row group (one scale element)
  is reduced and quantized from registers, so ``x`` is read once from DRAM.
* ``dynamic_reduce`` (tensor, channel): the SKU's kernel runs twice (phase 0: per-block
  partial results into a workspace; phase 1: one warp per scale element combines them in a
  fixed order), then the static ``quantize`` kernel of the same scope applies the scales.
  Per-tensor over a contiguous x (s8 / u8 outputs) takes one cooperative launch instead
  (``<symbol>_coop``, dynamic_tensor.cu.j2): reduce with part of x kept in shared memory, a
  grid-wide barrier, the scale combined identically in every block, then quantize. Per-channel
  on the last axis of a contiguous x (s8 / u8) takes one launch too (``<symbol>_chan``,
  dynamic_channel.cu.j2): column tiles x row parts, the parts' ranges folded by integer max on
  the bits of non-negative numbers (exact: any order gives the same bits), a grid barrier where
  there are several parts. The schedule ``two-pass`` (runtime/tuning.py) forces the two passes.
  The same input gives the same bits on every run. The workspace is allocated by the caller's
  framework; ``Plan.workspace_size(args)`` reports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from .. import kinds, replay, status

from . import lowbit
from ..axes import MODES
from ..arrays import ArrayRef, as_array, device_of, empty, kind_of, stream_handle
from ..config import CACHES, settings
from ..device import CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, driver
from ..errors import InvalidProblemError, UnsupportedError
from ..launch import PreparedLaunch, next_pow2, ptr, row_grid
from .elementwise import ElementwiseArgs
from ..plans import Descriptor, Launcher, Preference, cached_plan
from ..params import channel_params, check_apart, check_scale_dtype, out_arg, positive_scalar, same_device
from .static import code_out
from ..numerics import dynamic_range, empty_slice_params
from ..scopes import check_range, check_scope, implied_zero_point, param_shape, rows_view
from ..tuning import schedule
from ..vectors import CP_ASYNC, fits, require_aligned, stream_word



@dataclass
class DynamicArgs:
    """Launch arguments of a dynamic_quantize SKU (both launch kinds)."""

    x: ArrayRef
    xv: object                   # RowsView of x
    q: ArrayRef
    qv: object                   # RowsView of q
    scale: ArrayRef              # math precision, param shape, contiguous
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
    """A resolved launch of a team kernel (dynamic_common.cu.j2 ``team``)."""

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
           args.x.ptr % 16, args.q.ptr % 16, args.x.device)
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
    """Per-token / per-group: one launch of a fused kernel (dynamic_fused.cu.j2), as runtime.config's
    ``dynamic_config`` says (a :class:`FusedConfig`; the low-bit fused launcher follows it too)."""

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
        call on same-shaped, same-aligned arrays: the functional fast path)."""
        rows, cols = args.xv.rows, args.xv.cols
        fn, grid, block, abi, own = fused_launch(self, plan, args, 1)
        values = abi.values(x=args.x.ptr, x_rs=args.xv.row_stride, q=args.q.ptr, q_rs=args.qv.row_stride,
                            scale=args.scale.ptr, zero_point=ptr(args.zero_point), rows=rows, cols=cols,
                            group_size=args.group_size if args.scope == "group" else cols,
                            eps=float(_scalar(plan.sku.precision.math, args.eps)), qmin=args.qmin, qmax=args.qmax,
                            zp_value=args.zp_value, **own)
        return PreparedLaunch(fn, (grid,), block, abi, values)

    def run(self, plan, args: DynamicArgs, stream=None):
        if args.xv.rows == 0 or args.xv.cols == 0:
            return
        self.prepare(plan, args).launch(stream if stream is not None else stream_handle(args.x))


@dataclass(frozen=True)
class ReduceConfig:
    vec_ok: bool
    flat: bool             # tensor scope over a contiguous x: one partial per block of a plain stream
    tx: int                # threads along the columns (power of two, <= 256)
    row_parts: int
    col_chunk: int         # columns per part (slices); cols for the column layout
    slots: int             # scale elements
    parts: int             # partial results per scale element
    grid0: int
    grid1: int
    coop: bool = False     # the one-launch cooperative kernel <symbol>_coop: grid0 blocks of COOP_THREADS
    smem: int = 0          # coop / chan: dynamic shared memory per block (bytes, whole tiles)
    width: int = 0         # coop: threads per tile (16-byte vectors), <= COOP_THREADS
    keep_tiles: int = 0    # coop / chan: tiles a block keeps in shared memory (no more than x has)
    chan: bool = False     # the one-launch per-channel kernel <symbol>_chan: grid0 = col_tiles * row_parts
    col_tiles: int = 0     # chan: column tiles of tx 16-byte vectors
    threads: int = 0       # chan: threads per block (tx x rows of a tile)

    @property
    def partials(self) -> int:
        return self.slots * self.parts

    @property
    def barrier(self) -> bool:
        """One launch with a grid barrier: a 16-byte counter (and, per channel, the column words)."""
        return self.coop or (self.chan and self.row_parts > 1)


class DynamicReduceLauncher(Launcher):
    """Per-tensor / per-channel: reduce (phase 0, 1) then the static quantize kernel; per-tensor
    over a contiguous x: the one-launch cooperative kernel where the SKU and device have it."""

    args_type = DynamicArgs

    BLOCK = 256
    MIN_ELEMS = 1 << 14    # elements per work item, at least (amortises the block reduction)
    COOP_THREADS = 1024    # <symbol>_coop: threads per block
    COOP_BLOCKS = 2        # resident per SM (__launch_bounds__(1024, 2)); f64: 1
    CHAN_THREADS = 1024    # <symbol>_chan: threads per block of the cooperative launch (one per SM)
    CHAN_TX = (128, 64, 32, 16, 8)   # column vectors of a tile, widest first (the kernel's MAX_TX: 128)
    CHAN_ONE_PART = 256    # rows up to which a block takes its column tile's every row (no barrier)
    CHAN_ONE_PART_THREADS = 256   # ... in blocks of at most this many threads
    # The schedule's path (the dynamic_reduce launch kind, codegen/families/quantization/launch.py): "one" takes the one-launch kernel where the SKU,
    # the layout and the device allow; "two": the reduce + quantize launches.

    def check(self, plan, args: DynamicArgs):
        _check_kinds(plan, args)
        need = self.workspace_size(plan, args)
        have = 0 if args.workspace is None else args.workspace.size * args.workspace.itemsize
        if have < need:
            raise InvalidProblemError(f"{plan.sku}: workspace of {have} bytes; {need} are needed "
                                      "(Plan.workspace_size(args))")
        if need:     # the partial results in the math precision, the cooperative kernel's 32-bit counter
            require_aligned("workspace", args.workspace, kinds.SIZE[plan.sku.precision.math],
                            f"the partial results ({plan.sku.precision.math}) it holds")

    def config(self, plan, args: DynamicArgs) -> ReduceConfig:
        rows, cols = args.xv.rows, args.xv.cols
        inner, count, last = channel_params(args.x.shape, args.scope, args.axis)
        rvec = plan.launch["rvec"]
        vec_ok = _vec_ok(rvec, [(args.x, args.xv)], cols)
        v = rvec if vec_ok else 1
        props = driver().properties(args.x.device)
        one = schedule(plan, rows * cols, props).get("path", "one") == "one"
        per_sm = max(1, props["max_threads_per_sm"] // self.BLOCK)
        target = 4 * props["sms"] * per_sm               # work items: a few per resident block
        units = max(1, -(-cols // v))
        if last:                                          # one scale per column
            chan = self.chan_config(plan, args) if one else None
            if chan is not None:
                return chan
            tx = min(self.BLOCK, next_pow2(units))
            ty = self.BLOCK // tx
            tiles = -(-cols // (tx * v))
            row_parts = max(1, min(-(-target // tiles), rows // (32 * ty)))
            return ReduceConfig(vec_ok, False, tx, row_parts, cols, cols, row_parts,
                                max(1, min(row_parts * tiles, props["sms"] * per_sm)), self._grid1(cols, props))
        if args.scope == "tensor":
            count = 1
            coop = self.coop_config(plan, args) if one else None
            if coop is not None:
                return coop
            if vec_ok and (rows == 1 or args.xv.row_stride == cols):
                fn = plan.registry.kernel(plan.sku, args.x.device)     # one resident wave of blocks
                blocks = max(1, min(props["sms"] * driver().resident_blocks(fn, self.BLOCK),
                                    -(-(rows * cols) // self.MIN_ELEMS)))
                return ReduceConfig(True, True, self.BLOCK, blocks, cols, 1, blocks, blocks, self._grid1(1, props))
        sub = rows // count                               # rows of one slice
        want = max(1, min(-(-target // count), -(-(sub * cols) // self.MIN_ELEMS)))
        if want <= sub:
            row_parts, col_parts = want, 1
        else:                                             # few, long rows: split the columns too
            row_parts = sub
            col_parts = max(1, min(-(-want // sub), -(-cols // (self.BLOCK * v))))
        col_chunk = -(-cols // col_parts)
        col_chunk = -(-col_chunk // v) * v                # chunks start on a vector boundary
        col_parts = -(-cols // col_chunk)
        tx = min(self.BLOCK, next_pow2(max(1, -(-min(col_chunk, cols) // v))))
        parts = row_parts * col_parts
        return ReduceConfig(vec_ok, False, tx, row_parts, col_chunk, count, parts,
                            max(1, min(count * parts, props["sms"] * per_sm)), self._grid1(count, props))

    def _grid1(self, slots, props):
        return max(1, min(-(-slots * 32 // self.BLOCK), props["sms"] * 8))

    def coop_config(self, plan, args: DynamicArgs) -> Optional[ReduceConfig]:
        """The cooperative per-tensor launch, or None: a SKU without the kernel (low-bit outputs), x or q not contiguous, x not 16-byte aligned, q not aligned to one
        vector of codes, or a device without cooperative launches."""
        if not plan.launch.get("coop"):
            return None
        rows, cols, v = args.xv.rows, args.xv.cols, plan.launch["rvec"]
        contiguous = rows == 1 or (args.xv.row_stride == cols and args.qv.row_stride == cols)
        if not (contiguous and fits(args.x, 0, CP_ASYNC) and fits(args.q, 0, stream_word(args.q.kind, v))):
            return None
        dev = args.x.device
        drv = driver()
        fn = drv.load_function(plan.registry, plan.entry.unit, plan.entry.entry_point("coop"), dev)
        per_sm = 1 if plan.sku.element == "f64" else self.COOP_BLOCKS
        # each resident block's share of the SM's shared memory, less the driver's 1 KB per block
        want = drv.attribute(dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR) // per_sm - 2048
        blocks, smem = drv.cooperative_shape(fn, self.COOP_THREADS, dev, want)
        if blocks == 0:
            return None
        nvec = rows * cols // v
        per_block = -(-nvec // blocks)
        width = min(self.COOP_THREADS, max(32, -(-per_block // 32) * 32))   # small x: every block gets some
        keep = min(smem // (16 * width), -(-nvec // (blocks * width)))     # whole tiles, no more than x has
        return ReduceConfig(True, True, self.COOP_THREADS, blocks, cols, 1, blocks, blocks, 0, coop=True,
                            smem=keep * 16 * width, width=width, keep_tiles=keep)

    def chan_config(self, plan, args: DynamicArgs) -> Optional[ReduceConfig]:
        """The one-launch per-channel kernel (channel on the last axis), or None: a SKU without it,
        x or q not contiguous, a row that is not whole 16-byte vectors, x not 16-byte aligned, q not
        aligned to one vector of codes, or (many rows) a device without cooperative launches or
        more column tiles than resident blocks.
        Up to CHAN_ONE_PART rows: one block per column tile of 8 vectors takes every row (kept in
        shared memory: x read once, no barrier, a plain launch). More rows: one 1024-thread block
        per SM, column tiles of the widest TX (up to the row) that keeps the grid within 5 % of the fullest,
        row parts (interleaved tiles of rows) filling the rest of the resident grid, a cooperative
        launch."""
        if not plan.launch.get("chan"):
            return None
        rows, cols, v = args.xv.rows, args.xv.cols, plan.launch["rvec"]
        contiguous = rows == 1 or (args.xv.row_stride == cols and args.qv.row_stride == cols)
        if not (contiguous and cols % v == 0 and fits(args.x, 0, CP_ASYNC)
                and fits(args.q, 0, stream_word(args.q.kind, v))):
            return None
        cvecs = cols // v
        dev = args.x.device
        if rows <= self.CHAN_ONE_PART:
            tx = self.CHAN_TX[-1]
            ty = min(self.CHAN_ONE_PART_THREADS // tx, -(-rows // 4) * 4)    # whole warps
            tiles = -(-cvecs // tx)
            keep = -(-rows // ty)
            return ReduceConfig(True, False, tx, 1, cols, cols, 0, tiles, 0, chan=True, col_tiles=tiles,
                                threads=tx * ty, keep_tiles=keep, smem=keep * 16 * tx * ty)
        drv = driver()
        fn = drv.load_function(plan.registry, plan.entry.unit, plan.entry.entry_point("chan"), dev)
        want = drv.attribute(dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR) - 2048
        blocks, smem = drv.cooperative_shape(fn, self.CHAN_THREADS, dev, want)
        shapes = []
        for tx in self.CHAN_TX:
            tiles = -(-cvecs // tx)
            if tiles <= blocks and (tx == self.CHAN_TX[-1] or tx <= next_pow2(cvecs)):   # no tile wider than a row
                parts = max(1, min(blocks // tiles, -(-rows // (self.CHAN_THREADS // tx))))
                shapes.append((tiles * parts, tx, tiles, parts))
        if not shapes:
            return None
        most = max(s[0] for s in shapes)
        _, tx, tiles, parts = next(s for s in shapes if s[0] * 1.05 >= most)     # the widest near the fullest
        ty = self.CHAN_THREADS // tx
        keep = min(smem // (16 * self.CHAN_THREADS), -(-rows // (parts * ty)))   # whole tiles, no more than a part has
        return ReduceConfig(True, False, tx, parts, cols, cols, 0, tiles * parts, 0, chan=True, col_tiles=tiles,
                            threads=self.CHAN_THREADS, keep_tiles=keep, smem=keep * 16 * self.CHAN_THREADS)

    def workspace_size(self, plan, args: DynamicArgs) -> int:
        """Bytes of scratch one call needs: the partial results (hi, and lo in asymmetric mode); for
        a one-launch kernel with a grid barrier, 16 bytes ahead of them for its counter (per
        channel: then one word per column, two in asymmetric mode, instead of the partial results)."""
        if args.xv.rows == 0 or args.xv.cols == 0:
            return 0
        cfg = self.config(plan, args)
        if cfg.chan:
            return self._column_words(plan, args.xv.cols) if cfg.barrier else 0
        item = kinds.SIZE[plan.sku.precision.math]
        return (16 if cfg.coop else 0) + cfg.partials * item * (2 if plan.sku.mode == "asymmetric" else 1)

    @staticmethod
    def _column_words(plan, cols: int) -> int:
        """Bytes of the per-channel kernel's workspace: the 16-byte counter, then one word per column
        (the math precision's size), two in asymmetric mode (max(x, 0), then 0 - min(x, 0))."""
        return 16 + cols * kinds.SIZE[plan.sku.precision.math] * (2 if plan.sku.mode == "asymmetric" else 1)

    def run(self, plan, args: DynamicArgs, stream=None):
        rows, cols = args.xv.rows, args.xv.cols
        if rows == 0 or cols == 0:
            return
        stream = stream if stream is not None else stream_handle(args.x)
        cfg = self.config(plan, args)
        eps = float(_scalar(plan.sku.precision.math, args.eps))
        drv = driver()
        if cfg.chan:                          # one launch: reduce, (grid barrier,) quantize
            fn = drv.load_function(plan.registry, plan.entry.unit, plan.entry.entry_point("chan"), args.x.device)
            ws = args.workspace.ptr if cfg.barrier else 0
            abi = plan.abi("chan")
            values = abi.values(x=args.x.ptr, q=args.q.ptr, colmax=ws + 16 if ws else 0, count=ws,
                                scale=args.scale.ptr, zero_point=ptr(args.zero_point), rows=rows, cols=cols,
                                tx_width=cfg.tx, col_tiles=cfg.col_tiles, row_parts=cfg.row_parts,
                                keep_tiles=cfg.keep_tiles, eps=eps, qmin=args.qmin, qmax=args.qmax,
                                zp_value=args.zp_value)
            if not cfg.barrier:
                drv.launch(fn, (cfg.grid0,), (cfg.threads,), abi.fmt, values, stream, cfg.smem)
                return
            with drv.on_context_of(fn):           # the stream's device, for the memset too
                drv.memset_u32(ws, 0, self._column_words(plan, cols) // 4, stream)   # the counter, the column words
                drv.launch_cooperative(fn, cfg.grid0, cfg.threads, abi.fmt, values, stream, cfg.smem)
            return
        if cfg.coop:                          # one launch: reduce, grid barrier, quantize
            fn = drv.load_function(plan.registry, plan.entry.unit, plan.entry.entry_point("coop"), args.x.device)
            ws = args.workspace.ptr
            abi = plan.abi("coop")
            values = abi.values(x=args.x.ptr, q=args.q.ptr, partial=ws + 16, count=ws, scale=args.scale.ptr,
                                zero_point=ptr(args.zero_point), n=rows * cols, keep_tiles=cfg.keep_tiles,
                                width=cfg.width, eps=eps, qmin=args.qmin, qmax=args.qmax, zp_value=args.zp_value)
            with drv.on_context_of(fn):           # the stream's device, for the memset too
                drv.memset_u32(ws, 0, 1, stream)  # the barrier counter
                drv.launch_cooperative(fn, cfg.grid0, self.COOP_THREADS, abi.fmt, values, stream, cfg.smem)
            return
        inner, count, last = channel_params(args.x.shape, args.scope, args.axis)
        if args.scope == "tensor":
            count = 1
        fn = plan.registry.kernel(plan.sku, args.x.device)
        abi = plan.abi()
        named = dict(x=args.x.ptr, x_rs=args.xv.row_stride, partial=args.workspace.ptr, scale=args.scale.ptr,
                     zero_point=ptr(args.zero_point), rows=rows, cols=cols, chan_inner=inner, chan_count=count,
                     chan_last=int(last), row_parts=cfg.row_parts, col_chunk=cfg.col_chunk, tx_width=cfg.tx,
                     eps=eps, qmin=args.qmin, qmax=args.qmax, zp_value=args.zp_value, vec_ok=int(cfg.vec_ok),
                     flat=int(cfg.flat))
        drv.launch(fn, (cfg.grid0,), (self.BLOCK,), abi.fmt, abi.values(**named, phase=0), stream)
        drv.launch(fn, (cfg.grid1,), (self.BLOCK,), abi.fmt, abi.values(**named, phase=1), stream)
        # quantize with the scales just written: the static kernel, so q == quantize(x, scale, zp)
        qargs = ElementwiseArgs(ins=[(args.x, args.xv)], outs=[(args.q, args.qv)], scale=args.scale,
                                zero_point=args.zero_point, zp_value=args.zp_value, rows=rows, cols=cols,
                                group_size=1, chan_inner=inner if args.scope == "channel" else 1,
                                chan_count=count if args.scope == "channel" else 1,
                                chan_last=bool(last), qmin=args.qmin, qmax=args.qmax)
        # (the quantize kernel of the same arch: sm89 low-bit SKUs pair with the sm89 quantize)
        qplan = cached_plan(Descriptor("quantize", args.scope, args.mode, plan.sku.element, plan.sku.aux_element),
                            Preference(arch=plan.sku.arch_number))
        qplan.run(qargs, stream=stream)


class LowBitFusedLauncher(Launcher):
    """Per-token / per-group low-bit dynamic quantization: one launch of the fused kernel
    (lowbit_dynamic_fused.cu.j2), configured as runtime.quantization.dynamic.DynamicFusedLauncher does."""

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
        """The launch as a :class:`PreparedLaunch` (the functional fast path re-fills its pointers)."""
        rows, cols = args.xv.rows, args.xv.cols
        fn, grid, block, abi, own = fused_launch(self, plan, args, plan.launch["pack"])
        mx = args.scale.kind == lowbit.E8M0
        values = abi.values(x=args.x.ptr, x_rs=args.xv.row_stride, q=args.q.ptr, q_rs=args.qv.row_stride,
                            scale=0 if mx else args.scale.ptr, scale_e8m0=args.scale.ptr if mx else 0,
                            zero_point=ptr(args.zero_point), rows=rows, cols=cols,
                            group_size=args.group_size if args.scope == "group" else cols,
                            eps=float(_scalar(plan.sku.precision.math, args.eps)), qmin=args.qmin, qmax=args.qmax,
                            zp_value=args.zp_value, **own)
        return PreparedLaunch(fn, (grid,), block, abi, values)

    def run(self, plan, args, stream=None):
        if args.xv.rows == 0 or args.xv.cols == 0:
            return
        self.prepare(plan, args).launch(stream if stream is not None else stream_handle(args.x))


# -- the functional API ------------------------------------------------------------------------
def _resolve_range(qk: str, mode: str, qmin, qmax):
    """(qmin, qmax, zp_value) after validation; symmetric zero point = the implied one."""
    if mode == "symmetric":
        dmin, dmax, _ = dynamic_range(qk, mode)
        qmin, qmax = check_range(qk, dmin if qmin is None else qmin, dmax if qmax is None else qmax)
        zp, implied = (qmin + qmax + 1) // 2, implied_zero_point(qk)
        if zp != implied:
            raise InvalidProblemError(
                f"qmin={qmin}, qmax={qmax}: symmetric mode's zero point (qmin + qmax + 1) // 2 = {zp} differs from "
                f"{implied}, the zero point that quantize/dequantize(zero_point=None) imply for {qk}; "
                f"use a range centred on {implied} (default {dmin}..{dmax}) or mode='asymmetric'")
        return qmin, qmax, implied
    qmin, qmax = check_range(qk, qmin, qmax)
    return qmin, qmax, 0


def _fill(like: ArrayRef, shape, kind: str, value):
    """A new array of ``shape`` in the caller's framework, filled with ``value``."""
    a = empty(like, shape, kind)
    _fill_into(a, like.framework, value)
    return a


def _fill_into(obj, framework: str, value) -> None:
    """Sets every element of a caller's array: torch ``fill_``, CuPy ``fill``, or, for another object
    with ``__cuda_array_interface__`` (no ``fill`` of its own), through a zero-copy CuPy view."""
    if framework == "torch":
        obj.fill_(value)
    elif hasattr(obj, "fill"):
        with device_of(obj):
            obj.fill(value)
    else:
        driver().fill_foreign(obj, value)


def dynamic_quantize(x, *, scope, mode="symmetric", axis=None, group_size=None, out_dtype="int8",
                     qmin=None, qmax=None, eps=1e-8, scale_dtype="float32", out=None):
    """Quantize ``x`` with scales (and zero points) computed from its own range, per scope.

    Returns ``(q, scale, zero_point)``; ``zero_point`` is ``None`` in symmetric mode (its
    zero point is the one ``quantize(..., zero_point=None)`` implies: 0 for s8, 128 for u8).
    Symmetric: ``scale = max(amax, eps) / (qmax - zp)``, default range s8 -127..127, u8 1..255.
    Asymmetric: ``scale = max((mx - mn) / (qmax - qmin), eps)`` with ``mn = min(min x, 0)``,
    ``mx = max(max x, 0)``, ``zp = clamp(qmin - rne(mn / scale), qmin, qmax)``; full range.
    NaN is ignored by the reductions. ``q == quantize(x, scale, zp, qmin=qmin, qmax=qmax)``.

    ``out``: ``(q, scale)`` or ``(q, scale, zero_point)`` arrays to write into instead of new
    ones (int8 / uint8 outputs; ``zero_point`` only in asymmetric mode), of the shapes and dtypes
    the call returns, in the framework and on the device of ``x``, not overlapping ``x`` or each
    other; they are returned. A repeated call with ``out`` allocates nothing (docs/dynamic.md).
    """
    # the launch configuration is part of the key: a remembered launch is replayed as it was chosen
    cfg = settings()
    static = (scope, mode, axis, group_size, out_dtype, qmin, qmax, eps, scale_dtype, cfg.dynamic_config,
              out is None)
    return replay.call("dynamic_quantize", static, (x, *_out_tuple(out, mode)), _dynamic_quantize)


def _out_tuple(out, mode) -> tuple:
    """``out`` as (q, scale, zero_point or None); three None when absent. Checks its form only."""
    if out is None:
        return None, None, None
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise InvalidProblemError(f"out={type(out).__name__}: expected a tuple (q, scale) or (q, scale, zero_point)")
    q, s, z = (*out, None) if len(out) == 2 else tuple(out)
    if q is None or s is None:
        raise InvalidProblemError("out: q and scale are required (out=(q, scale[, zero_point]))")
    if mode == "asymmetric" and z is None:
        raise InvalidProblemError("out: asymmetric mode returns a zero point; pass out=(q, scale, zero_point)")
    if mode != "asymmetric" and z is not None:
        raise InvalidProblemError(f"out: mode={mode!r} has no zero-point output; pass out=(q, scale)")
    return q, s, z


def _dynamic_quantize(fast, x, q_out, s_out, z_out, scope, mode, axis, group_size, out_dtype, qmin, qmax, eps,
                      scale_dtype, _config, no_out):
    outs = () if no_out else (q_out, s_out, z_out)
    xr = as_array(x, "x")
    if xr.kind not in kinds.FLOAT:
        raise UnsupportedError(f"x has dtype {xr.kind}; dynamic_quantize takes {', '.join(kinds.FLOAT)}")
    qk = kind_of(out_dtype, "out_dtype")
    mx = lowbit.is_e8m0(scale_dtype)
    if mx and qk in kinds.INT8:
        lowbit.check_mx(qk, scope, group_size)          # e8m0 with an s8/u8 output: UnsupportedError
    if qk not in kinds.CODES:
        raise UnsupportedError(f"out_dtype={out_dtype!r}; dynamic_quantize produces {', '.join(kinds.CODES)}")
    if mode not in MODES:
        raise UnsupportedError(f"mode={mode!r}; supported: {', '.join(MODES)}")
    axis = check_scope(xr.shape, scope, axis, group_size)
    k = kinds.kind(qk)
    if k.max is not None:                               # fp8: symmetric, saturating at its largest value
        if mode != "symmetric":
            raise InvalidProblemError(f"mode={mode!r}: {qk} has no zero point; fp8 dynamic quantization is "
                                      "symmetric (scale = max(amax, eps) / fp8_max)")
        lowbit.check_fp8_args(qk, None, qmin, qmax)
        qmin, qmax, zp_value = -int(k.max), int(k.max), 0
    else:
        if k.pack > 1:
            lowbit.check_int4(xr.shape, scope, group_size, qk, "x")
        qmin, qmax, zp_value = _resolve_range(qk, mode, qmin, qmax)
    m = kinds.math_kind(xr.kind)
    eps = positive_scalar(eps, "eps", m)
    if mx:
        lowbit.check_mx(qk, scope, group_size)
    else:
        check_scale_dtype(scale_dtype, xr.kind)
    xv = rows_view(xr, "x")                     # layout errors before anything is allocated
    pshape = param_shape(xr.shape, scope, axis, group_size)
    skind = "u8" if mx else m                   # e8m0 codes live in uint8 arrays
    status.raise_pending(xr.device)
    if outs:
        qref = code_out(outs[0], xr, xr.shape, qk, "out[0] (q)")
        sref = out_arg(outs[1], xr, pshape, skind, "out[1] (scale)")
        zref = None if outs[2] is None else out_arg(outs[2], xr, pshape, "i32", "out[2] (zero_point)")
        qv = rows_view(qref, "out[0] (q)")          # its layout errors name the argument
        same_device(("x", xr), ("out[0] (q)", qref), ("out[1] (scale)", sref),
                    ("out[2] (zero_point)", zref))
        # the kernels read x while they write q, scale (and zero_point): all four apart
        check_apart(fast, "dynamic_quantize", [("x", xr), ("out[0] (q)", qref), ("out[1] (scale)", sref),
                                               ("out[2] (zero_point)", zref)], (1, 2, 3))
    if xr.size == 0:
        # empty slices reduce to 0: the scale (and zero point) of an all-zero slice, no kernel
        s_val, z_val = empty_slice_params(qk, mode, qmin, qmax, eps, kinds.math_kind(xr.kind), e8m0=mx)
        if outs:
            _fill_into(sref.obj, sref.framework, s_val)
            if zref is not None:
                _fill_into(zref.obj, zref.framework, int(z_val))
            return qref.obj, sref.obj, None if zref is None else zref.obj
        q = code_out(None, xr, xr.shape, qk).obj
        return q, _fill(xr, pshape, skind, s_val), None if z_val is None else _fill(xr, pshape, "i32", int(z_val))
    if not outs:
        qref = code_out(None, xr, xr.shape, qk)
        sref = as_array(empty(xr, pshape, skind), "scale")
        zref = as_array(empty(xr, pshape, "i32"), "zero_point") if mode == "asymmetric" else None
        qv = rows_view(qref, "q")
        same_device(("x", xr), ("q", qref))
    result = qref.obj, sref.obj, None if zref is None else zref.obj
    if mx:
        sref = lowbit.retag(sref, lowbit.E8M0)
    args = DynamicArgs(xr, xv, qref, qv, sref, zref, scope, mode, qmin, qmax, zp_value, eps,
                       axis=axis, group_size=group_size)
    plan = cached_plan(Descriptor("dynamic_quantize", scope, mode, xr.kind, qk), lowbit.preference(xr.device))
    if plan.launch["kind"] in ("dynamic_fused", "lowbit_dynamic_fused"):
        # one prepared launch: a repeated call re-allocates and re-fills its pointer slots
        plan.launcher.check(plan, args)
        prep = plan.launcher.prepare(plan, args)
        prep.launch(stream_handle(xr))
        fast.add_launch(prep, xr)
    else:
        nbytes = plan.workspace_size(args)
        if nbytes:
            args.workspace = as_array(empty(xr, (nbytes,), "u8"), "workspace")
        plan.run(args)
        # a repeated call re-allocates and re-runs the launcher on the new arrays, without the checks
        fast.set_runner(replay.launcher_runner(plan, args, ("x", "q", "scale", "zero_point", "workspace")), xr)
    fast.remember(result)
    return result
