"""The functional API on torch tensors that torch traces: ``runtime.quantize(...)`` and the other
functional ops as their ``torch.ops.skuforge`` custom ops.

runtime/replay.py hands a functional call here instead of launching it when Dynamo traces it
(``torch.compile``, ``torch.export``) or when its tensors have no memory to launch on (FakeTensor,
functional tensors and other subclasses, meta tensors): :func:`call` gets the op's name and the
replay's keyword values and arrays, named by the op's signature (runtime/signatures.py). It
returns what the functional call returns -- the same values, shapes and dtypes (e8m0 scales as
uint8 codes, None for a symmetric zero point or a gradient not asked for, ``out=`` arrays written
and returned) -- computed by the custom ops, whose fake implementations raise the functional API's
typed errors. The functional API records no autograd, traced or not: the ops run under
``torch.no_grad()`` (runtime.torch's own functions are the differentiable ones). ``workspace=``
(grouped matmul) is scratch memory; the traced op takes its own from PyTorch's allocator.
"""
import torch

from runtime.moe.signatures import SIGNATURES as _MOE
from runtime.quantization.signatures import SIGNATURES as _QUANTIZATION
from runtime.quantization.training import mask_format

from . import gradients, moe, quantization
from .library import call as call_op
from .library import call_out

_SIGNATURES = {**_QUANTIZATION, **_MOE}
_FRONT = {**{n: getattr(quantization, n) for n in _QUANTIZATION if _QUANTIZATION[n].functional},
          **{n: getattr(moe, n) for n in _MOE}}


def call(op: str, static: tuple, args: tuple):
    """The functional call ``op`` (its replay's keyword values and arrays) through the custom ops."""
    sig = _SIGNATURES[op]
    a = dict(zip(sig.values, static))
    extra = static[len(sig.values):]             # the replay key's further values
    a.update(zip(sig.arrays, args))
    with torch.no_grad():
        return _SPECIAL.get(op, _front)(op, sig, a, extra)


def _front(op, sig, a, extra):
    """runtime.torch's function of the op with the call's arguments by name."""
    return _FRONT[op](**{p.name: a[p.name] for p in sig.params
                         if p.name == "out" or (p.schema is not None and p.name in a)})


def _dynamic_quantize(op, sig, a, extra):
    _config, no_out = extra
    q_out, s_out, z_out = a.pop("q_out"), a.pop("s_out"), a.pop("z_out")
    a["out"] = None if no_out else ((q_out, s_out) if z_out is None else (q_out, s_out, z_out))
    q, s, z = _front(op, sig, a, extra)
    if no_out and s.dtype != torch.uint8 and gradients.names_e8m0(a["scale_dtype"]):
        s = s.view(torch.uint8)         # the functional API's e8m0 scales are uint8 codes
    return q, s, z


def _fake_quantize(op, sig, a, extra):
    # the ops themselves: runtime.torch.fake_quantize casts the scale, the functional API checks it
    x = a["x"]
    params = (x, quantization._scale_tensor(a["scale"], x), quantization._zp_tensor(a["zero_point"], x), a["scope"],
              a["axis"], a["group_size"], a["qmin"], a["qmax"])
    fmt, out = mask_format(a["return_mask"]), a["out"]
    if fmt == "none":
        if out is None:
            return call_op(quantization._fake_quantize, *params)
        call_out("fake_quantize", params, out=out)
        return out
    if out is None:
        return call_op(quantization._fake_quantize_with_mask, *params, fmt)
    return out, call_out("fake_quantize_with_mask", (*params, fmt), out=out)


def _grouped_matmul_backward(op, sig, a, extra):
    no_out, _config = extra
    a["out"] = None if no_out else (a.pop("dx_out"), a.pop("dw_out"))
    return _front(op, sig, a, extra)


_SPECIAL = {"dynamic_quantize": _dynamic_quantize, "fake_quantize": _fake_quantize,
            "grouped_matmul_backward": _grouped_matmul_backward}
