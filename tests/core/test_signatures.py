"""Each public op's signature is declared once (runtime/signatures.py, the families' signatures.py):
the functional functions, the replay bindings, the torch schemas, fake implementations, ``.out``
overloads and public torch functions follow it."""
import inspect

import pytest

import runtime
from runtime import signatures
from runtime.moe.signatures import SIGNATURES as MOE
from runtime.quantization.signatures import SIGNATURES as QUANTIZATION
from runtime.signatures import REQUIRED, Signature, array, check_parameters, functional, value

ALL = {**QUANTIZATION, **MOE}
FUNCTIONAL = [s for s in ALL.values() if s.functional]


def test_every_public_op_is_declared_once():
    assert not set(QUANTIZATION) & set(MOE)
    assert sorted(s.name for s in FUNCTIONAL) == sorted(
        n for n in runtime.__all__ if n in ALL)
    assert {n for n in runtime.__all__ if callable(getattr(runtime, n)) and n.islower() and n != "check"
            and n != "sync_checks" and n != "default_registry"} == {s.name for s in FUNCTIONAL}


@pytest.mark.parametrize("sig", FUNCTIONAL, ids=lambda s: s.name)
def test_functional_functions_have_the_declared_parameters(sig):
    fn = getattr(runtime, sig.name)
    params = inspect.signature(fn).parameters
    assert list(params) == [p.name for p in sig.params]
    for p in sig.params:
        got = params[p.name]
        want_default = inspect.Parameter.empty if p.default is REQUIRED else p.default
        if p.role == signatures.OUT:
            want_default = None
        assert got.default == want_default, p.name
        keyword = p.role != signatures.ARRAY or p.keyword
        assert (got.kind == got.KEYWORD_ONLY) == keyword, p.name
    assert fn.__doc__ == sig.doc and fn.__doc__


def test_replay_binding_follows_the_declaration():
    sig = QUANTIZATION["quantize"]
    assert sig.values == ("scope", "axis", "group_size", "out_dtype", "qmin", "qmax", "scale_dtype")
    assert sig.arrays == ("x", "scale", "zero_point", "out")
    assert sig.scalars == (1, 2)
    assert QUANTIZATION["dequantize_backward"].scalars == (1, None)
    assert QUANTIZATION["dynamic_quantize"].arrays == ("x", "q_out", "s_out", "z_out")
    assert QUANTIZATION["dynamic_quantize"].scalars is None
    assert MOE["grouped_matmul_backward"].arrays == ("x", "w", "dy", "row_experts", "offsets", "dx_out", "dw_out",
                                                     "workspace")


def test_a_first_call_path_is_checked_by_name():
    sig = Signature("probe", (array("x"), array("scale"), value("scope", "str"),
                              signatures.Param("out", signatures.OUT, None)))

    def first(rec, x, scale, out, scope):
        return x

    fn = functional(sig, first, __name__)
    assert "(x, scale, out)" in fn.__signature_source__ and "(scope,)" in fn.__signature_source__

    def swapped(rec, scale, x, out, scope):
        return x

    with pytest.raises(TypeError, match=r"probe's first call .* takes \(scale, x, out, scope\); the signature "
                                        r"declares \(x, scale, out, scope\)"):
        functional(sig, swapped, __name__)


def test_check_parameters_names_the_mismatch():
    def f(a, b):
        pass
    check_parameters(f, ("a", "b"), "f")
    with pytest.raises(TypeError, match=r"takes \(a, b\); the signature declares \(a, c\)"):
        check_parameters(f, ("a", "c"), "f")


def test_a_parameter_declared_twice_or_an_out_without_its_parts_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        Signature("probe", (array("x"), value("x", "str")), out=None)
    with pytest.raises(ValueError, match="out= parameter"):
        Signature("probe", (array("x"),))


def test_torch_schemas_come_from_the_declarations():
    torch = pytest.importorskip("torch")
    import runtime.torch as sft
    for name, sig in ALL.items():
        op = getattr(torch.ops.skuforge, name)
        parse = torch._C.parse_schema
        assert op.default._schema == parse(f"skuforge::{name}{sig.schema()}")
        if sig.out is not None:
            assert op.out._schema == parse(f"skuforge::{name}.out{sig.out_schema()}")
        else:
            assert not hasattr(op, "out")
    assert set(sft.OPS) == set(ALL)
    assert set(sft.OUT_OPS) == {n for n, s in ALL.items() if s.out is not None}
    # the one schema name that differs from the functional API's: ``mode`` is auto_functionalized's keyword
    assert 'str range_mode="symmetric"' in ALL["dynamic_quantize"].schema()
    assert "SymInt? axis=None" in ALL["quantize"].schema()
    assert "Tensor? zero_point," in ALL["quantize"].schema()     # no default before a required argument


def test_public_torch_functions_have_the_functional_parameters():
    pytest.importorskip("torch")
    import runtime.torch as sft
    omitted = {"fake_quantize": {"return_mask"}, "fake_quantize_learnable_backward": {"_max_blocks"},
               "grouped_matmul": {"workspace"}, "grouped_matmul_backward": {"workspace"}}
    for sig in ALL.values():
        if not hasattr(sft, sig.name):
            continue
        got = list(inspect.signature(getattr(sft, sig.name)).parameters)
        assert got == [p.name for p in sig.params if p.name not in omitted.get(sig.name, ())], sig.name
    assert inspect.signature(sft.fake_quantize_learnable).parameters["grad_factor"].default is None


def test_the_api_page_shows_the_declared_signatures():
    """docs/api.md's block of functional signatures names each op's parameters in declared order (``...``
    stands for a run of them), with the declared defaults."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    block = text[text.index("## The functional API"):]
    block = block[block.index("```python"):block.index("```\n", block.index("```python") + 3)]
    seen = set()
    for m in re.finditer(r"sf\.(\w+)\(", block):
        name, depth, i = m.group(1), 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(block[i], 0)
            i += 1
        args = [a.strip() for a in re.sub(r"#[^\n]*", "", block[m.end():i - 1]).split(",")]
        sig = ALL[name]
        declared = {p.name: p for p in sig.params if not p.name.startswith("_")}
        order = [p.name for p in sig.params if not p.name.startswith("_")]
        at = 0
        for a in (a for a in args if a and a != "*"):
            if a == "...":
                continue
            pname, _, default = a.partition("=")
            assert pname in declared, (name, pname)
            at = order.index(pname, at) + 1                  # in declared order
            p = declared[pname]
            want = None if p.role == signatures.OUT else p.default
            if default:
                assert eval(default) == want, (name, pname, default)       # noqa: S307 - the doc's literal
            else:
                assert want is REQUIRED, (name, pname)
        seen.add(name)
    assert seen == {s.name for s in FUNCTIONAL}


def test_out_overloads_return_what_their_schema_says():
    """A ``.out`` overload whose schema returns ``()`` returns None, whatever its computation's functional
    call returns (a value there breaks the dispatcher's contract, and under torch.compile the error
    once left grad mode off for the process); the others return their declared results."""
    import types
    torch = pytest.importorskip("torch")
    from runtime.torch import library
    for name, (_overload, cuda) in library.OUT.items():
        sig = ALL[name]
        impl = cuda.__globals__["_impl"]
        if "_f" in impl.__globals__:                      # derived: the functional API called with out=
            stub = types.FunctionType(impl.__code__, {**impl.__globals__, "_f": lambda *a, **k: torch.empty(1)})
            args = [torch.empty(1) if p.role == signatures.ARRAY else p.default for p in sig.torch_params]
            got = types.FunctionType(cuda.__code__, {**cuda.__globals__, "_impl": stub})(
                *args, **{n: torch.empty(1) for n in ("out",)})
            assert sig.out.returns == "()" and got is None, name
        else:
            assert sig.out.returns != "()" or name in ("dynamic_quantize", "grouped_matmul_backward"), name


def test_results_the_schema_spells_as_empty_tensors():
    """Where the direct computation returns None (a symmetric zero point, a gradient not asked for), the
    op's CUDA implementation returns an empty (0,) tensor of the declared dtype."""
    import types
    torch = pytest.importorskip("torch")
    from runtime.torch import library
    ops = {op._qualname.split("::")[1]: op for op in library.CUDA}
    want = {"dynamic_quantize": (None, None, torch.int32),
            "fake_quantize_learnable_backward": (None, None, torch.float32),
            "grouped_matmul_backward": (torch.float16, torch.bfloat16)}
    for name, dtypes in want.items():
        sig = ALL[name]
        impl = library.CUDA[ops[name]]                     # the op's CUDA implementation (its source: the signature)
        nones = tuple(None for _ in dtypes)
        fn = types.FunctionType(impl.__code__, {**impl.__globals__, "_direct": lambda *a: nones})
        args = {p.schema_name: p.default for p in sig.torch_params}
        args.update({p.schema_name: torch.empty(2, dtype=torch.float16) for p in sig.torch_params
                     if p.role == signatures.ARRAY})
        if name == "grouped_matmul_backward":
            args["dw_dtype"] = "bfloat16"
        got = fn(*args.values())
        assert [None if d is None else (tuple(t.shape), t.dtype) for t, d in zip(got, dtypes)] == \
            [None if d is None else ((0,), d) for d in dtypes], name


def test_out_overloads_bump_each_output_once():
    """The CUDA implementation of every ``.out`` overload bumps the version counter of each output it
    writes once (the dispatcher does not for an op defined this way), of a 2-D output too: the counter
    is shared by a tensor's rows, and a tensor handed to ``_increment_version`` alone is iterated by them."""
    import types
    torch = pytest.importorskip("torch")
    from runtime.torch import library
    for name, (_overload, cuda) in library.OUT.items():
        sig = ALL[name]
        args = [torch.empty(1) if p.role == signatures.ARRAY else p.default for p in sig.torch_params]
        outs = {o: torch.empty(4, 3) for o in sig.out.names}
        before = {o: t._version for o, t in outs.items()}
        types.FunctionType(cuda.__code__, {**cuda.__globals__, "_impl": lambda *a, **k: None})(*args, **outs)
        assert {o: t._version - before[o] for o, t in outs.items()} == {o: 1 for o in outs}, name
