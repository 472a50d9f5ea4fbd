"""The ``torch.ops.skuforge`` custom ops, derived from the ops' signatures (runtime/signatures.py).

For each declared op, :func:`define` registers

* ``skuforge::<name>`` with the schema the signature gives, its CUDA implementation (by default the
  functional API called with the op's arguments by name) and its fake implementation (by default
  the op's ``runtime/torch/meta.py`` spec function ``<name>_spec``, whose parameters are checked
  against the signature: shapes, dtypes and the functional API's typed errors, no data read);
* ``skuforge::<name>.out`` where the op takes ``out=``: the same arguments and the mutated outputs,
  keyword-only (``Tensor(a!)``: what ``torch.compile`` functionalizes); it returns nothing unless
  the signature says so.

The family modules (runtime/torch/quantization.py, runtime/torch/moe.py) add what is particular to
an op (a result that the schema must spell as an empty tensor, an autograd formula) and the public
functions. Every function written against a signature names its parameters as the signature does
(checked when the op is defined).

The direct eager call: through the dispatcher a custom op costs about 14-20 µs of Python per eager
call (the autograd wrapper, the redispatch, the boxing of every argument) on top of the functional
API's 8-11 µs (docs/torch.md). Where the dispatcher would do nothing but call the CUDA
implementation -- plain CUDA tensors, no gradient to record, no tracing, mode, transform or
profiler -- :func:`call` and :func:`call_out` call that implementation themselves: the same
function, the same arguments, the same results and errors. Anything else goes through the
dispatcher.

(No ``from __future__ import annotations``: nothing here is read from annotations, but the ops'
schemas are given as text.)
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from runtime.signatures import ARRAY, Signature, build, check_parameters

from . import meta

NAMESPACE = "skuforge"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_PT2 = (torch.Tag.pt2_compliant_tag,)
_MODULE = __name__


@dataclass(frozen=True)
class TorchOp:
    """What a family adds to a signature to make its torch op. Each callable takes the op's torch
    arguments (``sig.torch_params``) by name, in order (checked), unless said otherwise.

    ``direct``: the computation, returning None for a result the schema spells as an empty tensor
    (default: the functional API ``functional`` called by name). ``empties``: per result, the dtype
    of the empty tensor that stands for None -- a torch dtype, or a function of the arguments (a
    dict by name).
    ``out_impl``: the ``.out`` overload's computation, taking the arguments then the outputs by
    keyword (default: ``functional(..., out=out)``). ``out_fake``: its fake implementation, same
    parameters (default: the spec's single output checked against ``out``). ``dense_out``: outputs
    must be C-contiguous (else: rows of a constant stride)."""
    sig: Signature
    functional: Optional[Callable] = None
    direct: Optional[Callable] = None
    empties: tuple = ()
    out_impl: Optional[Callable] = None
    out_fake: Optional[Callable] = None
    dense_out: bool = False


IMPL: dict = {}         # custom op -> the computation :func:`call` runs directly
CUDA: dict = {}         # custom op -> its CUDA implementation (what the dispatcher runs)
OUT: dict = {}          # op name -> (its .out overload, the overload's CUDA implementation)


def define(op: TorchOp):
    """Registers ``skuforge::<name>`` (and ``.out``) for ``op``; returns the custom op."""
    sig = op.sig
    names = tuple(p.schema_name for p in sig.torch_params)
    params, signature = ", ".join(names), sig.torch_parameters()
    direct = op.direct or _functional_call(sig, op.functional)
    check_parameters(direct, names, f"{sig.name}'s direct computation")
    ns = {"_direct": direct, "_empty": _empty, "_empties": op.empties}
    first = next(p.schema_name for p in sig.torch_params if p.role == ARRAY)
    if op.empties:
        body = f"args = dict(locals())\n    return _empty(_direct({params}), _empties, {first}.device, args)"
    else:
        body = f"return _direct({params})"
    impl = build(sig.name, signature, body, ns, _MODULE)
    custom = torch.library.custom_op(f"{NAMESPACE}::{sig.name}", impl, mutates_args=(), device_types="cuda",
                                     schema=sig.schema())
    ns = {"_spec": spec_function(sig, names), "_new": new}
    custom.register_fake(build(f"{sig.name}_fake", signature, f"return _new(_spec({params}), {first}.device)", ns,
                               _MODULE))
    IMPL[custom], CUDA[custom] = direct, impl
    if sig.out is not None:
        _define_out(op, names, first)
    return custom


def _functional_call(sig: Signature, functional: Callable) -> Callable:
    """The functional API called with the torch op's arguments, by name."""
    names = ", ".join(p.schema_name for p in sig.torch_params)
    return build(f"{sig.name}_direct", names, f"return _f({_by_name(sig)})", {"_f": functional}, _MODULE)


def _by_name(sig: Signature) -> str:
    return ", ".join(f"{p.name}={p.schema_name}" for p in sig.torch_params)


def _empty(result, empties, device, args: dict):
    """The schema's results: None replaced by an empty (0,) tensor of its dtype (``empties``: per
    result, a torch dtype or a function of the arguments by name)."""
    out = list(result)
    for i, dt in enumerate(empties):
        if dt is not None and out[i] is None:
            out[i] = torch.empty((0,), dtype=dt if isinstance(dt, torch.dtype) else dt(args), device=device)
    return tuple(out)


def new(specs, device):
    """Tensors of ``(shape, dtype)`` or ``(shape, dtype, strides)`` specs: one, or a tuple of them."""
    def one(spec):
        if len(spec) == 3:
            return torch.empty_strided(spec[0], spec[2], dtype=spec[1], device=device)
        return torch.empty(spec[0], dtype=spec[1], device=device)
    return one(specs) if isinstance(specs[1], torch.dtype) else tuple(one(s) for s in specs)


def spec_function(sig: Signature, names: tuple) -> Callable:
    """``meta.<name>_spec``, checked against the op's arguments."""
    fn = getattr(meta, f"{sig.name}_spec")
    check_parameters(getattr(fn, "__wrapped__", fn), names, f"{sig.name}'s spec")
    return fn


def _define_out(op: TorchOp, names: tuple, first: str) -> None:
    sig = op.sig
    _LIB.define(f"{sig.name}.out{sig.out_schema()}", tags=_PT2)
    outs, kw = sig.out.names, sig.out.keyword_parameters()
    params, signature = ", ".join(names), sig.torch_parameters()
    outs_args = ", ".join(f"{o}={o}" for o in outs)
    if op.out_impl is not None:
        check_parameters(op.out_impl, names, f"{sig.name}.out's computation")
        impl = op.out_impl
    else:
        # the overload returns nothing (its schema's ``-> ()``): the functional call's result is dropped
        impl = build(f"{sig.name}_out", f"{params}, *, out", f"_f({_by_name(sig)}, out=out)",
                     {"_f": op.functional}, _MODULE)
    if op.out_fake is not None:
        check_parameters(op.out_fake, names, f"{sig.name}.out's fake")
        ns, body = {"_fake": op.out_fake}, f"return _fake({params}, {outs_args})"
    else:
        ns = {"_spec": spec_function(sig, names), "_check": _check_single_out, "_dense": op.dense_out}
        body = f"_check(_spec({params}), {first!r}, {first}, out, _dense)"
    fake = build(f"{sig.name}_out_fake", f"{signature}, *, {kw}", body, ns, _MODULE)
    # the dispatcher bumps no version counter for an op defined this way: the implementation does, so
    # that autograd refuses a saved tensor that was overwritten (inference tensors have no counter)
    # (one list: _increment_version iterates its argument, and a tensor is iterated by rows)
    body = (f"r = _impl({params}, {outs_args})\n    "
            f"_bump([o for o in ({''.join(o + ', ' for o in outs)}) if o is not None and not o.is_inference()])\n    "
            "return r")
    cuda = build(f"{sig.name}_out_cuda", f"{signature}, *, {kw}", body, {"_impl": impl, "_bump": _bump}, _MODULE)
    _LIB.impl(f"{sig.name}.out", cuda, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{sig.name}.out", fake, lib=_LIB)
    OUT[sig.name] = (getattr(getattr(torch.ops, NAMESPACE), sig.name).out, cuda)


def _check_single_out(spec, name: str, like, out, dense: bool) -> None:
    meta.same_device(**{name: like, "out": out})
    (meta.check_dense_out if dense else meta.check_out)(out, spec, "out")


# -- the direct eager call ------------------------------------------------------------------------
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)
_SCALARS = frozenset((str, int, float, bool, type(None)))
_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._are_functorch_transforms_active
_profiling = torch._C._autograd._profiler_enabled
grad_on = torch._C.is_grad_enabled
_bump = torch._C._increment_version


def plain(args) -> bool:
    """Whether the dispatcher would only call the CUDA implementation on ``args``: no
    ``torch.compile`` / export tracing, no TorchDispatchMode or TorchFunctionMode, no functorch
    transform, no profiler, and every tensor a plain CUDA tensor (or Parameter) that needs no
    gradient (or grad mode off). Subclasses (FakeTensor, functional and traced tensors) say no."""
    if _compiling() or _dispatch_modes() or _function_modes() or _transforms() or _profiling():
        return False
    grad = grad_on()
    for a in args:
        t = type(a)
        if t in _SCALARS:       # (isinstance against Tensor's metaclass costs ~0.4 µs an argument)
            continue
        if t in _PLAIN_TYPES:
            if not a.is_cuda or (grad and a.requires_grad):
                return False
        elif isinstance(a, Tensor):
            return False
    return True


def call(op, *args):
    """``op(*args)``, or its computation called directly where :func:`plain` allows (a result the
    schema spells as an empty tensor is then None)."""
    if plain(args):
        return IMPL[op](*args)
    return op(*args)


def call_out(name: str, args: tuple, **outs):
    """``torch.ops.skuforge.<name>.out(*args, **outs)``, or its CUDA implementation (which bumps
    the written tensors' version counters) called directly where :func:`plain` allows."""
    overload, impl = OUT[name]
    if plain((*args, *outs.values())):
        return impl(*args, **outs)
    return overload(*args, **outs)


# -- autograd formulas, by name ---------------------------------------------------------------------
def named(sig: Signature, inputs: tuple) -> dict:
    """The op's arguments (an autograd ``setup_context``'s ``inputs``) by name."""
    return dict(zip((p.schema_name for p in sig.torch_params), inputs))


def grads(sig: Signature, **by_name) -> tuple:
    """An autograd backward's result: the gradients given by argument name, None for the others."""
    names = [p.schema_name for p in sig.torch_params]
    unknown = set(by_name) - set(names)
    if unknown:
        raise TypeError(f"{sig.name} has no argument {sorted(unknown)}")
    return tuple(by_name.get(n) for n in names)


def dtype_name(d) -> Optional[str]:
    """A dtype argument as the string the schemas carry (torch dtypes accepted)."""
    if d is None or isinstance(d, str):
        return d
    return str(d).replace("torch.", "")


# -- the public functions -------------------------------------------------------------------------------
def public(sig: Signature, body: Callable, omit: tuple = (), defaults: Optional[dict] = None) -> Callable:
    """The public function of ``runtime.torch`` for ``sig``: the functional API's parameters (less
    ``omit``; ``defaults`` replacing some defaults), calling ``body`` with them in declared order
    (checked); ``body``'s docstring is the function's."""
    from dataclasses import replace

    params = tuple(replace(p, default=defaults[p.name]) if defaults and p.name in defaults else p
                   for p in sig.params if p.name not in omit)
    shown = Signature(sig.name, params, sig.returns, sig.out if any(p.name == "out" for p in params) else None,
                      sig.functional)
    names = tuple(p.name for p in params)
    check_parameters(body, names, f"runtime.torch.{sig.name}")
    fn = build(sig.name, shown.public_parameters(), f"return _body({', '.join(names)})", {"_body": body},
               "runtime.torch", body.__doc__)
    return fn
