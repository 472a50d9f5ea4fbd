"""Low-bit formats: fp8 (e4m3fn, e5m2) and packed int4 (s4, u4), e8m0 (OCP MX) scales.

Not a route of their own: the ordinary functional API takes these kinds (their packing, range
and zero point come from the kind vocabulary, runtime/kinds.py); this module holds what is
particular to them (container checks, e8m0 scales, the static low-bit launcher):

    q = sf.quantize(x, scale, scope="token", out_dtype="fp8_e4m3")       # fp8_rne_satfinite(x * inv)
    q = sf.quantize(w, scale, scope="group", group_size=128, out_dtype="int4")   # packed, (..., D // 2)
    y = sf.dequantize(q, scale, scope="group", group_size=128, in_dtype="int4", out_dtype="bfloat16")
    q, s, _ = sf.dynamic_quantize(x, scope="group", group_size=32, out_dtype="fp8_e4m3",
                                  scale_dtype="e8m0")                   # MX: s holds e + 127 (uint8)

Containers: packed int4 is a uint8 array of shape ``x.shape[:-1] + (D // 2,)`` (element 2i in the
low nibble, 2i + 1 in the high nibble); fp8 is a ``torch.float8_e4m3fn`` / ``float8_e5m2`` tensor
for torch inputs and a uint8 array of codes for CuPy (which has no fp8 dtype). ``dequantize`` learns
the kind from a torch fp8 dtype, or from ``in_dtype=`` for uint8 containers. e8m0 scales are uint8
arrays (``torch.float8_e8m0fnu`` tensors are accepted too) with ``scale_dtype="e8m0"``.

The kernels are verified bit-exact against ``runtime.reference`` on an H200 (docs/lowbit.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import numbers
import sys
import threading
from typing import Optional

from .. import config, kinds
from ..arrays import ArrayRef, as_array, empty, kind_of, stream_handle, writable
from ..device import driver
from ..errors import InvalidProblemError, UnsupportedError
from ..launch import PreparedLaunch, next_pow2, ptr, row_grid
from ..numerics import MX_GROUP
from ..params import check_param_shape, device_check
from ..plans import Launcher, Preference
from ..scopes import param_shape
from ..tuning import schedule
from ..vectors import fits, streams, stream_word
from .elementwise import ElementwiseArgs, stream_params

FP8 = kinds.FP8            # plain aliases of the kind groups (runtime/kinds.py)
INT4 = kinds.INT4
KINDS = kinds.LOW_BIT
E8M0 = kinds.E8M0


# -- which arch's kernels: the device's, or lower on request --------------------------------------
_local = threading.local()


@contextlib.contextmanager
def prefer_arch(arch: int):
    """Select low-bit kernels built for at most ``sm_<arch>`` in this block (this thread), e.g.
    ``prefer_arch(80)`` runs the software-conversion SKUs on an sm_90 GPU (the checkers do).
    Remembered calls are forgotten on entry and exit: a replay would keep the kernel it chose."""
    from ..replay import CACHE
    if isinstance(arch, bool) or not isinstance(arch, numbers.Integral):
        raise InvalidProblemError(f"prefer_arch({arch!r:.60}): a compute capability such as 80 is required")
    prev = getattr(_local, "arch", None)
    _local.arch = int(arch)
    CACHE.clear()
    try:
        yield
    finally:
        _local.arch = prev
        CACHE.clear()


def preference(device: int) -> Preference:
    cc = driver().properties(device)["cc"]
    forced = getattr(_local, "arch", None)
    return Preference(arch=cc if forced is None else min(cc, forced))


# -- argument helpers ------------------------------------------------------------------------------
def is_e8m0(scale_dtype) -> bool:
    if scale_dtype is None:
        return False
    try:
        return kind_of(scale_dtype, "scale_dtype") == E8M0
    except InvalidProblemError:
        return False


def retag(ref: ArrayRef, kind: str) -> ArrayRef:
    """The same memory described with its low-bit kind (containers are uint8)."""
    return dataclasses.replace(ref, kind=kind)


def packed_shape(shape, kind: str) -> tuple:
    """Shape of q for a logical shape: int4 packs the last axis two per byte."""
    shape = tuple(shape)
    return shape[:-1] + (shape[-1] // 2,) if kind in INT4 else shape


def check_int4(shape, scope, group_size, kind, arg):
    d = shape[-1] if shape else 0
    if d % 2:
        raise InvalidProblemError(f"{arg} has D={d} columns (its last axis); packed {kind} needs an even D "
                                  "(two values per byte)")
    if scope == "group" and group_size % 2:
        raise InvalidProblemError(f"group_size={group_size}: {kind} groups must be even (a byte never straddles "
                                  f"two groups); supported: even divisors of D={d}")


def check_fp8_args(kind, zero_point, qmin, qmax, arg_zp="zero_point"):
    if zero_point is not None:
        raise InvalidProblemError(f"{arg_zp} is given but {kind} has no zero point: fp8 quantization is symmetric "
                                  f"(q = fp8(x / scale)); pass {arg_zp}=None")
    if qmin is not None or qmax is not None:
        raise InvalidProblemError(f"qmin={qmin!r}, qmax={qmax!r}: a range applies to integer outputs; {kind} "
                                  f"saturates at ±{kinds.kind(kind).max:g}")


def check_mx(kind, scope, group_size):
    if kind not in FP8:
        raise UnsupportedError(f"scale_dtype='e8m0': MX block scales are for fp8 data "
                               f"({', '.join(FP8)}); got {kind}")
    if scope != "group" or group_size != MX_GROUP:
        raise InvalidProblemError(f"scale_dtype='e8m0' needs scope='group' with group_size={MX_GROUP} (OCP MX "
                                  f"blocks); got scope={scope!r}, group_size={group_size!r}")


def e8m0_arg(scale, shape, scope, axis, group_size) -> ArrayRef:
    """An e8m0 scale array: uint8 codes (or a float8_e8m0fnu tensor) of the scope's shape."""
    if isinstance(scale, numbers.Number):
        raise InvalidProblemError(f"scale is a scalar ({scale!r}) but scale_dtype='e8m0' needs a uint8 array "
                                  f"of shape {param_shape(shape, scope, axis, group_size)}")
    ref = as_array(scale, "scale")
    if ref.kind not in ("u8", E8M0):
        raise InvalidProblemError(f"scale has dtype {ref.kind}; scale_dtype='e8m0' needs uint8 codes "
                                  "(e + 127) or a float8_e8m0fnu array")
    check_param_shape(ref, param_shape(shape, scope, axis, group_size), scope, "scale")
    if config.sync_checks_on() and ref.size:
        bytes_ = ref
        if ref.framework == "torch" and ref.kind == E8M0:
            bytes_ = dataclasses.replace(ref, obj=ref.obj.view(sys.modules["torch"].uint8), kind="u8")
        device_check(bytes_, "scale", lambda s, m: m.all(s != 255), "e8m0 code 255 is NaN; scales must be finite")
    return retag(ref, E8M0)


def lowbit_out(out, like: ArrayRef, shape, kind: str, arg: str = "out") -> ArrayRef:
    """q's container: given (uint8, or the torch fp8 dtype) or allocated in the caller's framework."""
    if out is None:
        torch_fp8 = kind in FP8 and like.framework == "torch"
        return retag(as_array(empty(like, shape, kind if torch_fp8 else "u8"), "out"), kind)
    ref = writable(as_array(out, arg), arg)
    ok_kinds = ("u8", kind) if kind in FP8 else ("u8",)
    if tuple(ref.shape) != tuple(shape) or ref.kind not in ok_kinds:
        raise InvalidProblemError(f"{arg} has shape {tuple(ref.shape)} and dtype {ref.kind}; expected shape "
                                  f"{tuple(shape)} and dtype {' or '.join(ok_kinds)} for {kind}")
    if (ref.framework == "torch") != (like.framework == "torch"):
        raise InvalidProblemError(f"{arg} is a {ref.framework} array but the input is {like.framework}")
    return retag(ref, kind)


def input_kind(q: ArrayRef, in_dtype) -> Optional[str]:
    """The low-bit kind of dequantize's q (None: an s8/u8 input for the ordinary path)."""
    if in_dtype is None:
        return q.kind if q.kind in FP8 else None
    k = kind_of(in_dtype, "in_dtype")
    if k in KINDS:
        if q.kind not in ("u8", k):
            raise InvalidProblemError(f"q has dtype {q.kind}; in_dtype={in_dtype!r} reads a uint8 container"
                                      + (f" (or a {k} tensor)" if k in FP8 else " (two values per byte)"))
        return k
    if k != q.kind:
        raise InvalidProblemError(f"in_dtype={in_dtype!r} but q has dtype {q.kind}; in_dtype names q's kind: "
                                  f"{q.kind}, or a low-bit kind ({', '.join(KINDS)}) for uint8 containers")
    return None


# -- launchers ---------------------------------------------------------------------------------------
class LowBitElementwiseLauncher(Launcher):
    """rows x cols kernels of lowbit_quantize / lowbit_dequantize.cu.j2 (cols = logical elements;
    the packed stream has cols / pack bytes per row)."""

    one_launch = True

    args_type = ElementwiseArgs

    def check(self, plan, args: ElementwiseArgs):
        want = [s["kind"] for s in plan.launch["ins"] + plan.launch["outs"]]
        got = [a.kind for a, _ in args.ins + args.outs]
        if got != want:
            raise InvalidProblemError(f"{plan.sku} takes {want[0]} -> {want[1]}, got {got[0]} -> {got[1]}")
        if args.cols % plan.launch["pack"]:
            raise InvalidProblemError(f"{plan.sku}: {args.cols} columns; packed int4 needs an even count")
        if args.scale_e8m0 is not None and not plan.launch.get("e8m0"):
            raise InvalidProblemError(f"{plan.sku} takes no e8m0 scales")

    def vec_ok(self, plan, args: ElementwiseArgs) -> bool:
        vec = plan.launch["vec"]
        if args.cols % vec:
            return False
        return all(fits(a, view.row_stride, stream_word(a.kind, vec)) for a, view in args.ins + args.outs)

    def prepare(self, plan, args: ElementwiseArgs) -> PreparedLaunch:
        """Grid, block and parameters by name (a repeated call re-fills its pointer slots)."""
        first = args.ins[0][0]
        fn = plan.registry.kernel(plan.sku, first.device)
        vec_ok = self.vec_ok(plan, args)
        vec, pack = plan.launch["vec"], plan.launch["pack"]
        units = -(-args.cols // (vec * plan.launch.get("unroll", 1))) if vec_ok else -(-args.cols // pack)
        # the schedule variant (runtime/tuning.py): threads per block (the rows layout's grid is full)
        threads = schedule(plan, args.rows * args.cols, driver().properties(first.device)).get("threads", plan.launch["block_threads"])
        tx = min(threads, next_pow2(units))
        ty = threads // tx
        streams = stream_params(plan, args)
        abi = plan.abi()
        values = abi.values(
            **streams, scale=ptr(args.scale), scale_value=0.0 if isinstance(args.scale, ArrayRef) else float(args.scale),
            scale_e8m0=ptr(args.scale_e8m0), zero_point=ptr(args.zero_point), zp_value=args.zp_value,
            rows=args.rows, cols=args.cols, group_size=args.group_size, chan_inner=args.chan_inner,
            chan_count=args.chan_count, chan_last=int(args.chan_last), qmin=args.qmin, qmax=args.qmax,
            vec_ok=int(vec_ok), status=args.status)
        return PreparedLaunch(fn, (row_grid(args.rows, ty),), (tx, ty), abi, values)

    def run(self, plan, args: ElementwiseArgs, stream=None):
        if args.rows == 0 or args.cols == 0:
            return
        self.prepare(plan, args).launch(stream if stream is not None else stream_handle(args.ins[0][0]))

    def accesses(self, sku, launch: dict) -> dict:
        """The data streams as vectors; the parameters are read element by element."""
        return {"main": tuple(streams(launch, launch["vec"]))}
