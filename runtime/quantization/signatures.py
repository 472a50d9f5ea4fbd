"""The quantization family's public ops, each declared once (runtime/signatures.py derives the
functional functions, the replay bindings and the torch ops from these).

The docstrings here are the functional functions' (``help(runtime.quantize)``).
"""
from __future__ import annotations

from ..signatures import OUT, Out, Param, Signature, array, value

DEFAULT_QMIN, DEFAULT_QMAX = -128, 127   # fake quantization's default range: int8, like PyTorch's QAT
_OUT = Param("out", OUT, None)


def _scope_params():
    return (value("scope", "str"), value("axis", "int?", None), value("group_size", "int?", None))


def _affine(first: str):
    """``first, scale, zero_point=None``: the arrays of the ops that take a scale and a zero point."""
    return (array(first), array("scale"), array("zero_point", "Tensor?", None))


def _fake_range():
    return (value("qmin", "int", DEFAULT_QMIN), value("qmax", "int", DEFAULT_QMAX))


QUANTIZE = Signature("quantize", (
    *_affine("x"), *_scope_params(), value("out_dtype", "str", "int8"), value("qmin", "int?", None),
    value("qmax", "int?", None), value("scale_dtype", "str?", None), _OUT), doc="""\
``q = clamp(rne(x * inv) + zero_point, qmin, qmax)``, ``inv = 1 / scale``, per scope (docs/numerics.md).

``zero_point=None`` is symmetric mode: the implied zero point is 0 for signed outputs
and the middle of the range (128) for u8. Low-bit outputs (fp8, packed int4) and
``scale_dtype="e8m0"`` (MX block scales): docs/lowbit.md.
""")

DEQUANTIZE = Signature("dequantize", (
    *_affine("q"), *_scope_params(), value("out_dtype", "str", "float32"), value("in_dtype", "str?", None),
    value("scale_dtype", "str?", None), _OUT), doc="""\
``y = (q - zero_point) * scale`` per scope, rounded once to ``out_dtype`` (docs/numerics.md).

Low-bit inputs (docs/lowbit.md): a torch fp8 tensor, or a uint8 container with
``in_dtype`` = ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int4"`` (s4) or ``"uint4"`` (u4, packed two
per byte); ``scale_dtype="e8m0"`` for MX block scales.
""")

DYNAMIC_QUANTIZE = Signature("dynamic_quantize", (
    # torch.compile functionalizes a .out overload through a function with a keyword ``mode`` of its own
    array("x"), value("scope", "str"), value("mode", "str", "symmetric", torch_name="range_mode"),
    value("axis", "int?", None),
    value("group_size", "int?", None), value("out_dtype", "str", "int8"), value("qmin", "int?", None),
    value("qmax", "int?", None), value("eps", "float", 1e-8), value("scale_dtype", "str", "float32"),
    value("scale_layout", "str", "row"), _OUT),
    returns="(Tensor, Tensor, Tensor)",
    out=Out(parts=("q_out", "s_out", "z_out"),
            schema="Tensor(a!) q, Tensor(b!) scale, Tensor(c!)? zero_point=None"), doc="""\
Quantize ``x`` with scales (and zero points) computed from its own range, per scope.

Returns ``(q, scale, zero_point)``; ``zero_point`` is ``None`` in symmetric mode (its
zero point is the one ``quantize(..., zero_point=None)`` implies: 0 for s8, 128 for u8).
Symmetric: ``scale = max(amax, eps) / (qmax - zp)``, default range s8 -127..127, u8 1..255.
Asymmetric: ``scale = max((mx - mn) / (qmax - qmin), eps)`` with ``mn = min(min x, 0)``,
``mx = max(max x, 0)``, ``zp = clamp(qmin - rne(mn / scale), qmin, qmax)``; full range.
NaN is ignored by the reductions. ``q == quantize(x, scale, zp, qmin=qmin, qmax=qmax)``.

``scale_layout`` (group scope): how the returned scale (and zero point) arrays are laid out,
their shape ``x.shape[:-1] + (D // group_size,)`` either way: ``"row"`` (C order), ``"col"``
(columns, "MN-major": ``scale[..., g]`` contiguous over the rows) or ``"col_aligned"`` (columns,
each starting on 16 bytes: what TMA-fed blockwise fp8 GEMMs read). The kernel writes them in place
(docs/dynamic.md, "Scale layouts").

``out``: ``(q, scale)`` or ``(q, scale, zero_point)`` arrays to write into instead of new
ones (int8 / uint8 outputs; ``zero_point`` only in asymmetric mode), of the shapes and dtypes
the call returns, in the framework and on the device of ``x``, not overlapping ``x`` or each
other; they are returned. Group scales given in ``out`` are written in their own layout (rows of
groups, or columns with any column stride), which ``scale_layout``, when not ``"row"``, must
match. A repeated call with ``out`` allocates nothing (docs/dynamic.md).
""")

QUANTIZE_BACKWARD = Signature("quantize_backward", (
    array("dy"), *_affine("x"), *_scope_params(), value("out_dtype", "str", "int8"), value("qmin", "int?", None),
    value("qmax", "int?", None), _OUT), doc="""\
Straight-through gradient of :func:`runtime.quantize`: ``dx = dy * (qmin <= v <= qmax)``,
``v = rne(x / scale) + zero_point`` before the clamp. Takes quantize's own arguments
(``out_dtype`` is quantize's output kind: it sets the default range and the implied zero point).
""")

DEQUANTIZE_BACKWARD = Signature("dequantize_backward", (
    array("dy"), array("scale"), *_scope_params(), _OUT), doc="""\
Straight-through gradient of :func:`runtime.dequantize` with respect to q:
``dq = dy * scale``, rounded once to dy's dtype (scale: float32, float64 for float64 dy).
""")

FAKE_QUANTIZE = Signature("fake_quantize", (
    *_affine("x"), *_scope_params(), *_fake_range(), value("return_mask", None, False), _OUT), doc="""\
``y = (clamp(rne(x / scale) + zp, qmin, qmax) - zp) * scale`` in x's dtype (PyTorch's
``fake_quantize_per_*_affine``). With ``return_mask=True`` returns ``(y, mask)``, mask a bool
array ``qmin <= rne(x / scale) + zp <= qmax``; with ``return_mask="bits"`` the same mask
bit-packed (a uint8 array ``x.shape[:-1] + (ceil(D / 8),)``, what
:func:`fake_quantize_backward_from_mask` reads); either is written by the same kernel.
""")

# the training forward of the torch front: fake_quantize's output and its mask, one kernel
FAKE_QUANTIZE_WITH_MASK = Signature("fake_quantize_with_mask", (
    *_affine("x"), *_scope_params(), *_fake_range(), value("mask", "str", "bits"), _OUT),
    returns="(Tensor, Tensor)", out=Out(returns="Tensor"), functional=False)

FAKE_QUANTIZE_BACKWARD = Signature("fake_quantize_backward", (
    array("dy"), *_affine("x"), *_scope_params(), *_fake_range(), _OUT), doc="""\
``dx = dy * mask`` with fake_quantize's mask, recomputed from x (a product, as PyTorch's).
""")

FAKE_QUANTIZE_BACKWARD_FROM_MASK = Signature("fake_quantize_backward_from_mask", (
    array("dy"), array("mask"), _OUT), doc="""\
``dx = dy * bit`` with the bit-packed mask of ``fake_quantize(..., return_mask="bits")``: a
product, as PyTorch's ``dY * mask`` (a negative dy where the bit is 0 gives -0, a non-finite dy
NaN), in dy's dtype. ``mask``: uint8 of shape ``dy.shape[:-1] + (ceil(D / 8),)``, bit j of byte
b of a row holding element ``8 * b + j`` of that row.
""")

# LSQ's forward of the torch front (the functional API has fake_quantize for it)
FAKE_QUANTIZE_LEARNABLE = Signature("fake_quantize_learnable", (
    *_affine("x"), *_scope_params(), *_fake_range(), value("grad_factor", "float", 1.0)),
    out=None, functional=False)

FAKE_QUANTIZE_LEARNABLE_BACKWARD = Signature("fake_quantize_learnable_backward", (
    array("dy"), *_affine("x"), *_scope_params(), *_fake_range(), value("grad_factor", "float", 1.0),
    _OUT, value("_max_blocks", None, None)),
    returns="(Tensor, Tensor, Tensor)", out=Out(returns="(Tensor, Tensor)"), doc="""\
LSQ gradients ``(dx, dscale, dzero_point)`` (PyTorch's ``_fake_quantize_learnable_*`` terms).

``dscale`` has the scale's shape and dtype, ``dzero_point`` the zero point's shape in float32
(``None`` when ``zero_point`` is None). The sums per scale element use one fixed order (no
atomics): the same inputs give the same bits on every run, whatever the launch configuration.

The kernel checks every scale element it loads (scale positive and finite; asymmetric: zero
point in [qmin, qmax]) without a host sync: an invalid one makes dx NaN over its elements and
its ds (and dz) NaN, and the next call on the device (or ``runtime.check()``) raises
:class:`runtime.DeviceValueError` (``op="fake_quantize_learnable_backward"``, ``arg="scale"`` or
``"zero_point"``). Under ``runtime.sync_checks()`` the values are checked on the host first.
""")

SIGNATURES = {s.name: s for s in (
    QUANTIZE, DEQUANTIZE, DYNAMIC_QUANTIZE, QUANTIZE_BACKWARD, DEQUANTIZE_BACKWARD, FAKE_QUANTIZE,
    FAKE_QUANTIZE_WITH_MASK, FAKE_QUANTIZE_BACKWARD, FAKE_QUANTIZE_BACKWARD_FROM_MASK, FAKE_QUANTIZE_LEARNABLE,
    FAKE_QUANTIZE_LEARNABLE_BACKWARD)}
