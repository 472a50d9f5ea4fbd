"""The functional API on torch tensors that torch traces: ``runtime.quantize(...)`` and the other
functional ops as their ``torch.ops.skuforge`` custom ops.

runtime/replay.py hands a functional call here instead of launching it when Dynamo traces it
(``torch.compile``, ``torch.export``) or when its tensors have no memory to launch on (FakeTensor,
functional tensors and other subclasses, meta tensors): :func:`call` gets the op's name and the
keyword values and arrays the functional module passes to ``replay.call``. It returns what the
functional call returns -- the same values, shapes and dtypes (e8m0 scales as uint8 codes, None for
a symmetric zero point or a gradient not asked for, ``out=`` arrays written and returned) --
computed by the custom ops, whose fake implementations raise the functional API's typed errors.
The functional API records no autograd, traced or not: the ops run under ``torch.no_grad()``
(runtime.torch's own functions are the differentiable ones). ``workspace=`` (grouped matmul) is
scratch memory; the traced op takes its own from PyTorch's allocator.
"""
import torch

from runtime.quantization.training import mask_format

from . import ops


def call(op: str, static: tuple, args: tuple):
    """The functional call ``op`` (its ``replay.call`` keyword values and arrays) through the custom ops."""
    with torch.no_grad():
        return _CALLS[op](static, *args)


def _quantize(static, x, scale, zero_point, out):
    scope, axis, group_size, out_dtype, qmin, qmax, scale_dtype = static
    return ops.quantize(x, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                        qmin=qmin, qmax=qmax, scale_dtype=scale_dtype, out=out)


def _dequantize(static, q, scale, zero_point, out):
    scope, axis, group_size, out_dtype, in_dtype, scale_dtype = static
    return ops.dequantize(q, scale, zero_point, scope=scope, axis=axis, group_size=group_size, out_dtype=out_dtype,
                          in_dtype=in_dtype, scale_dtype=scale_dtype, out=out)


def _dynamic_quantize(static, x, q_out, s_out, z_out):
    scope, mode, axis, group_size, out_dtype, qmin, qmax, eps, scale_dtype, _config, no_out = static
    out = None if no_out else ((q_out, s_out) if z_out is None else (q_out, s_out, z_out))
    q, s, z = ops.dynamic_quantize(x, scope=scope, mode=mode, axis=axis, group_size=group_size, out_dtype=out_dtype,
                                   qmin=qmin, qmax=qmax, eps=eps, scale_dtype=scale_dtype, out=out)
    if no_out and s.dtype != torch.uint8 and ops._e8m0(scale_dtype):
        s = s.view(torch.uint8)         # the functional API's e8m0 scales are uint8 codes
    return q, s, z


def _quantize_backward(static, dy, x, scale, zero_point, out):
    scope, axis, group_size, out_dtype, qmin, qmax = static
    return ops.quantize_backward(dy, x, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                                 out_dtype=out_dtype, qmin=qmin, qmax=qmax, out=out)


def _dequantize_backward(static, dy, scale, _zero_point, out):
    scope, axis, group_size = static
    return ops.dequantize_backward(dy, scale, scope=scope, axis=axis, group_size=group_size, out=out)


def _fake_quantize(static, x, scale, zero_point, out):
    scope, axis, group_size, qmin, qmax, return_mask = static
    # the ops themselves: runtime.torch.fake_quantize casts the scale, the functional API checks it
    params = (x, ops._scale_tensor(scale, x), ops._zp_tensor(zero_point, x), scope, axis, group_size, qmin, qmax)
    fmt = mask_format(return_mask)
    if fmt == "none":
        if out is None:
            return ops._call(ops._fake_quantize, *params)
        ops._call_out("fake_quantize", params, out=out)
        return out
    if out is None:
        return ops._call(ops._fake_quantize_with_mask, *params, fmt)
    return out, ops._call_out("fake_quantize_with_mask", (*params, fmt), out=out)


def _fake_quantize_backward(static, dy, x, scale, zero_point, out):
    scope, axis, group_size, qmin, qmax = static
    return ops.fake_quantize_backward(dy, x, scale, zero_point, scope=scope, axis=axis, group_size=group_size,
                                      qmin=qmin, qmax=qmax, out=out)


def _from_mask(static, dy, mask, out):
    return ops.fake_quantize_backward_from_mask(dy, mask, out=out)


def _lsq_backward(static, dy, x, scale, zero_point, out):
    scope, axis, group_size, qmin, qmax, grad_factor, _max_blocks = static
    return ops.fake_quantize_learnable_backward(dy, x, scale, zero_point, scope=scope, axis=axis,
                                                group_size=group_size, qmin=qmin, qmax=qmax,
                                                grad_factor=grad_factor, out=out)


def _grouped_matmul(static, x, w, row_experts, offsets, out, _workspace):
    strategy, trusted_offsets, _config = static
    return ops.grouped_matmul(x, w, row_experts=row_experts, offsets=offsets, strategy=strategy,
                              trusted_offsets=trusted_offsets, out=out)


def _grouped_matmul_backward(static, x, w, dy, row_experts, offsets, dx_out, dw_out, _workspace):
    strategy, need_input, need_weight, dw_dtype, trusted_offsets, no_out, _config = static
    return ops.grouped_matmul_backward(x, w, dy, row_experts=row_experts, offsets=offsets, strategy=strategy,
                                       need_input=need_input, need_weight=need_weight, dw_dtype=dw_dtype,
                                       trusted_offsets=trusted_offsets, out=None if no_out else (dx_out, dw_out))


_CALLS = {"quantize": _quantize, "dequantize": _dequantize, "dynamic_quantize": _dynamic_quantize,
          "quantize_backward": _quantize_backward, "dequantize_backward": _dequantize_backward,
          "fake_quantize": _fake_quantize, "fake_quantize_backward": _fake_quantize_backward,
          "fake_quantize_backward_from_mask": _from_mask,
          "fake_quantize_learnable_backward": _lsq_backward, "grouped_matmul": _grouped_matmul,
          "grouped_matmul_backward": _grouped_matmul_backward}
