"""The MoE family's torch ops (``torch.ops.skuforge.grouped_matmul`` and its backward), the autograd
formula and the public functions of ``runtime.torch``.

The ops, their schemas, fake implementations and ``.out`` overloads come from the family's
signatures (runtime/moe/signatures.py) through runtime/torch/library.py. ``grouped_matmul`` is
differentiable in x and w: ``grouped_matmul_backward`` (dw float32, cast to w's dtype).
"""

from runtime import moe as sf
from runtime.arrays import kind_of, torch_dtype
from runtime.errors import InvalidProblemError
from runtime.moe.grouped import _out_pair
from runtime.moe.signatures import GROUPED_MATMUL, GROUPED_MATMUL_BACKWARD

from . import meta
from .library import TorchOp, call, call_out, define, dtype_name, grads, named, public

_grouped_matmul = define(TorchOp(GROUPED_MATMUL, sf.grouped_matmul, dense_out=True))


def _backward_out(x, w, dy, row_experts, offsets, strategy, need_input, need_weight, dw_dtype, trusted_offsets, *,
                  dx=None, dw=None):
    sf.grouped_matmul_backward(x, w, dy, row_experts=row_experts, offsets=offsets, strategy=strategy,
                               need_input=need_input, need_weight=need_weight, dw_dtype=dw_dtype,
                               trusted_offsets=trusted_offsets, out=(dx, dw))


def _backward_out_fake(x, w, dy, row_experts, offsets, strategy, need_input, need_weight, dw_dtype, trusted_offsets,
                       *, dx=None, dw=None):
    specs = meta.grouped_matmul_backward_spec(x, w, dy, row_experts, offsets, strategy, need_input, need_weight,
                                              dw_dtype, trusted_offsets)
    meta.same_device(x=x, dx=dx, dw=dw)
    for arg, t, need, flag, spec in (("out[0] (dx)", dx, need_input, "need_input", specs[0]),
                                     ("out[1] (dw)", dw, need_weight, "need_weight", specs[1])):
        if need != (t is not None):
            raise InvalidProblemError(f"{arg} is {'None' if t is None else 'given'} but {flag}={bool(need)}; pass "
                                      + (f"an array of shape {tuple(spec[0])} (or {flag}=False)" if need else "None"))
        if t is not None:
            meta.check_dense_out(t, spec, arg)


_grouped_matmul_backward = define(TorchOp(
    GROUPED_MATMUL_BACKWARD, sf.grouped_matmul_backward,
    empties=(lambda a: a["x"].dtype, lambda a: torch_dtype(kind_of(a["dw_dtype"], "dw_dtype"))),
    out_impl=_backward_out, out_fake=_backward_out_fake))


def _gmm_setup(ctx, inputs, output):
    a = named(GROUPED_MATMUL, inputs)
    ctx.save_for_backward(a["x"], a["w"], a["row_experts"], a["offsets"])
    ctx.cfg = (a["strategy"], a["trusted_offsets"])


def _gmm_backward(ctx, grad):
    """dx = dy @ w[e(m)] in x's dtype; dw accumulated and returned in float32 by the kernel, then
    cast to w's dtype (the parameter's gradient dtype)."""
    x, w, row_experts, offsets = ctx.saved_tensors
    strategy, trusted = ctx.cfg
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return grads(GROUPED_MATMUL)
    dx, dw = call(_grouped_matmul_backward, x, w, grad.contiguous(), row_experts, offsets, strategy, need_x,
                  need_w, "float32", trusted)
    return grads(GROUPED_MATMUL, x=dx if need_x else None, w=dw.to(w.dtype) if need_w else None)


_grouped_matmul.register_autograd(_gmm_backward, setup_context=_gmm_setup)


def _grouped_matmul_public(x, w, row_experts, offsets, strategy, trusted_offsets, out):
    """``y[m] = w[e(m)] @ x[m]`` (runtime.grouped_matmul); differentiable in x and w (not with ``out=``)."""
    args = (x, w, row_experts, offsets, strategy, trusted_offsets)
    if out is None:
        return call(_grouped_matmul, *args)
    call_out("grouped_matmul", args, out=out)
    return out


grouped_matmul = public(GROUPED_MATMUL, _grouped_matmul_public, omit=("workspace",))


def _grouped_matmul_backward_public(x, w, dy, row_experts, offsets, strategy, need_input, need_weight, dw_dtype,
                                    trusted_offsets, out):
    """``(dx, dw)`` (runtime.grouped_matmul_backward); a gradient not asked for is None.
    ``out=(dx, dw)``: written and returned (None exactly for a gradient not asked for)."""
    args = (x, w, dy, row_experts, offsets, strategy, need_input, need_weight, dtype_name(dw_dtype), trusted_offsets)
    if out is not None:
        dxo, dwo = _out_pair(out)
        call_out("grouped_matmul_backward", args, dx=dxo, dw=dwo)
        return dxo, dwo
    dx, dw = call(_grouped_matmul_backward, *args)
    return (dx if need_input else None), (dw if need_weight else None)


grouped_matmul_backward = public(GROUPED_MATMUL_BACKWARD, _grouped_matmul_backward_public, omit=("workspace",))
