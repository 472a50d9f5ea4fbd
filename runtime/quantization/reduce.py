"""The per-tensor / per-channel dynamic launch (launch kind ``dynamic_reduce``): the two-phase
deterministic reduction then the static quantize kernel, or the one-launch cooperative per-tensor
(``coop``) and per-channel (``chan``) kernels (docs/dynamic.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import kinds
from ..arrays import stream_handle
from ..device import CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, driver
from ..errors import InvalidProblemError
from ..launch import next_pow2, ptr
from ..params import channel_params
from ..plans import Descriptor, Launcher, Preference, cached_plan
from ..tuning import schedule
from ..vectors import CP_ASYNC, Access, fits, require_aligned, stream_word
from .elementwise import ElementwiseArgs
from .fused import DynamicArgs, _check_kinds, _scalar, _vec_ok


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

    def accesses(self, sku, launch: dict) -> dict:
        """Phase 0 reads x in vectors (vec_ok; flat: a contiguous x, its rows unused); the one-launch
        kernels copy x 16 bytes at a time and store q in vectors (per channel: rows of ``cols``
        elements, so a row is whole vectors)."""
        rvec = launch["rvec"]
        x, q = launch["ins"][0]["kind"], launch["outs"][0]["kind"]
        item, how = kinds.SIZE[x], f"{rvec}-element vector loads"
        main = (Access("x", stream_word(x, rvec), item, how, ("x_rs",), ("vec_ok",)),
                Access("x", stream_word(x, rvec), item, how, (), ("flat",)))
        coop = (Access("x", CP_ASYNC, item, "16-byte cp.async copies"),
                Access("q", stream_word(q, rvec), kinds.SIZE[q], f"{rvec}-element vector stores"))
        chan = (Access("x", CP_ASYNC, item, "16-byte cp.async copies and loads", ("cols",)),
                Access("q", stream_word(q, rvec), kinds.SIZE[q], f"{rvec}-element vector stores", ("cols",)))
        return {"main": main, "coop": coop, "chan": chan}
