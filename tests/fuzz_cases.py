"""Fuzz problems over every public function (tests/core/test_fuzz.py on the CPU, tests/core/test_gpu_fuzz.py on a GPU).

A :class:`Problem` is one call: the function, its positional and keyword arguments, where every
array is an :class:`Arr` description (shape, dtype, layout, byte offset, aliasing, how its values are
filled). :func:`problems` draws one with hypothesis: a valid call first (consistent shapes, dtypes,
scopes, axes, group sizes, ranges, scales and zero points, routing; strided rows, element-aligned
offsets, in-place and given outputs included), then, often, one or more mutations that break it on
purpose (``Problem.mutations``: a wrong dtype, shape, layout or pointer, junk in place of an array,
a bad keyword or scalar value, an output overlapping an input, bad values in a device array).

The tests materialize the arrays: fake ``__cuda_array_interface__`` arrays at made-up addresses on
the CPU (nothing is read), CuPy / torch arrays holding :func:`host_values` on the GPU.
:func:`expected` is the NumPy reference of a valid problem (runtime/reference.py, bit-exact for the
quantization ops; runtime/reference_moe.py within the tolerances of docs/numerics.md for grouped matmul) and
:func:`compare` checks results against it; the CPU tests run both on host values to keep this
code honest without a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
from hypothesis import strategies as st

from runtime import kinds
from runtime import reference as ref
from runtime import reference_moe as ref_moe
from runtime.moe import grouped_matmul_workspace_size
from runtime.scopes import param_shape

OPS = ("quantize", "dequantize", "dynamic_quantize", "quantize_backward", "dequantize_backward", "fake_quantize",
       "fake_quantize_backward", "fake_quantize_learnable_backward", "grouped_matmul", "grouped_matmul_backward")
POSITIONAL = {"quantize": ("x", "scale", "zero_point"), "dequantize": ("q", "scale", "zero_point"),
              "dynamic_quantize": ("x",), "quantize_backward": ("dy", "x", "scale", "zero_point"),
              "dequantize_backward": ("dy", "scale"), "fake_quantize": ("x", "scale", "zero_point"),
              "fake_quantize_backward": ("dy", "x", "scale", "zero_point"),
              "fake_quantize_learnable_backward": ("dy", "x", "scale", "zero_point"),
              "grouped_matmul": ("x", "w"), "grouped_matmul_backward": ("x", "w", "dy")}
SCOPES = ("tensor", "channel", "token", "group")
NP_NAME = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "s8": "int8", "u8": "uint8",
           "i32": "int32", "u32": "uint32", "i64": "int64"}
# dtypes no op takes, for the mutations (the CPU fakes describe any NumPy dtype)
ODD_DTYPES = ("bool", "int16", "uint16", "uint32", "int64", "complex64", "datetime64[s]")


@dataclass(frozen=True)
class Env:
    """What the materializing side can make: ``floats`` (input dtypes), ``torch`` (torch fp8 code
    containers exist), ``null`` (null data pointers), ``huge`` (extents nothing allocates), ``mutate``
    (the chance, in percent, that a problem is broken on purpose), ``bad_values`` (the chance that
    a scale, zero point, e8m0 code or offset array holds an invalid value: the kernels report it)."""

    floats: tuple = ("float16", "float32", "float64")
    torch: bool = False
    null: bool = True
    huge: bool = True
    mutate: int = 60
    moe_floats: tuple = ("float16", "float32")
    bad_values: int = 0      # percent: invalid values in a device array of an otherwise valid call


CPU = Env()


@dataclass
class Arr:
    """One array argument, described. ``layout``: ``c`` (rows ``pad`` elements apart), or a layout
    no op takes: ``t`` (last two axes swapped), ``rev`` (rows reversed), ``bcast`` (rows stride 0),
    ``overlap`` (rows closer than their length), ``gap`` (leading axes that do not collapse).
    ``offset``: bytes past the buffer's aligned start. ``alias``: (key, byte offset) of another
    argument whose memory this one shares. ``fill``: how the GPU half fills it (host_values)."""

    key: str
    shape: tuple
    dtype: str
    fill: tuple = ("normal",)
    pad: int = 0
    layout: str = "c"
    offset: int = 0
    null: bool = False
    alias: Optional[tuple] = None

    def __repr__(self):
        extra = "".join(f" {k}={getattr(self, k)!r}" for k, d in (("pad", 0), ("layout", "c"), ("offset", 0),
                                                                  ("null", False), ("alias", None))
                        if getattr(self, k) != d)
        return f"<{self.key} {self.shape} {self.dtype}{extra} {self.fill[0]}>"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize if self.dtype not in _TORCH_ONLY else 1 + (self.dtype == "bfloat16")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def strides(self) -> tuple:
        """In elements."""
        shape, nd = self.shape, len(self.shape)
        if nd == 0:
            return ()
        if self.layout == "t" and nd >= 2:
            sw = list(shape)
            sw[-1], sw[-2] = sw[-2], sw[-1]
            st_ = list(_c_strides(sw, 0))
            st_[-1], st_[-2] = st_[-2], st_[-1]
            return tuple(st_)
        st_ = list(_c_strides(shape, self.pad))
        if nd >= 2:
            if self.layout == "rev":
                st_[-2] = -st_[-2]
            elif self.layout == "bcast":
                st_[-2] = 0
            elif self.layout == "overlap":
                st_[-2] = max(1, shape[-1] // 2)
            elif self.layout == "gap" and nd >= 3:
                st_[0] += shape[-1] + self.pad
        return tuple(st_)

    def span(self) -> tuple:
        """(first, end) element offsets relative to the data pointer; (0, 0) when empty."""
        if self.size == 0:
            return 0, 0
        st_ = self.strides()
        lo = sum((n - 1) * s for n, s in zip(self.shape, st_) if s < 0)
        hi = sum((n - 1) * s for n, s in zip(self.shape, st_) if s > 0) + 1
        return lo, hi


_TORCH_ONLY = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _c_strides(shape, pad):
    out, acc = [], 1
    for i, n in enumerate(reversed(shape)):
        out.append(acc)
        acc *= max(n, 1) + (pad if i == 0 else 0)
    return tuple(reversed(out))


@dataclass
class Problem:
    op: str
    args: list
    kw: dict
    meta: dict = field(default_factory=dict)      # what the reference needs (kinds, ranges)
    mutations: list = field(default_factory=list)  # what was broken on purpose ([]: a valid call)
    bad_values: bool = False                       # a device array holds invalid values (GPU half)

    @property
    def valid(self) -> bool:
        return not self.mutations

    def arrays(self) -> list:
        """Every Arr of the call (positional, keyword, inside out= tuples)."""
        found = []

        def walk(v):
            if isinstance(v, Arr):
                found.append(v)
            elif isinstance(v, (tuple, list)):
                for u in v:
                    walk(u)
        for v in self.args:
            walk(v)
        for v in self.kw.values():
            walk(v)
        return found

    def outputs(self) -> list:
        return [a for a in self.arrays() if a.fill[0] in ("out", "workspace")]

    def build(self, make):
        """``(args, kw)`` with every Arr replaced by ``make(arr, made)`` (``made``: key -> object so
        far); aliased arrays are made after the arrays they alias."""
        made = {}
        order = sorted(self.arrays(), key=lambda a: a.alias is not None)
        for a in order:
            made[a.key] = make(a, made)

        def sub(v):
            if isinstance(v, Arr):
                return made[v.key]
            if isinstance(v, tuple):
                return tuple(sub(u) for u in v)
            if isinstance(v, list):
                return [sub(u) for u in v]
            return v
        return [sub(v) for v in self.args], {k: sub(v) for k, v in self.kw.items()}

    def __repr__(self):
        return f"Problem({self.op}, args={self.args!r}, kw={self.kw!r}, mutations={self.mutations})"


def call(sf, p: Problem, args, kw):
    return getattr(sf, p.op)(*args, **kw)


# -- drawing -----------------------------------------------------------------------------------------
class _G:
    def __init__(self, draw):
        self.draw = draw
        self.n = 0

    def pick(self, seq):
        return self.draw(st.sampled_from(tuple(seq)))

    def int(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def chance(self, percent) -> bool:
        return self.draw(st.integers(0, 99)) < percent

    def key(self, name):
        self.n += 1
        return f"{name}#{self.n}"


class SeededG(_G):
    """The drawing interface of :class:`_G` on a ``random.Random`` (no hypothesis): the bases of the
    single-mutation sweep (:func:`single_mutation_problems`)."""

    def __init__(self, rng):
        super().__init__(None)
        self.rng = rng

    def pick(self, seq):
        return self.rng.choice(tuple(seq))

    def int(self, lo, hi):
        return self.rng.randint(lo, hi)

    def chance(self, percent) -> bool:
        return self.rng.randrange(100) < percent


def _spelling(g, kind: str):
    """A user spelling of a kind: the SKU name, a dtype name, or a NumPy type."""
    k = kinds.kind(kind)
    options = [kind, *k.spellings]
    if k.numpy and k.numpy not in ("bfloat16",) and not k.numpy.startswith("float8"):
        options.append(getattr(np, k.numpy))
    return g.pick(options)


def _lead(g, rank):
    return tuple(g.pick((1, 1, 2, 3, 4, 5, 8, 16)) if not g.chance(4) else 0 for _ in range(rank - 1))


def _shape(g, mult=1):
    rank = g.pick((1, 2, 2, 2, 3, 3, 4))
    d = mult * g.pick((1, 1, 2, 3, 4, 8, 16, 32)) if not g.chance(3) else 0
    return _lead(g, rank) + (d,)


def _data(g, key, shape, dtype, fill=("normal",), role_pad=True):
    """A data array: contiguous, or strided rows, or an element-aligned offset (all valid)."""
    item = np.dtype(dtype).itemsize if dtype not in _TORCH_ONLY else (2 if dtype == "bfloat16" else 1)
    pad = g.pick((0, 0, 0, 1, 3, 8)) if role_pad and len(shape) >= 2 else 0
    offset = item * g.pick((0, 0, 0, 0, 1, 3)) if role_pad else 0
    return Arr(g.key(key), tuple(shape), dtype, fill, pad=pad, offset=offset)


def _param(g, key, shape, dtype, fill):
    """A scale / zero point / code array: C-contiguous, aligned (a parameter's contract)."""
    return Arr(g.key(key), tuple(shape), dtype, fill)


def _positive(g):
    return g.pick((0.5, 0.25, 0.1, 0.0625, 1.0, 2.0, 3.7, 1e-3, 1e3, 0.013))


def _scope(g, gs_choices, mult=1):
    """(scope, axis, group_size, last-axis multiple); the caller draws a channel axis for its shape."""
    scope = g.pick(SCOPES)
    axis = gs = None
    if scope == "group":
        gs = g.pick(gs_choices)
        mult = gs * (mult if gs % mult else 1)
    return scope, axis, gs, mult


def _scale(g, shape, scope, axis, gs, math_np, mx=False):
    pshape = param_shape(shape, scope, None if axis is None else axis % len(shape), gs)
    if mx:
        return _param(g, "scale", pshape, "uint8", ("e8m0",))
    if scope == "tensor":
        choice = g.int(0, 4)
        if choice == 0:
            return _positive(g)
        if choice == 1:
            return np.float32(_positive(g)) if math_np == "float32" else np.float64(_positive(g))
        if choice == 2:
            return g.pick((1, 2, 4))                                     # an int scale
        return _param(g, "scale", g.pick(((), (1,))), math_np, ("scale",))
    return _param(g, "scale", pshape, math_np, ("scale",))


def _zero_point(g, shape, scope, axis, gs, lo, hi, required=False):
    if not required and g.chance(40):
        return None
    pshape = param_shape(shape, scope, None if axis is None else axis % len(shape), gs)
    if scope == "tensor" and g.chance(50):
        return g.int(lo, hi)
    return _param(g, "zero_point", pshape, "int32", ("zp", lo, hi))


def _range(g, qk):
    """(qmin, qmax) keyword values for an integer code kind: None (the full range) or a sub-range."""
    lo, hi = kinds.QRANGE[qk]
    if g.chance(60):
        return None, None
    a = g.int(lo, hi - 1)
    b = g.int(a + 1, hi)
    return a, b


def _code_container(g, env, qk, shape):
    """(dtype, shape) of the container of codes of kind ``qk`` for a logical ``shape``."""
    if qk in kinds.INT4:
        return "uint8", tuple(shape[:-1]) + (shape[-1] // 2,)
    if qk in kinds.FP8:
        return (kinds.kind(qk).numpy if env.torch and g.chance(50) else "uint8"), tuple(shape)
    return NP_NAME[qk], tuple(shape)


def _out(g, key, shape, dtype, chance=35):
    if not g.chance(chance):
        return None
    return Arr(g.key(key), tuple(shape), dtype, ("out",))


def _coded(g, int4_groups=(2, 4, 8, 16, 32, 64)):
    """(code kind, MX?, scope, axis, group size, x's shape) of a call with codes: fp8 with e8m0 scales
    takes groups of 32; packed int4 even groups and an even last axis."""
    qk = g.pick(kinds.CODES)
    mx = qk in kinds.FP8 and g.chance(25)
    pack = 2 if qk in kinds.INT4 else 1
    if mx:
        scope, axis, gs, mult = "group", None, 32, 32
    else:
        scope, axis, gs, mult = _scope(g, int4_groups if pack == 2 else (1, 2, 4, 8, 16, 32, 64, 128), pack)
    shape = _shape(g, mult)
    if scope == "channel":
        axis = g.int(-len(shape), len(shape) - 1)
    return qk, mx, scope, axis, gs, shape


def _quantize(g, env):
    xk = g.pick(env.floats)
    qk, mx, scope, axis, gs, shape = _coded(g)
    math_np = "float64" if xk == "float64" else "float32"
    x = _data(g, "x", shape, xk)
    scale = _scale(g, shape, scope, axis, gs, math_np, mx)
    qmin = qmax = zp = None
    if qk not in kinds.FP8:
        qmin, qmax = _range(g, qk)
        lo, hi = kinds.QRANGE[qk]
        zp = _zero_point(g, shape, scope, axis, gs, lo if qmin is None else qmin, hi if qmax is None else qmax)
    kw = dict(scope=scope, out_dtype=_spelling(g, qk))
    if axis is not None:
        kw["axis"] = axis
    if gs is not None:
        kw["group_size"] = gs
    if qmin is not None:
        kw.update(qmin=qmin, qmax=qmax)
    if mx:
        kw["scale_dtype"] = "e8m0"
    elif g.chance(10):
        kw["scale_dtype"] = g.pick(("float32", None) if xk != "float64" else ("float32", "float64", None))
    cdt, cshape = _code_container(g, env, qk, shape)
    out = _out(g, "out", cshape, cdt)
    if out is not None:
        kw["out"] = out
    return Problem("quantize", [x, scale, zp], kw, meta=dict(xk=xk, qk=qk, mx=mx, shape=shape))


def _dequantize(g, env):
    yk = g.pick(env.floats)
    qk, mx, scope, axis, gs, shape = _coded(g)
    cdt, cshape = _code_container(g, env, qk, shape)
    q = _data(g, "q", cshape, cdt, ("codes", qk))
    math_np = "float64" if yk == "float64" else "float32"
    scale = _scale(g, shape, scope, axis, gs, math_np, mx)
    zp = None
    if qk not in kinds.FP8:
        lo, hi = kinds.QRANGE[qk]
        zp = _zero_point(g, shape, scope, axis, gs, lo, hi)
    kw = dict(scope=scope, out_dtype=_spelling(g, kinds.of(yk)))
    if axis is not None:
        kw["axis"] = axis
    if gs is not None:
        kw["group_size"] = gs
    if qk in kinds.LOW_BIT and (cdt == "uint8" or g.chance(30)):
        kw["in_dtype"] = _spelling(g, qk)
    elif g.chance(10):
        kw["in_dtype"] = qk
    if mx:
        kw["scale_dtype"] = "e8m0"
    out = _out(g, "out", shape, yk)
    if out is not None:
        kw["out"] = out
    return Problem("dequantize", [q, scale, zp], kw, meta=dict(yk=yk, qk=qk, mx=mx, shape=shape))


def _symmetric_range(g, qk):
    """A custom range centred on the implied zero point, or None (the default)."""
    if g.chance(60):
        return None, None
    z = 128 if qk == "u8" else (8 if qk == "u4" else 0)
    lo, hi = kinds.QRANGE[qk]
    b = g.int(1, min(z - lo, hi - z + 1) if z else hi)
    return (z - b, z + b - 1) if z else (-b - g.int(0, 1 if b < hi else 0), b)


def _dynamic(g, env):
    xk = g.pick(env.floats)
    qk, mx, scope, axis, gs, shape = _coded(g, (2, 4, 8, 16, 32, 64, 128))
    mode = "symmetric" if qk in kinds.FP8 else g.pick(("symmetric", "asymmetric"))
    x = _data(g, "x", shape, xk)
    kw = dict(scope=scope, out_dtype=_spelling(g, qk))
    if mode != "symmetric" or g.chance(30):
        kw["mode"] = mode
    if axis is not None:
        kw["axis"] = axis
    if gs is not None:
        kw["group_size"] = gs
    qmin = qmax = None
    if qk not in kinds.FP8:
        qmin, qmax = _symmetric_range(g, qk) if mode == "symmetric" else _range(g, qk)
        if qmin is not None:
            kw.update(qmin=qmin, qmax=qmax)
    if g.chance(20):
        kw["eps"] = g.pick((1e-8, 1e-5, 0.5, 1e-30, 3))
    math_np = "float64" if xk == "float64" else "float32"
    if mx:
        kw["scale_dtype"] = "e8m0"
    elif g.chance(15):
        kw["scale_dtype"] = g.pick(("float32", None) if xk != "float64" else ("float32", "float64", None))
    if g.chance(35):
        pshape = param_shape(shape, scope, None if axis is None else axis % len(shape), gs)
        cdt, cshape = _code_container(g, env, qk, shape)
        outs = [Arr(g.key("out[0]"), cshape, cdt, ("out",)),
                Arr(g.key("out[1]"), pshape, "uint8" if mx else math_np, ("out",))]
        if mode == "asymmetric":
            outs.append(Arr(g.key("out[2]"), pshape, "int32", ("out",)))
        kw["out"] = tuple(outs) if g.chance(80) else list(outs)
    return Problem("dynamic_quantize", [x], kw, meta=dict(xk=xk, qk=qk, mx=mx, mode=mode, shape=shape,
                                                          qmin=qmin, qmax=qmax))


def _training(g, env, op):
    xk = g.pick(env.floats)
    scope, axis, gs, mult = _scope(g, (1, 2, 4, 8, 16, 32, 64))
    shape = _shape(g, mult)
    if scope == "channel":
        axis = g.int(-len(shape), len(shape) - 1)
    math_np = "float64" if xk == "float64" else "float32"
    x = _data(g, "x", shape, xk)
    dy = _data(g, "dy", shape, xk)
    scale = _scale(g, shape, scope, axis, gs, math_np)
    kw = dict(scope=scope)
    if axis is not None:
        kw["axis"] = axis
    if gs is not None:
        kw["group_size"] = gs
    meta = dict(xk=xk, shape=shape)
    if op == "dequantize_backward":
        args = [dy, scale]
    else:
        if op == "quantize_backward":
            qk = g.pick(kinds.INT8)
            kw["out_dtype"] = _spelling(g, qk)
            qmin, qmax = _range(g, qk)
            lo, hi = kinds.QRANGE[qk]
            meta["qk"] = qk
        else:
            qk = None
            if g.chance(50):
                qmin, qmax = None, None
                lo, hi = -128, 127
            else:
                lo = g.pick((-128, -8, 0, -1000, -(2 ** 24), -3)) if op != "fake_quantize_learnable_backward" \
                    else g.pick((-128, -8, 0, -1000, -3))
                hi = g.pick((127, 7, 255, 15, 1000, 2 ** 24, 1))
                if lo >= hi:
                    lo, hi = -128, 127
                qmin, qmax = lo, hi
        if qmin is not None:
            kw.update(qmin=qmin, qmax=qmax)
            lo, hi = qmin, qmax
        meta.update(qmin=lo, qmax=hi)
        zp = _zero_point(g, shape, scope, axis, gs, lo, hi)
        args = [x, scale, zp] if op == "fake_quantize" else [dy, x, scale, zp]
        if op == "fake_quantize" and g.chance(30):
            kw["return_mask"] = g.pick((True, "bits"))
        if op == "fake_quantize_learnable_backward" and g.chance(30):
            kw["grad_factor"] = g.pick((0.5, 1.0, 2.0, -1.0, 0.0, 3))
    if g.chance(40):
        ins = [a for a in args[:2] if isinstance(a, Arr) and a.fill[0] == "normal"] \
            if op in ("quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward",
                      "fake_quantize_learnable_backward") else []
        if ins and g.chance(30):                                 # exactly in place: allowed
            src = g.pick(ins)
            kw["out"] = replace(src, key=g.key("out"), fill=("out",), alias=(src.key, 0), offset=0)
        else:
            kw["out"] = Arr(g.key("out"), shape, xk, ("out",))
    return Problem(op, args, kw, meta=meta)


def _moe(g, env, op):
    xk = g.pick(env.moe_floats)
    E = g.pick((1, 2, 3, 4, 8))
    M = g.pick((0, 1, 5, 16, 33, 64, 100))
    N = g.pick((8, 16, 24, 40, 64, 7))
    K = g.pick((8, 16, 32, 40, 64, 12))
    half = xk in ("float16", "bfloat16")
    strategy = g.pick(("auto", "auto", "simt", "mma" if half and N % 8 == 0 and K % 8 == 0 else "simt", None))
    pad = g.pick((0, 0, 8, 16)) if strategy != "mma" else g.pick((0, 8))
    x = Arr(g.key("x"), (M, K), xk, ("finite",), pad=pad)
    w = Arr(g.key("w"), (E, N, K), xk, ("finite",), pad=g.pick((0, 0, 8)))
    args = [x, w]
    kw = {}
    if strategy is not None:
        kw["strategy"] = strategy
    routing = g.pick(("row_experts", "offsets"))
    if routing == "row_experts":
        kw["row_experts"] = _param(g, "row_experts", (M,), g.pick(("int32", "uint32")), ("ids", E))
    else:
        kw["offsets"] = _param(g, "offsets", (E + 1,), g.pick(("int32", "int64")), ("offsets", M, E))
        if g.chance(20):
            kw["trusted_offsets"] = True
    meta = dict(xk=xk, M=M, N=N, K=K, E=E, routing=routing)
    if op == "grouped_matmul":
        if g.chance(30):
            kw["out"] = Arr(g.key("out"), (M, N), xk, ("out",))
    else:
        args.append(Arr(g.key("dy"), (M, N), xk, ("finite",), pad=g.pick((0, 0, 8))))
        need_input, need_weight = g.pick(((True, True), (True, True), (True, False), (False, True), (False, False)))
        if not need_input:
            kw["need_input"] = False
        if not need_weight:
            kw["need_weight"] = False
        dwk = "float32"
        if g.chance(30):
            dwk = g.pick(("float32", xk))
            kw["dw_dtype"] = dwk
        meta.update(need_input=need_input, need_weight=need_weight, dwk=dwk)
        if g.chance(30):
            kw["out"] = (Arr(g.key("out[0]"), (M, K), xk, ("out",)) if need_input else None,
                         Arr(g.key("out[1]"), (E, N, K), dwk, ("out",)) if need_weight else None)
    if g.chance(25):
        n = grouped_matmul_workspace_size(M, E, routing) + g.pick((0, 0, 256))
        kw["workspace"] = Arr(g.key("workspace"), (n,), "uint8", ("workspace",))
    return Problem(op, args, kw, meta=meta)


_MAKERS = {"quantize": _quantize, "dequantize": _dequantize, "dynamic_quantize": _dynamic,
           "grouped_matmul": lambda g, env: _moe(g, env, "grouped_matmul"),
           "grouped_matmul_backward": lambda g, env: _moe(g, env, "grouped_matmul_backward")}
for _op in ("quantize_backward", "dequantize_backward", "fake_quantize", "fake_quantize_backward",
            "fake_quantize_learnable_backward"):
    _MAKERS[_op] = (lambda op: lambda g, env: _training(g, env, op))(_op)


# -- mutations -----------------------------------------------------------------------------------
class HostDLPack:
    """A CPU array behind the DLPack protocol (``__dlpack_device__`` says kDLCPU): what a JAX or a
    NumPy-like CPU array hands over."""

    def __init__(self):
        self.a = np.zeros((4, 8), np.float32)

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def __repr__(self):
        return "HostDLPack()"


class BareDLPack(HostDLPack):
    """A CPU array with ``__dlpack__`` only (no ``__dlpack_device__``): the importer finds out."""

    __dlpack_device__ = None

    def __repr__(self):
        return "BareDLPack()"


JUNK = (None, 3.0, 7, "x", [1, 2], (), True, object(), np.float32(1.5), np.zeros(4, np.float32), b"\x00",
        HostDLPack(), BareDLPack())
BAD_SCALARS = (0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-45, 1e-46, 1e-300, 1e308, 3.5e38,
               np.float64(1e300), 10 ** 400, -(10 ** 400), True, "0.5", None, np.float64("nan"), np.float32(-2.0),
               2 ** 64, [0.5], complex(1, 1))
BAD_INTS = (None, -1, 0, 1, 2, 3, 5, 7, 2 ** 31, 2 ** 62, 2 ** 63, 2 ** 70, -(2 ** 70), 1.0, 1.5, True, False, "16",
            np.int64(16), np.int32(-1), float("nan"), [16], 10 ** 30)
KW_BAD = {
    "scope": ("row", "TENSOR", None, 0, "", ["token"], "channel", "token", "group", "tensor"),
    "axis": BAD_INTS + (-5, 4),
    "group_size": BAD_INTS + (32, 64, 128, 3, 6),
    "out_dtype": ("int16", "float8", "e8m0", "bool", None, 8, "int4", "uint4", "fp8_e5m2", "int8", "uint8",
                  "float32", "bfloat16", np.int16, np.float16, "s4", "i32"),
    "in_dtype": ("int8", "uint8", "int4", "fp8_e4m3", "float32", None, "i64", 3, "e8m0"),
    "qmin": BAD_INTS + (-129, 256, -(2 ** 24) - 1, 2 ** 24),
    "qmax": BAD_INTS + (-129, 256, -(2 ** 24) - 1, 2 ** 24 + 1),
    "eps": BAD_SCALARS,
    "mode": ("symmetric", "asymmetric", "affine", None, 1),
    "scale_dtype": ("e8m0", "float64", "float16", "int8", None, "nonsense", 5, "float8_e8m0fnu"),
    "grad_factor": BAD_SCALARS,
    "return_mask": (True, False, 1, None, "yes"),
    "strategy": ("mma", "simt", "auto", "cutlass", None, 1),
    "trusted_offsets": (True, False, 1, None, "no"),
    "need_input": (True, False, None, 0),
    "need_weight": (True, False, None, 0),
    "dw_dtype": ("float32", "float16", "bfloat16", "float64", "int8", None, 3),
    "out": JUNK + ((None, None), (None,), ()),
}
STATIC_KW = {"quantize": ("scope", "axis", "group_size", "out_dtype", "qmin", "qmax", "scale_dtype", "out"),
             "dequantize": ("scope", "axis", "group_size", "out_dtype", "in_dtype", "scale_dtype", "out"),
             "dynamic_quantize": ("scope", "axis", "group_size", "out_dtype", "qmin", "qmax", "eps", "mode",
                                  "scale_dtype", "out"),
             "quantize_backward": ("scope", "axis", "group_size", "out_dtype", "qmin", "qmax", "out"),
             "dequantize_backward": ("scope", "axis", "group_size", "out"),
             "fake_quantize": ("scope", "axis", "group_size", "qmin", "qmax", "return_mask", "out"),
             "fake_quantize_backward": ("scope", "axis", "group_size", "qmin", "qmax", "out"),
             "fake_quantize_learnable_backward": ("scope", "axis", "group_size", "qmin", "qmax", "grad_factor", "out"),
             "grouped_matmul": ("strategy", "trusted_offsets", "out"),
             "grouped_matmul_backward": ("strategy", "trusted_offsets", "need_input", "need_weight", "dw_dtype",
                                         "out")}
MUTATIONS = ("dtype", "shape", "layout", "offset", "null", "junk", "kwarg", "overlap", "scalar", "bad_values",
             "huge", "routing")


def _replace_arr(p: Problem, key: str, new):
    def sub(v):
        if isinstance(v, Arr) and v.key == key:
            return new
        if isinstance(v, tuple):
            return tuple(sub(u) for u in v)
        if isinstance(v, list):
            return [sub(u) for u in v]
        return v
    p.args = [sub(v) for v in p.args]
    p.kw = {k: sub(v) for k, v in p.kw.items()}
    # an array aliasing the replaced one keeps its own memory
    for a in p.arrays():
        if a.alias is not None and a.alias[0] == key and not isinstance(new, Arr):
            _replace_arr(p, a.key, replace(a, alias=None))


def mutate(g: _G, p: Problem, env: Env):
    what = g.pick([m for m in MUTATIONS if (m != "null" or env.null) and (m != "huge" or env.huge)])
    arrs = p.arrays()
    if what in ("dtype", "shape", "layout", "offset", "null", "junk", "huge") and not arrs:
        what = "kwarg"
    if what in ("dtype", "shape", "layout", "offset", "null", "junk", "huge"):
        a = g.pick([x for x in arrs if len(x.shape) >= 2] or arrs) if what == "layout" else g.pick(arrs)
        pools = {"dtype": [d for d in ODD_DTYPES + env.floats + ("int8", "uint8", "int32") if d != a.dtype],
                 "shape": ("add", "drop", "bump", "zero", "one"), "layout": ("t", "rev", "bcast", "overlap", "gap"),
                 "offset": (1, 2, 3, 4, 6, 8, 12), "null": (None,), "junk": JUNK,
                 "huge": (2 ** 31, 2 ** 40, 2 ** 62 - 1, 2 ** 62, 2 ** 63)}
        _array_mutation(g, p, a, what, g.pick(pools[what]))
    elif what == "kwarg":
        name = g.pick(STATIC_KW[p.op])
        v = g.pick(KW_BAD[name])
        p.kw[name] = v
        p.mutations.append(f"{name}={v!r:.40}")
    elif what == "overlap":
        outs = p.outputs()
        if not outs or len(arrs) < 2:
            p.mutations.append("overlap (none: no output)")
            return mutate(g, p, env)
        a = g.pick(outs)
        b = g.pick([o for o in arrs if o.key != a.key])
        lo, hi = b.span()
        nbytes = max(1, (hi - lo) * b.itemsize)
        off = g.pick((0, 0, b.itemsize, nbytes // 2, nbytes - 1, -a.itemsize, nbytes))
        _replace_arr(p, a.key, replace(a, alias=(b.key, off), offset=0, null=False))
        p.mutations.append(f"{a.key} over {b.key}+{off}")
    elif what == "scalar":
        pos = POSITIONAL[p.op]
        slots = [i for i, n in enumerate(pos) if n in ("scale", "zero_point") and i < len(p.args)]
        if not slots:
            return mutate(g, p, env)
        i = g.pick(slots)
        v = g.pick(BAD_SCALARS if pos[i] == "scale" else ZP_SCALARS)
        p.args[i] = v
        p.mutations.append(f"{pos[i]}={v!r:.40}")
    elif what == "bad_values":
        if not _bad_values(g, p):
            return mutate(g, p, env)
    elif what == "routing":
        if not p.op.startswith("grouped_matmul"):
            return mutate(g, p, env)
        _routing(g, p, g.pick(("both", "neither", "ids_dtype", "ids_shape", "offs_shape", "validate")))


def _array_mutation(g: _G, p: Problem, a: Arr, what: str, value) -> None:
    """Change array ``a`` of ``p``: its dtype, shape (``value``: how), layout, byte offset, a null
    pointer, junk in its place, or a huge extent."""
    if what == "dtype":
        _replace_arr(p, a.key, replace(a, dtype=value))
        p.mutations.append(f"{a.key}.dtype={value}")
    elif what == "shape":
        shape = list(a.shape)
        if value == "add" or not shape:
            shape.insert(g.int(0, len(shape)), g.pick((1, 2, 3)))
        elif value == "drop":
            shape.pop(g.int(0, len(shape) - 1))
        else:
            i = g.int(0, len(shape) - 1)
            shape[i] = {"bump": shape[i] + g.pick((-1, 1, 2)), "zero": 0, "one": 1}[value]
            shape[i] = max(shape[i], 0)
        _replace_arr(p, a.key, replace(a, shape=tuple(shape)))
        p.mutations.append(f"{a.key}.shape={tuple(shape)}")
    elif what == "layout":
        _replace_arr(p, a.key, replace(a, layout=value))
        p.mutations.append(f"{a.key}.layout={value}")
    elif what == "offset":
        _replace_arr(p, a.key, replace(a, offset=a.offset + value))
        p.mutations.append(f"{a.key}.offset+={value}")
    elif what == "null":
        _replace_arr(p, a.key, replace(a, null=True, alias=None))
        p.mutations.append(f"{a.key}.null")
    elif what == "huge":
        shape = list(a.shape) or [1]
        shape[g.int(0, len(shape) - 1)] = value
        _replace_arr(p, a.key, replace(a, shape=tuple(shape), pad=0))
        p.mutations.append(f"{a.key}.shape={tuple(shape)}")
    else:
        _replace_arr(p, a.key, value)
        p.mutations.append(f"{a.key}={value!r:.40}")


def _routing(g: _G, p: Problem, how: str) -> None:
    """Change a MoE call's routing arguments (``how``: both given, neither, a wrong ids dtype or
    shape, a wrong offsets shape, or the strategy / trusted_offsets keywords)."""
    M, E = p.meta["M"], p.meta["E"]
    if how == "both":
        p.kw["row_experts"] = _param(g, "row_experts", (M,), "int32", ("ids", E))
        p.kw["offsets"] = _param(g, "offsets", (E + 1,), "int32", ("offsets", M, E))
    elif how == "neither":
        p.kw.pop("row_experts", None)
        p.kw.pop("offsets", None)
    elif how == "ids_dtype":
        p.kw.pop("offsets", None)
        p.kw["row_experts"] = _param(g, "row_experts", (M,), g.pick(("int64", "float32", "int16")), ("ids", E))
    elif how == "ids_shape":
        p.kw.pop("offsets", None)
        p.kw["row_experts"] = _param(g, "row_experts", (M + 1, 1)[:g.int(1, 2)], "int32", ("ids", E))
    elif how == "offs_shape":
        p.kw.pop("row_experts", None)
        n = E + g.pick((0, 2, -1 if E > 1 else 3))
        p.kw["offsets"] = _param(g, "offsets", (n,), "int64", ("offsets", M, E))
    else:
        p.kw["strategy"] = g.pick(("mma", "simt"))
        p.kw["trusted_offsets"] = g.pick((0, 1, "yes", None, 2.5))
    p.mutations.append(f"routing {how}")


def _bad_values(g, p: Problem) -> bool:
    """An invalid value in one scale / zero point / e8m0 / offsets array (still a valid call: the
    kernels check the values they read and report them)."""
    cands = [a for a in p.arrays() if a.fill[0] in ("scale", "zp", "e8m0", "offsets")]
    if not cands:
        return False
    a = g.pick(cands)
    _replace_arr(p, a.key, replace(a, fill=(a.fill[0] + "!",) + a.fill[1:]))
    p.bad_values = True
    return True


# -- the single-mutation sweep ---------------------------------------------------------------------
# Every bad value of the tables above, each alone in an otherwise valid call (a random draw often
# pairs it with another mutation that fails first): (what, detail) pairs, applied by _apply_single.
ARRAY_SINGLES = ([("dtype", d) for d in ODD_DTYPES + ("float16", "float32", "float64", "int8", "uint8", "int32")]
                 + [("offset", o) for o in (1, 2, 3, 4, 6, 8, 12)] + [("null", None)]
                 + [("junk", j) for j in JUNK] + [("huge", n) for n in (2 ** 31, 2 ** 40, 2 ** 62 - 1, 2 ** 62, 2 ** 63)]
                 + [("layout", lay) for lay in ("t", "rev", "bcast", "overlap", "gap")]
                 + [("shape", how) for how in ("add", "drop", "bump", "zero", "one")])
ZP_SCALARS = BAD_INTS + (-129, 128, 256, 300, -9)


def single_mutations(op: str, env: Env = CPU) -> list:
    """Every single mutation of ``op``'s calls: ``(what, where, value)``; ``where`` is a keyword, a
    positional scalar slot, or the rotation index of the array a mutation changes."""
    out = [("kwarg", name, v) for name in STATIC_KW[op] for v in KW_BAD[name]]
    for i, name in enumerate(POSITIONAL[op]):
        if name == "scale":
            out += [("scalar", i, v) for v in BAD_SCALARS]
        elif name == "zero_point":
            out += [("scalar", i, v) for v in ZP_SCALARS]
    singles = [m for m in ARRAY_SINGLES if (m[0] != "null" or env.null) and (m[0] != "huge" or env.huge)]
    out += [("array", k, m) for k, m in enumerate(singles)]
    if op.startswith("grouped_matmul"):
        out += [("routing", None, how) for how in ("neither", "ids_dtype", "ids_shape", "offs_shape")]
    return out


def _fits(p: Problem, what: str, where, value) -> bool:
    """Whether ``p`` is a base that shows this mutation alone: a scalar replaces a tensor-scope
    scale or zero point of a call that takes one (no e8m0 scales; integer codes for a zero point)."""
    if what == "scalar":
        pos = POSITIONAL[p.op][where]
        return (p.kw.get("scope") == "tensor" and not p.meta.get("mx") and where < len(p.args)
                and (pos != "zero_point" or p.meta.get("qk") not in kinds.FP8))
    if what == "array":
        return bool(p.arrays())
    return True


def _apply_single(g: _G, p: Problem, what: str, where, value) -> None:
    if what == "kwarg":
        p.kw[where] = value
        p.mutations.append(f"{where}={value!r:.40}")
    elif what == "scalar":
        p.args[where] = value
        p.mutations.append(f"{POSITIONAL[p.op][where]}={value!r:.40}")
    elif what == "routing":
        _routing(g, p, value)
    else:
        arrs = p.arrays()
        _array_mutation(g, p, arrs[where % len(arrs)], *value)


FLOAT_SCALARS = ("scale", "eps", "grad_factor")    # Python numbers packed into a float parameter


def _math_type(p: Problem) -> str:
    return "f64" if p.meta.get("xk", p.meta.get("yk")) == "float64" else "f32"


def single_mutation_problems(op: str, seed: int, env: Env = CPU):
    """One problem per single mutation of ``op`` (:func:`single_mutations`), each on a valid base
    drawn from ``random.Random(seed)`` that shows it alone (:func:`_fits`); a float scalar (a scale,
    eps, grad_factor) once per math type (float32 and float64 data: their ranges differ)."""
    import random
    rng = random.Random(f"{seed}/{op}")
    bases = [_MAKERS[op](SeededG(rng), env) for _ in range(48)]
    slot = POSITIONAL[op].index("scale") if "scale" in POSITIONAL[op] else None
    for _ in range(1000):          # a tensor-scope base of each math type (the scalar slots need one)
        if slot is None or len({_math_type(b) for b in bases if _fits(b, "scalar", slot, None)}) == 2:
            break
        bases.append(_MAKERS[op](SeededG(rng), env))
    for k, (what, where, value) in enumerate(single_mutations(op, env)):
        fit = [b for b in bases[k % len(bases):] + bases[:k % len(bases)] if _fits(b, what, where, value)]
        name = POSITIONAL[op][where] if what == "scalar" else where
        if what in ("scalar", "kwarg") and name in FLOAT_SCALARS:
            fit = [next(b for b in fit if _math_type(b) == m) for m in ("f32", "f64")
                   if any(_math_type(b) == m for b in fit)]
        for base in fit[:2 if what in ("scalar", "kwarg") and name in FLOAT_SCALARS else 1]:
            p = _copy(base)
            g = SeededG(rng)
            g.n = 1000                  # keys of new arrays (routing) apart from the base's
            _apply_single(g, p, what, where, value)
            yield p


def _copy(p: Problem) -> Problem:
    return Problem(p.op, list(p.args), dict(p.kw), dict(p.meta), list(p.mutations), p.bad_values)


@st.composite
def problems(draw, op: str, env: Env = CPU):
    """A problem for ``op``: valid, or (``env.mutate`` percent of the time) broken on purpose."""
    g = _G(draw)
    p = _MAKERS[op](g, env)
    if g.chance(env.mutate):
        for _ in range(g.pick((1, 1, 1, 2, 3))):
            mutate(g, p, env)
    elif env.bad_values and g.chance(env.bad_values):
        _bad_values(g, p)
    return p


# -- values and the reference (the GPU half; the CPU half runs them on host arrays) ------------------
def _np_dtype(name: str):
    if name in _TORCH_ONLY:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def host_values(p: Problem, rng) -> dict:
    """key -> a NumPy array of every Arr's logical values (what the GPU half uploads)."""
    out = {}
    for a in p.arrays():
        if a.alias is not None:
            continue
        out[a.key] = _values(a, rng)
    return out


def _values(a: Arr, rng) -> np.ndarray:
    kind, *rest = a.fill
    shape, dt = a.shape, _np_dtype(a.dtype)
    bad = kind.endswith("!")
    kind = kind.rstrip("!")
    if kind in ("out", "workspace"):
        return np.zeros(shape, np.uint8).view(dt) if dt.itemsize == 1 else np.zeros(shape, dt)
    if kind == "finite":
        return rng.standard_normal(shape).astype(dt)
    if kind == "normal":
        v = rng.standard_normal(shape) * rng.choice([0.01, 1.0, 3.0, 100.0])
        if v.size and rng.random() < 0.3:          # specials: NaN, +-inf, exact ties
            flat = v.reshape(-1)
            idx = rng.integers(0, flat.size, size=max(1, flat.size // 50))
            flat[idx] = rng.choice([np.nan, np.inf, -np.inf, 0.5, -2.5, 0.0, -0.0], size=idx.size)
        with np.errstate(invalid="ignore", over="ignore"):    # a mutated integer dtype: any values
            return v.astype(dt)
    if kind == "scale":
        v = (rng.random(shape) * 0.2 + 0.01).astype(dt)
        if bad and v.size:
            v.reshape(-1)[rng.integers(0, v.size)] = rng.choice([0.0, -1.0, np.nan, np.inf])
        return v
    if kind == "zp":
        lo, hi = rest
        v = rng.integers(lo, hi + 1, size=shape).astype(np.int32)
        if bad and v.size:
            v.reshape(-1)[rng.integers(0, v.size)] = hi + 1 if hi < 2 ** 31 - 1 else lo - 1
        return v
    if kind == "codes":
        return rng.integers(0, 256, size=shape).astype(np.uint8).view(dt) if dt.itemsize == 1 else \
            rng.integers(-128, 128, size=shape).astype(dt)
    if kind == "e8m0":
        v = rng.integers(110, 140, size=shape).astype(np.uint8)
        if bad and v.size:
            v.reshape(-1)[rng.integers(0, v.size)] = 255
        return v
    if kind == "ids":
        E, = rest
        return rng.integers(-1 if dt.kind == "i" else 0, E + 1, size=shape).astype(dt)
    if kind == "offsets":
        M, E = rest
        if shape != (E + 1,):
            return rng.integers(0, M + 1, size=shape).astype(dt)
        cuts = np.sort(rng.integers(0, M + 1, size=E - 1)) if E > 1 else np.zeros(0, np.int64)
        v = np.concatenate([[0], cuts, [M]]).astype(dt)
        if bad:
            v[rng.integers(0, v.size)] += rng.choice([-3, 5, M + 1])
        return v
    raise ValueError(a.fill)


def _host(v, host):
    return host[v.key] if isinstance(v, Arr) else v


def _math_scalar(v, math_np):
    return np.dtype(math_np).type(v) if isinstance(v, (int, float, np.floating, np.integer)) else v


def expected(p: Problem, host: dict):
    """The NumPy reference of a valid problem: what the call returns, as host arrays (codes of
    low-bit kinds as uint8, packed int4 as bytes), None where it returns None."""
    op, m, kw = p.op, p.meta, p.kw
    scope, axis, gs = kw.get("scope"), kw.get("axis"), kw.get("group_size")
    sk = dict(scope=scope, axis=axis, group_size=gs)
    if op == "quantize":
        x, s, z = (_host(v, host) for v in p.args)
        qk, math_np = m["qk"], "float64" if m["xk"] == "float64" else "float32"
        s = _math_scalar(s, math_np)
        if qk in kinds.LOW_BIT:
            return ref.quantize_lowbit(x, s, z, **sk, out_dtype=qk, qmin=kw.get("qmin"), qmax=kw.get("qmax"),
                                       scale_dtype="e8m0" if m["mx"] else None)
        return ref.quantize(x, s, z, **sk, out_dtype=qk, qmin=kw.get("qmin"), qmax=kw.get("qmax"))
    if op == "dequantize":
        q, s, z = (_host(v, host) for v in p.args)
        qk, yk = m["qk"], kinds.of(m["yk"])
        s = _math_scalar(s, "float64" if yk == "f64" else "float32")
        if qk in kinds.LOW_BIT:
            return ref.dequantize_lowbit(q.view(np.uint8), s, z, **sk, in_kind=qk, out_dtype=yk,
                                         scale_dtype="e8m0" if m["mx"] else None)
        return ref.dequantize(q, s, z, **sk, in_kind=qk, out_dtype=yk)
    if op == "dynamic_quantize":
        x = _host(p.args[0], host)
        qk = m["qk"]
        eps = kw.get("eps", 1e-8)
        if qk in kinds.LOW_BIT:
            return ref.dynamic_quantize_lowbit_ref(x, **sk, mode=m["mode"], out_dtype=qk, qmin=m["qmin"],
                                                   qmax=m["qmax"], eps=eps, scale_dtype="e8m0" if m["mx"] else None)
        return ref.dynamic_quantize_ref(x, **sk, mode=m["mode"], out_dtype=qk, qmin=m["qmin"], qmax=m["qmax"],
                                        eps=eps)
    math_np = "float64" if m.get("xk") == "float64" else "float32"
    if op == "dequantize_backward":
        dy, s = (_host(v, host) for v in p.args)
        return ref.dequantize_backward(dy, _math_scalar(s, math_np), **sk)
    if op in ("quantize_backward", "fake_quantize_backward", "fake_quantize_learnable_backward", "fake_quantize"):
        vals = [_host(v, host) for v in p.args]
        if op == "fake_quantize":
            x, s, z = vals
        else:
            dy, x, s, z = vals
        s = _math_scalar(s, math_np)
        if op == "quantize_backward":
            return ref.quantize_backward(dy, x, s, z, **sk, out_dtype=m["qk"], qmin=kw.get("qmin"),
                                         qmax=kw.get("qmax"))
        rk = dict(qmin=m["qmin"], qmax=m["qmax"])
        if op == "fake_quantize":
            y, mask = ref.fake_quantize(x, s, z, **sk, **rk)
            if kw.get("return_mask") == "bits":
                return y, ref.pack_mask_bits(mask)
            return (y, mask) if kw.get("return_mask") else y
        if op == "fake_quantize_backward":
            return ref.fake_quantize_backward(dy, x, s, z, **sk, **rk)
        return ref.fake_quantize_learnable_backward(dy, x, s, z, **sk, **rk, grad_factor=kw.get("grad_factor", 1.0))
    routing = {k: host[kw[k].key] for k in ("row_experts", "offsets") if isinstance(kw.get(k), Arr)}
    if op == "grouped_matmul":
        x, w = (_host(v, host) for v in p.args)
        return ref_moe.grouped_matmul(x, w, **routing)
    x, w, dy = (_host(v, host) for v in p.args)
    dx, dw = ref_moe.grouped_matmul_backward(x, w, dy, **routing)
    return (dx if m["need_input"] else None), (dw if m["need_weight"] else None)


def _bits(a):
    """Codes and low-bit containers as their bytes; everything else as it is."""
    a = np.asarray(a)
    if a.dtype.itemsize == 1 and a.dtype.kind not in "biu":
        return a.view(np.uint8)
    return a


def compare(p: Problem, got, want) -> None:
    """``got`` (host arrays, as the call returned them) equals ``want`` (:func:`expected`): bit for bit
    (NaN equals NaN) for the quantization ops, within the relative error of docs/numerics.md for grouped matmul.
    Raises AssertionError naming the output and the first differing element."""
    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    assert len(gots) == len(wants), (len(gots), len(wants))
    for i, (g_, w_) in enumerate(zip(gots, wants)):
        if w_ is None:
            assert g_ is None, f"output {i}: {type(g_)} where None was expected"
            continue
        g_, w_ = _bits(g_), _bits(w_)
        if p.op.startswith("grouped_matmul"):
            assert g_.shape == w_.shape, f"output {i}: shape {g_.shape} != {w_.shape}"
            tol = ref_moe.TOLERANCE[kinds.of(p.meta["xk"])]
            err = ref_moe.rel_error(g_.astype(np.float64), w_)
            assert err <= tol, f"output {i}: relative error {err} > {tol}"
            continue
        assert g_.size == w_.size, f"output {i}: {g_.shape} against {w_.shape}"
        g_ = g_.reshape(w_.shape)
        if g_.dtype != w_.dtype and w_.dtype == np.bool_:
            g_ = g_.astype(bool)
        assert g_.dtype == w_.dtype, f"output {i}: dtype {g_.dtype} != {w_.dtype}"
        if g_.dtype == np.bool_ or g_.dtype.kind in "iu":
            same = g_ == w_
        else:
            u = np.dtype(f"u{g_.dtype.itemsize}")
            same = (g_.view(u) == w_.view(u)) | (np.isnan(g_.astype(np.float64)) & np.isnan(w_.astype(np.float64)))
        if not same.all():
            at = tuple(int(j) for j in np.argwhere(~same)[0])
            raise AssertionError(f"{p.op} output {i}: {int((~same).sum())} of {same.size} elements differ; "
                                 f"first at {at}: got {g_[at]!r}, want {w_[at]!r}")
