"""The static elementwise launcher (launch kind ``elementwise``): rows x cols kernels of
templates/quantization/elementwise.cuh (static s8 / u8 quantize and dequantize, the
straight-through and fake-quantize passes), and the stream parameters the low-bit launcher shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .. import kinds
from ..arrays import ArrayRef, stream_handle
from ..device import driver
from ..errors import InvalidProblemError
from ..launch import GRID_CAP, MAX_GRID_X, MAX_GRID_Y, PreparedLaunch, next_pow2, ptr, row_grid
from ..plans import Launcher
from ..tuning import schedule
from ..vectors import Access, fits, streams, stream_word, word


@dataclass
class ElementwiseArgs:
    """Launch arguments of a static elementwise kernel: the rows view of every stream."""

    ins: list                   # [(ArrayRef, RowsView)]
    outs: list                  # [(ArrayRef, RowsView)]
    scale: Union[ArrayRef, float]
    zero_point: Union[ArrayRef, None]   # an array (asymmetric), else zp_value is used
    zp_value: int
    rows: int
    cols: int
    group_size: int = 1
    chan_inner: int = 1
    chan_count: int = 1
    chan_last: bool = False
    qmin: int = 0
    qmax: int = 0
    status: int = 0             # the device's status word (runtime/status.py), or 0: no value checks
    scale_e8m0: Union[ArrayRef, None] = None   # MX block scales (low-bit kernels; ``scale`` is then unused)
    # the streams passed bit-packed (one bit an element, 8 to a byte: launch metadata ``bits``), e.g.
    # ("mask",) for fake_quantize(..., return_mask="bits") and fake_quantize_backward_from_mask
    bits: tuple = ()


def stream_params(plan, args: ElementwiseArgs) -> dict:
    """The pointer and row-stride parameters of every stream, by the names the manifest gives them
    (``x``, ``x_rs``, ``q``, ``q_rs``, ...), for the elementwise and low-bit launchers."""
    out = {}
    for (a, view), spec in zip(args.ins + args.outs, plan.launch["ins"] + plan.launch["outs"]):
        out[spec["name"]], out[spec["name"] + "_rs"] = a.ptr, view.row_stride
    return out


class ElementwiseLauncher(Launcher):
    """rows x cols kernels of templates/quantization/elementwise.cuh."""

    one_launch = True

    args_type = ElementwiseArgs

    def check(self, plan, args: ElementwiseArgs):
        want_in = [s["kind"] for s in plan.launch["ins"]]
        want_out = [s["kind"] for s in plan.launch["outs"]]
        got_in = [a.kind for a, _ in args.ins]
        got_out = [a.kind for a, _ in args.outs]
        if got_in != want_in or got_out != want_out:
            raise InvalidProblemError(f"{plan.sku} takes {want_in} -> {want_out}, got {got_in} -> {got_out}")
        # launch metadata ``bits``: stream -> the int parameter that selects its bit-packed form, or
        # None where the stream is always bit-packed
        bits = plan.launch.get("bits") or {}
        if set(args.bits) - set(bits) or {name for name, p in bits.items() if p is None} - set(args.bits):
            raise InvalidProblemError(f"{plan.sku} takes bit-packed {sorted(bits) or 'none'} "
                                      f"(always: {sorted(n for n, p in bits.items() if p is None)}), got "
                                      f"{sorted(args.bits)}")

    @staticmethod
    def vec_ok(plan, args: ElementwiseArgs) -> bool:
        vec = plan.launch["vec"]
        if args.cols % vec:
            return False
        if plan.sku.scope == "group" and args.group_size % vec:
            return False            # the columns layout needs whole vectors inside one group
        # a bit-packed stream moves one byte a vector: any address and row stride will do
        streams = [(a, view) for (a, view), spec in zip(args.ins + args.outs, plan.launch["ins"] + plan.launch["outs"])
                   if spec["name"] not in args.bits]
        if not all(fits(a, view.row_stride, stream_word(a.kind, vec)) for a, view in streams):
            return False
        # the columns layout reads per-column scales and zero points as vectors too
        return not args.chan_last or all(fits(p, 0, word(p.itemsize, vec)) for p in (args.scale, args.zero_point)
                                         if isinstance(p, ArrayRef))

    def prepare(self, plan, args: ElementwiseArgs) -> "PreparedLaunch":
        """Grid, block and packed parameters; ``run`` launches them. Pointer slots can be
        re-filled for a repeated call on same-shaped arrays (the replay of repeated calls)."""
        first = args.ins[0][0]
        vec, unroll = plan.launch["vec"], plan.launch.get("unroll", 1)
        vec_ok = self.vec_ok(plan, args)
        # the schedule variant (runtime/tuning.py): threads per block, grid shape, entry point
        props = driver().properties(first.device)
        sched = schedule(plan, args.rows * args.cols, props)
        threads = sched.get("threads", plan.launch["block_threads"])
        # per-vector parameters (group, channel on the last axis): the columns layout, or the row-vectors
        # one where the schedule names that entry point; per-row ones: the rows layout
        per_vector = vec_ok and (plan.sku.scope == "group" or (plan.sku.scope == "channel" and args.chan_last))
        entry = "main"
        if per_vector and sched.get("entry"):
            entry, per_vector = sched["entry"], False
        elif vec_ok and plan.sku.scope == "channel" and not args.chan_last:
            entry = "rows"
        if entry == "main":
            fn = plan.registry.kernel(plan.sku, first.device)
        else:
            fn = driver().load_function(plan.registry, plan.entry.unit, plan.entry.entry_point(entry), first.device)
        if per_vector:
            # columns layout (templates/quantization/elementwise.cuh): a grid of (row blocks, column
            # blocks); a thread owns one column vector and walks its rows U at a time. A persistent grid
            # holds at most the resident blocks (one run of steps, a single partial step at its end); a
            # full one has a block per step of work.
            tx = min(threads, next_pow2(-(-args.cols // vec)))
            ty = threads // tx
            row_blocks = -(-args.rows // (ty * unroll))
            col_blocks = 1 if sched.get("columns") == "1d" else max(1, min(-(-args.cols // (tx * vec)), MAX_GRID_Y))
            if sched.get("grid", "persistent") == "persistent":
                resident = props["sms"] * driver().resident_blocks(fn, threads)
                col_blocks = min(col_blocks, resident)
                row_blocks = min(row_blocks, resident // col_blocks)
            grid = (max(1, min(row_blocks, MAX_GRID_X)), col_blocks)
        else:
            # columns per thread-iteration: U vectors (vector path) or one element (scalar path; 8,
            # one byte of bits, with a bit-packed stream)
            units = -(-args.cols // (vec * unroll)) if vec_ok else -(-args.cols // (8 if args.bits else 1))
            tx = min(threads, next_pow2(units))
            ty = threads // tx
            grid = (row_grid(args.rows, ty),)
        if GRID_CAP[0]:
            grid = tuple(min(g, GRID_CAP[0]) for g in grid)
        named = {**stream_params(plan, args), "rows": args.rows, "cols": args.cols, "vec_ok": int(vec_ok)}
        if plan.sku.scope is not None:      # the quantization parameters (the elementwise launch kind's ABI: none without a scope)
            named.update(
                scale=ptr(args.scale), scale_value=0.0 if isinstance(args.scale, ArrayRef) else args.scale,
                zero_point=ptr(args.zero_point), zp_value=args.zp_value, group_size=args.group_size,
                chan_inner=args.chan_inner, chan_count=args.chan_count, chan_last=int(args.chan_last),
                qmin=args.qmin, qmax=args.qmax, status=args.status)
        for name, param in (plan.launch.get("bits") or {}).items():
            if param is not None:
                named[param] = int(name in args.bits)
        abi = plan.abi()
        return PreparedLaunch(fn, grid, (tx, ty), abi, abi.values(**named))

    def run(self, plan, args: ElementwiseArgs, stream=None):
        if args.rows == 0 or args.cols == 0:
            return
        prep = self.prepare(plan, args)
        prep.launch(stream if stream is not None else stream_handle(args.ins[0][0]))

    def accesses(self, sku, launch: dict) -> dict:
        """The data streams as vectors; per channel on the last axis (the columns layout), the
        per-column parameters as vectors too."""
        vec = launch["vec"]
        main = streams(launch, vec)
        if sku.scope == "channel":
            m = kinds.SIZE[sku.precision.math]
            how = f"{vec}-element vector loads"
            main += [Access("scale", word(m, vec), m, how, (), ("vec_ok", "chan_last")),
                     Access("zero_point", word(4, vec), 4, how, (), ("vec_ok", "chan_last"))]
        return {"main": tuple(main)}
