"""Each public op's signature, declared once, and what is derived from it.

A family declares its ops as :class:`Signature` values (runtime/quantization/signatures.py,
runtime/moe/signatures.py): the parameters in the order of the public functions, each with its role
and its torch schema type. From one declaration come

* the functional function (``runtime.quantize``, ...), built by :func:`functional`: its parameters,
  defaults and keyword-only markers, and its call of the replay (runtime/replay.py) with the
  arrays and the keyword values in the declared order;
* the torch custom op's schema, its ``.out`` overload's schema, and the argument lists of its
  implementation, fake implementation and traced call (runtime/torch/library.py);
* the check that every function written against the declaration (an op's first-call path, a fake
  implementation, an autograd formula) names its parameters as the declaration does
  (:func:`check_parameters`): functions are coupled to a signature by name, never by position.

The functions are built from source text (Triton's ``jit`` binder does the same): a call pays for
nothing but the replay's own work, no argument binding at run time.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import replay

ARRAY = "array"     # an array argument: part of the replay's arguments (re-filled by a replay)
VALUE = "value"     # a keyword value: part of the replay's key
OUT = "out"         # ``out=``: the arrays to write into (one, or a tuple unpacked by the binding)
ROLES = (ARRAY, VALUE, OUT)


class _Required:
    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()      # a parameter without a default


@dataclass(frozen=True)
class Param:
    """One parameter of a public op. ``schema``: its type in the torch schema (``"Tensor?"``,
    ``"int?"``, ``"str"``, ...), None where the torch op does not take it. ``keyword``: keyword-only
    in the public functions (values and ``out`` always are). ``torch_name``: its name in the torch
    schema where that differs (a name the schema cannot take)."""
    name: str
    role: str
    schema: Optional[str]
    default: object = REQUIRED
    keyword: bool = True
    torch_name: Optional[str] = None

    @property
    def schema_name(self) -> str:
        return self.torch_name or self.name

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"parameter {self.name}: role {self.role!r} is not one of {ROLES}")


def array(name: str, schema: Optional[str] = "Tensor", default=REQUIRED, keyword: bool = False) -> Param:
    return Param(name, ARRAY, schema, default, keyword)


def value(name: str, schema: Optional[str], default=REQUIRED, torch_name: Optional[str] = None) -> Param:
    return Param(name, VALUE, schema, default, torch_name=torch_name)


@dataclass(frozen=True)
class Out:
    """``out=`` of an op: the arrays it names in the replay (``parts``) and in the torch ``.out``
    overload (``schema``: its keyword-only mutated arguments), and what that overload returns."""
    parts: tuple = ("out",)
    schema: str = "Tensor(a!) out"
    returns: str = "()"

    @property
    def names(self) -> tuple:
        """The ``.out`` overload's output argument names, as its schema spells them."""
        return tuple(arg.split()[-1].split("=")[0] for arg in self.schema.split(", "))

    def keyword_parameters(self) -> str:
        """Those arguments as Python keyword-only parameters (an optional one defaults to None)."""
        return ", ".join(f"{n}=None" if "?" in arg else n for n, arg in zip(self.names, self.schema.split(", ")))


@dataclass(frozen=True)
class Signature:
    """A public op: ``params`` in the order of the public functions; ``returns``: the torch schema's
    results; ``out``: its ``out=`` (None: the op takes none); ``functional``: whether the functional
    API offers it (False: a torch op only); ``doc``: the functional function's docstring."""
    name: str
    params: tuple
    returns: str = "Tensor"
    out: Optional[Out] = Out()
    functional: bool = True
    doc: str = field(default="", compare=False)

    def __post_init__(self):
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a parameter is declared twice: {names}")
        if (self.out is None) == any(p.role == OUT for p in self.params):
            raise ValueError(f"{self.name}: an out= parameter must be declared exactly when out is")

    # -- the parts of the declaration ---------------------------------------------------------------
    def of(self, role: str) -> tuple:
        return tuple(p for p in self.params if p.role == role)

    @property
    def arrays(self) -> tuple:
        """The replay's arguments: the arrays in declared order, ``out`` expanded into its parts."""
        names = []
        for p in self.params:
            if p.role == ARRAY:
                names.append(p.name)
            elif p.role == OUT:
                names.extend(self.out.parts)
        return tuple(names)

    @property
    def values(self) -> tuple:
        """The replay key's keyword values, in declared order."""
        return tuple(p.name for p in self.of(VALUE))

    @property
    def scalars(self) -> Optional[tuple]:
        """(index of ``scale``, index of ``zero_point`` or None) among the replay's arguments: a
        Python number there is a value a replay re-fills and checks; None: the op takes no scale."""
        a = self.arrays
        if "scale" not in a:
            return None
        return a.index("scale"), (a.index("zero_point") if "zero_point" in a else None)

    @property
    def torch_params(self) -> tuple:
        """The torch op's arguments: the parameters with a schema type, ``out`` excepted, in order."""
        return tuple(p for p in self.params if p.schema is not None and p.role != OUT)

    def schema(self) -> str:
        """The torch schema of the op, less its name: ``(Tensor x, ...) -> Tensor``."""
        return f"({', '.join(self._schema_args())}) -> {self.returns}"

    def out_schema(self) -> str:
        """The torch schema of the ``.out`` overload: the op's arguments, then the mutated outputs,
        keyword-only."""
        return f"({', '.join(self._schema_args())}, *, {self.out.schema}) -> {self.out.returns}"

    def _schema_args(self) -> list:
        """The torch op's arguments as schema text; a default only where every later argument has one
        (the schema's arguments are positional)."""
        ps = self.torch_params
        return [_schema_arg(p, all(q.default is not REQUIRED for q in ps[i:])) for i, p in enumerate(ps)]

    def torch_parameters(self) -> str:
        """The torch op's arguments as a Python parameter list, with the schema's defaults."""
        ps = self.torch_params
        return ", ".join(p.schema_name + (f"={p.default!r}" if all(q.default is not REQUIRED for q in ps[i:]) else "")
                         for i, p in enumerate(ps))

    def public_parameters(self, extra: tuple = ()) -> str:
        """The parameter list of a public function: positional arrays, then ``*``, then the rest in
        declared order, then ``extra`` (source text of further keyword parameters)."""
        pos = [_py_param(p) for p in self.params if p.role == ARRAY and not p.keyword]
        kw = [_py_param(p) for p in self.params if p.role != ARRAY or p.keyword]
        kw += list(extra)
        return ", ".join(pos + (["*"] + kw if kw else []))


_TORCH_TYPES = {"int": "SymInt", "int?": "SymInt?"}     # integers may be symbolic under torch.compile


def _schema_arg(p: Param, default: bool) -> str:
    text = f"{_TORCH_TYPES.get(p.schema, p.schema)} {p.schema_name}"
    if default:
        text += "=" + _schema_default(p.default)
    return text


def _schema_default(v) -> str:
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def _py_param(p: Param) -> str:
    if p.role == OUT:
        return f"{p.name}=None"
    return p.name if p.default is REQUIRED else f"{p.name}={p.default!r}"


# -- derived functions ----------------------------------------------------------------------------------
def check_parameters(fn: Callable, names, what: str, skip: int = 0) -> None:
    """``fn``'s positional parameters after the first ``skip`` are ``names``, in that order: a function
    written against a signature names its parameters as the signature does (a build-time check)."""
    got = [p.name for p in inspect.signature(fn).parameters.values()
           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][skip:]
    if got != list(names):
        raise TypeError(f"{what} {fn.__module__}.{fn.__qualname__} takes ({', '.join(got)}); the signature "
                        f"declares ({', '.join(names)})")


def build(name: str, params: str, body: str, namespace: dict, module: str, doc: str = "") -> Callable:
    """A function ``def name(params): body`` compiled from source in ``namespace``, attributed to
    ``module`` (for ``help()``, tracebacks and pickling by name)."""
    src = f"def {name}({params}):\n    {body}\n"
    code = compile(src, f"<skuforge signature {module}.{name}>", "exec")
    ns = dict(namespace)
    exec(code, ns)                                  # noqa: S102 - source text built from declarations
    fn = ns[name]
    fn.__module__, fn.__doc__ = module, doc or None
    fn.__signature_source__ = src
    return fn


def functional(sig: Signature, first_call: Callable, module: str, key: Optional[Callable] = None,
               unpack_out: Optional[Callable] = None) -> Callable:
    """The functional function of ``sig``: ``replay.call(sig, values, arrays, first_call)``.

    ``first_call(rec, *arrays, *values, *key_values)`` is the op's normalize -> plan -> launch under a
    :class:`runtime.replay.Recording`; its parameters are checked against the declaration. ``key``: a
    function of some of the op's parameters (by name) returning further values of the replay key
    (settings that choose the launch). ``unpack_out``: a function of ``out`` (and other parameters, by
    name) returning the tuple of ``out``'s parts (``Out.parts``), checking its form."""
    values = list(sig.values)
    ns = {"_call": replay.call, "_first": first_call, "_sig": sig}
    if key is not None:
        ns["_key"] = key
        values.append("*_key(" + ", ".join(inspect.signature(key).parameters) + ")")
    arrays = []
    for p in sig.params:
        if p.role == ARRAY:
            arrays.append(p.name)
        elif p.role == OUT:
            if unpack_out is None:
                if sig.out.parts != (p.name,):
                    raise TypeError(f"{sig.name}: out= has parts {sig.out.parts}: an unpack_out function is needed")
                arrays.append(p.name)
            else:
                ns["_unpack_out"] = unpack_out
                arrays.append("*_unpack_out(" + ", ".join(inspect.signature(unpack_out).parameters) + ")")
    key_names = () if key is None else _key_names(first_call, sig)
    check_parameters(first_call, sig.arrays + sig.values + key_names, f"{sig.name}'s first call", skip=1)
    body = f"return _call(_sig, ({_tuple(values)}), ({_tuple(arrays)}), _first)"
    return build(sig.name, sig.public_parameters(), body, ns, module, sig.doc)


def _key_names(first_call: Callable, sig: Signature) -> tuple:
    """The parameters of ``first_call`` after the arrays and values: the key's values."""
    names = list(inspect.signature(first_call).parameters)[1:]
    return tuple(names[len(sig.arrays) + len(sig.values):])


def _tuple(items) -> str:
    items = list(items)
    return ", ".join(items) + ("," if len(items) == 1 else "")
