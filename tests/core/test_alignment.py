"""Alignment on the CPU: no argument makes a kernel move a word at an address its size does not divide.

The kernels move some pointers in words wider than an element (runtime/vectors.py declares which:
vector loads and stores, 16-byte copies, accumulator pairs, tensor maps). Every call here plants an
element-aligned but word-misaligned array (an output, a workspace, an input) and checks, on fake
device arrays with the launches recorded (tests/fakes.py checks each launch against the declared
accesses), that the call either takes a path that needs no alignment (the quantization kernels'
scalar path, ``strategy="auto"``'s choice of backend) or raises an InvalidProblemError naming the
argument, its offset and the alignment before anything is launched.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

import runtime as sf
from runtime import InvalidProblemError, plans, replay, vectors
from tests import fuzz_cases as fc
from tests.fakes import assert_aligned, entry_points, err
from tests.core.test_replay import dev  # noqa: F401  (a fixture)
from tests.core.test_fuzz import VALID, _launch_problems, _run_once, _settings, fz  # noqa: F401  (fz: a fixture)
from tests.moe.test_moe_replay import mdev  # noqa: F401  (a fixture)

REG = sf.default_registry()
M, N, K, E = 64, 64, 64, 4
H = "float16"


def named(launch) -> dict:
    """A recorded launch's parameters by name (the kernel's ABI)."""
    fn, _, _, _, values = launch
    entry, group = entry_points(REG)[fn]
    return dict(zip(REG.abi(entry.launch["abi"][group]).names, values))


def kernels(d) -> list:
    return [launch[0] for launch in d.launches if launch[0] != "memset"]


def _backend(symbol: str) -> str:
    return next(b for b in ("wgmma", "mma", "simt") if f"_{b}" in symbol)


# -- the declaration ------------------------------------------------------------------------------
def test_every_access_names_pointer_and_integer_parameters_of_its_kernel():
    """Each declared access is a pointer parameter of its entry-point group, its strides and
    switches integer parameters of the same group: the declaration follows the ABI."""
    seen = set()
    for entry in REG.entries.values():
        for group, abi_id in entry.launch["abi"].items():
            packing = dict(map(tuple, REG.manifest["abi"][abi_id]))
            for a in plans.LAUNCHERS[entry.launch["kind"]].accesses(entry.sku, entry.launch).get(group, ()):
                assert packing.get(a.param) == "ptr", (entry.sku, group, a)
                assert all(packing.get(p) in ("i64", "i32") for p in a.strides + a.when), (entry.sku, group, a)
                assert a.nbytes in (1, 2, 4, 8, 16) and a.nbytes >= a.item or a.nbytes == a.item, a
                seen.add(entry.launch["kind"])
    assert seen == set(plans.LAUNCHERS), "every launch kind declares vector accesses"


@pytest.mark.parametrize("item, n, want", [(2, 8, 16), (4, 4, 16), (8, 2, 16), (4, 8, 16), (1, 8, 8), (1, 4, 4),
                                           (1, 2, 1), (2, 2, 4), (4, 2, 8), (8, 1, 8), (1, 16, 16)])
def test_word_is_what_load_vec_and_store_vec_move(item, n, want):
    """prelude.cuh: 16-byte words for a multiple of 16 bytes, one 8- or 4-byte word, else element by
    element (a 2-byte vector of bytes is two byte accesses)."""
    assert vectors.word(item, n) == want


def test_packed_streams_count_container_bytes():
    assert vectors.stream_word("s4", 8) == 4 and vectors.stream_word("u4", 4) == 1
    assert vectors.stream_word("fp8_e4m3", 8) == 8 and vectors.stream_word("bf16", 8) == 16


def test_the_fake_launcher_refuses_a_misaligned_vector_access():
    """tests/fakes.py's check on a launch: an mma product whose output is 2 bytes off its 4-byte
    pairs, a quantize launched on its vector path with a misaligned output or row stride."""
    mma = REG.select(category="moe", op="grouped_matmul", element="f16", backend="mma", arch=80)
    entry = REG.lookup(mma)
    abi = REG.abi(entry.launch["abi"]["gemm"])
    good = dict.fromkeys(abi.names, 0) | dict(x=0x7F0000000000, w=0x7F0000100000, out=0x7F0000200000, ldx=64,
                                              w_se=64 * 64, w_sn=64, M=64, N=64, K=64, E=4)
    assert_aligned(entry.symbol, [good[n] for n in abi.names])
    for change, words in ((dict(out=0x7F0000200002), ("out", "2 bytes past a 4-byte boundary")),
                          (dict(x=0x7F0000000008), ("x", "16-byte")), (dict(ldx=68), ("x", "136 bytes"))):
        values = good | change
        with pytest.raises(AssertionError) as e:
            assert_aligned(entry.symbol, [values[n] for n in abi.names])
        assert all(w in str(e.value) for w in words), str(e.value)
    q = REG.select(category="quantization", op="quantize", scope="token", mode="symmetric", element="f16",
                   aux_element="s8", arch=80)
    entry = REG.lookup(q)
    abi = REG.abi(entry.launch["abi"]["main"])
    base = dict.fromkeys(abi.names, 0) | dict(x=0x7F0000000000, x_rs=64, q=0x7F0000100004, q_rs=64, vec_ok=1)
    with pytest.raises(AssertionError, match="q at 0x7f0000100004 is 4 bytes past an? 8-byte"):
        assert_aligned(entry.symbol, [base[n] for n in abi.names])
    assert_aligned(entry.symbol, [(base | dict(vec_ok=0))[n] for n in abi.names])     # the scalar path
    with pytest.raises(AssertionError, match="row stride|stride of 60"):
        assert_aligned(entry.symbol, [(base | dict(q=0x7F0000100000, q_rs=60))[n] for n in abi.names])


# -- MoE: outputs, workspaces and inputs, for each strategy -------------------------------------------
def _offs(d):
    return d.a((E + 1,), "int32")


def _fwd(d, strategy, out_off=0, dtype=H, **kw):
    out = d.a((M, N), dtype, offset=out_off)
    return sf.grouped_matmul(d.a((M, K), dtype), d.a((E, N, K), dtype), offsets=_offs(d), strategy=strategy,
                             out=out, **kw)


@pytest.mark.parametrize("strategy, off, words", [
    ("mma", 2, ("out", "2 bytes past a 4-byte boundary", "pairs")),
    ("mma", 6, ("out", "2 bytes past a 4-byte boundary")),
    ("wgmma", 2, ("out", "2 bytes past a 16-byte boundary")),
    ("wgmma", 4, ("out", "4 bytes past a 16-byte boundary", "tensor-map")),
    ("wgmma", 8, ("out", "8 bytes past a 16-byte boundary"))])
def test_a_tensor_core_strategy_refuses_a_misaligned_out(mdev, strategy, off, words):
    """The reproducer: out 2 bytes off a 4-byte boundary with strategy="mma" (the epilogue stores
    pairs as 32-bit words) is an InvalidProblemError naming out, its offset and the alignment, and
    nothing is launched; wgmma's tensor-map stores need 16 bytes."""
    mdev.launches = []
    err(lambda: _fwd(mdev, strategy, off), InvalidProblemError, *words, "'simt'")
    assert not mdev.launches


@pytest.mark.parametrize("off, backend", [(0, "wgmma"), (2, "simt"), (4, "mma"), (8, "mma"), (16, "wgmma")])
def test_auto_takes_the_backend_the_out_alignment_allows(mdev, off, backend):
    """strategy="auto" (sm_90 here) picks wgmma, else mma, else simt by the pre-launch checks: an out
    4 or 8 bytes off 16 goes to mma (pairs fit), 2 bytes off to simt (element stores)."""
    mdev.launches = []
    _fwd(mdev, "auto", off)
    gemm = [s for s in kernels(mdev) if "_route_" not in s]
    assert [_backend(s) for s in gemm] == [backend]


def test_simt_takes_any_element_aligned_out(mdev):
    for off in (2, 4, 6, 8):
        mdev.launches = []
        _fwd(mdev, "simt", off)
        assert [_backend(s) for s in kernels(mdev) if "_route_" not in s] == ["simt"]


def _bwd(d, strategy, dx_off=None, dw_off=None, dw_dtype="float32", ws_off=None):
    x, w, dy = d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H)
    out = (d.a((M, K), H, offset=dx_off or 0), d.a((E, N, K), dw_dtype, offset=dw_off or 0))
    ws = None if ws_off is None else d.a((sf.moe.grouped_matmul_workspace_size(M, E, "offsets"),), "uint8",
                                         offset=ws_off)
    return sf.grouped_matmul_backward(x, w, dy, offsets=_offs(d), strategy=strategy, dw_dtype=dw_dtype, out=out,
                                      workspace=ws)


@pytest.mark.parametrize("strategy", ["mma", "wgmma"])
@pytest.mark.parametrize("kw, arg, mma_word", [(dict(dx_off=2), "out[0] (dx)", "a 4-byte"),
                                               (dict(dw_off=4), "out[1] (dw)", "an 8-byte"),
                                               (dict(dw_off=2, dw_dtype=H), "out[1] (dw)", "a 4-byte")])
def test_the_backward_refuses_misaligned_gradients(mdev, strategy, kw, arg, mma_word):
    """dx 2 bytes off, a float32 dw 4 bytes off (mma: float2 pairs), an f16 dw 2 bytes off: refused
    before any launch (the routing included), naming the gradient, its offset and the alignment."""
    off = kw.get("dx_off") or kw["dw_off"]
    word = mma_word if strategy == "mma" else "a 16-byte"
    mdev.launches = []
    err(lambda: _bwd(mdev, strategy, **kw), InvalidProblemError, f"{arg} at", f"{off} bytes past {word} boundary")
    assert not mdev.launches


@pytest.mark.parametrize("kw, want", [(dict(dx_off=2), ["simt", "wgmma"]), (dict(dw_off=4), ["wgmma", "simt"]),
                                      (dict(dx_off=4, dw_off=8), ["mma", "mma"]), ({}, ["wgmma", "wgmma"])])
def test_the_backward_with_auto_falls_back_per_gradient(mdev, kw, want):
    mdev.launches = []
    _bwd(mdev, "auto", **kw)
    assert [_backend(s) for s in kernels(mdev) if "_route_" not in s] == want


@pytest.mark.parametrize("strategy", ["auto", "simt", "mma", "wgmma"])
@pytest.mark.parametrize("off", [1, 4, 8])
def test_a_misaligned_workspace_is_refused_by_every_strategy(mdev, strategy, off):
    mdev.launches = []
    err(lambda: _bwd(mdev, strategy, ws_off=off), InvalidProblemError, "workspace",
        f"{off} bytes past a 16-byte boundary", "16-byte aligned")
    assert not mdev.launches


@pytest.mark.parametrize("arg", ["x", "w", "dy"])
@pytest.mark.parametrize("strategy", ["mma", "wgmma"])
def test_misaligned_operands_are_refused_by_the_tensor_core_strategies(mdev, arg, strategy):
    def call(d):
        a = {n: d.a(s, H, offset=8 if n == arg else 0) for n, s in (("x", (M, K)), ("w", (E, N, K)), ("dy", (M, N)))}
        return sf.grouped_matmul_backward(a["x"], a["w"], a["dy"], offsets=_offs(d), strategy=strategy)
    mdev.launches = []
    err(lambda: call(mdev), InvalidProblemError, f"{arg} at", "8 bytes past a 16-byte boundary")
    assert not mdev.launches
    call_simt = sf.grouped_matmul_backward(mdev.a((M, K), H, offset=8 if arg == "x" else 0),
                                           mdev.a((E, N, K), H, offset=8 if arg == "w" else 0),
                                           mdev.a((M, N), H, offset=8 if arg == "dy" else 0), offsets=_offs(mdev),
                                           strategy="simt")
    assert all(r is not None for r in call_simt)


def test_a_remembered_call_does_not_replay_onto_a_misaligned_out(mdev):
    """The replay key holds every array's address modulo 16: an out that moved off its alignment
    takes the full path, which refuses it (or, for auto, picks the backend anew)."""
    _fwd(mdev, "mma")
    _fwd(mdev, "mma")
    assert mdev.hits == 1
    err(lambda: _fwd(mdev, "mma", 2), InvalidProblemError, "out", "4-byte")
    mdev.launches = []
    _fwd(mdev, "auto")
    _fwd(mdev, "auto", 2)
    assert [_backend(s) for s in kernels(mdev) if "_route_" not in s] == ["wgmma", "simt"]


def test_select_plan_without_out_is_the_aligned_choice(mdev):
    """select_plan knows no out: it names the backend of an aligned one."""
    plan = sf.moe.select_plan("grouped_matmul", mdev.a((M, K), H), mdev.a((E, N, K), H), offsets=_offs(mdev))
    assert plan.sku.backend == "wgmma"


# -- quantization families: a misaligned output or parameter takes the scalar path -----------------------
def _vec_paths(d, call, offs) -> list:
    """vec_ok of every vector-capable launch of ``call(d, off)`` for each offset (team kernels count
    as the vector path, the cooperative kernel too)."""
    out = []
    for off in offs:
        replay.CACHE.clear()
        d.launches = []
        call(d, off)
        flags = []
        for launch in d.launches:
            if launch[0] == "memset":
                continue
            group = entry_points(REG)[launch[0]][1]
            p = named(launch)
            flags.append(1 if group in ("team", "coop") else int(bool(p["vec_ok"] or p.get("flat"))))
        out.append(flags)
    return out


QUANT_CASES = {
    # name: (call(d, off), offsets, the vector path taken per offset)
    "quantize token, f16 -> int8 out": (
        lambda d, o: sf.quantize(d.a((8, 64), H), d.a((8,)), scope="token", out=d.a((8, 64), "int8", offset=o)),
        (0, 1, 2, 4, 8), [[1], [0], [0], [0], [1]]),      # 8 codes a vector: 8-byte words suffice
    "dequantize token, int8 -> f32 out": (
        lambda d, o: sf.dequantize(d.a((8, 64), "int8"), d.a((8,)), scope="token",
                                   out=d.a((8, 64), "float32", offset=o)),
        (0, 4, 8, 16), [[1], [0], [0], [1]]),
    "quantize channel last, misaligned scale": (
        lambda d, o: sf.quantize(d.a((8, 64), H), d.a((64,), offset=o), scope="channel", axis=1),
        (0, 4, 8), [[1], [0], [0]]),
    "quantize channel last, misaligned zero point": (
        lambda d, o: sf.quantize(d.a((8, 64), "float32"), d.a((64,)), d.a((64,), "int32", offset=o), scope="channel",
                                 axis=1, out_dtype="uint8", qmin=0, qmax=255),
        (0, 4, 8, 16), [[1], [0], [0], [1]]),              # f32: 4 elements a vector, 16-byte words
    "quantize_backward out": (
        lambda d, o: sf.quantize_backward(d.a((8, 64)), d.a((8, 64)), d.a((8,)), scope="token",
                                          out=d.a((8, 64), offset=o)),
        (0, 4, 12), [[1], [0], [0]]),
    "fake_quantize out": (
        lambda d, o: sf.fake_quantize(d.a((8, 64), H), d.a((8, 4)), scope="group", group_size=16,
                                      out=d.a((8, 64), H, offset=o)),
        (0, 2, 8), [[1], [0], [0]]),
    "fake_quantize_learnable_backward out": (
        lambda d, o: sf.fake_quantize_learnable_backward(d.a((6, 64)), d.a((6, 64)), d.a((6,)), scope="token",
                                                         out=d.a((6, 64), offset=o)),
        (0, 4, 8), [[1], [0], [0]]),
    "quantize fp8 out": (
        lambda d, o: sf.quantize(d.a((8, 64), H), d.a((8,)), scope="token", out_dtype="fp8_e4m3",
                                 out=d.a((8, 64), "uint8", offset=o)),
        (0, 1, 4, 8), [[1], [0], [0], [1]]),
    "quantize int4 out": (
        lambda d, o: sf.quantize(d.a((8, 64), H), d.a((8,)), scope="token", out_dtype="int4",
                                 out=d.a((8, 32), "uint8", offset=o)),
        (0, 2, 4), [[1], [0], [1]]),                       # 8 halves -> 4 bytes of int4 codes
    "dequantize fp8 -> f16 out": (
        lambda d, o: sf.dequantize(d.a((8, 64), "uint8"), d.a((8,)), scope="token", in_dtype="fp8_e4m3",
                                   out_dtype=H, out=d.a((8, 64), H, offset=o)),
        (0, 2, 8, 16), [[1], [0], [0], [1]]),
    "dynamic_quantize token, q out": (
        lambda d, o: sf.dynamic_quantize(d.a((16, 512), H), scope="token",
                                         out=(d.a((16, 512), "int8", offset=o), d.a((16,)))),
        (0, 1, 4, 8), [[1], [0], [0], [1]]),
    "dynamic_quantize group fp8, q out": (
        lambda d, o: sf.dynamic_quantize(d.a((16, 512), H), scope="group", group_size=128, out_dtype="fp8_e4m3",
                                         out=(d.a((16, 512), "uint8", offset=o), d.a((16, 4)))),
        (0, 2, 8), [[1], [0], [1]]),
    "dynamic_quantize tensor, q out": (
        lambda d, o: sf.dynamic_quantize(d.a((64, 256), H), scope="tensor",
                                         out=(d.a((64, 256), "int8", offset=o), d.a(()))),
        (0, 2, 8), [[1], [1, 1, 0], [1]]),                 # cooperative; else reduce (x aligned) + scalar quantize
}


@pytest.mark.parametrize("name", list(QUANT_CASES))
def test_a_misaligned_quantization_array_takes_the_scalar_path(dev, name):
    call, offs, want = QUANT_CASES[name]
    assert _vec_paths(dev, call, offs) == want


# -- the fuzz: valid calls with one array moved off its words -------------------------------------------
def may_refuse(p: fc.Problem, key: str) -> bool:
    """Whether moving ``key`` off its alignment may be refused: a grouped-matmul workspace (always 16
    bytes), or any array of a call that asks for a tensor-core strategy. Everything else runs."""
    if not p.op.startswith("grouped_matmul"):
        return False
    a = next(a for a in p.arrays() if a.key == key)
    return a.fill[0] == "workspace" or p.kw.get("strategy") in ("mma", "wgmma")


@st.composite
def misaligned_problems(draw, op: str, env: fc.Env):
    """A valid problem of ``op`` with one array (an output or workspace two times in three, when the
    call has one) moved by a whole number of elements off its 16-byte boundary: (problem, its key)."""
    p = draw(fc.problems(op, env))
    arrs = [a for a in p.arrays() if a.alias is None and not a.null and a.size and a.layout == "c"]
    outs = [a for a in arrs if a.fill[0] in ("out", "workspace")]
    pool = outs if outs and draw(st.integers(0, 2)) else arrs
    if not pool:
        return p, None
    a = draw(st.sampled_from(pool))
    moves = [k * a.itemsize for k in range(1, 32 // a.itemsize) if (a.offset + k * a.itemsize) % 16]
    move = draw(st.sampled_from(moves))
    fc._replace_arr(p, a.key, dataclasses.replace(a, offset=a.offset + move))
    p.mutations.append(f"{a.key}.offset+={move} (element-aligned)")
    return p, a.key


FUZZ_OPS = ("quantize", "dequantize", "dynamic_quantize", "quantize_backward", "fake_quantize",
            "fake_quantize_learnable_backward", "grouped_matmul", "grouped_matmul_backward")
VALID_CPU = dataclasses.replace(VALID, null=False, huge=False)


def check_misaligned(d, p, key):
    """The property on the fake device: the call runs (each launch aligned as its kernel needs, its
    pointers inside the call's arrays) and replays, or raises an InvalidProblemError about alignment
    before any launch, where :func:`may_refuse` allows it."""
    outcome, res, launches, ranges = _run_once(d, p, 0x7A0000000000, 0x7E8000000000)
    if outcome == "typed":
        assert not launches, f"{res!r} after {len(launches)} launches\n{p!r}"
        if isinstance(res, sf.UnsupportedError) and "aligned" not in str(res):
            return "unsupported"
        assert may_refuse(p, key), f"refused: {res}\n{p!r}"
        assert "byte boundary" in str(res) and "alignment" in str(res), f"{res}\n{p!r}"
        return "refused"
    bad = _launch_problems(launches, ranges)
    assert not bad, f"{bad[:3]}\n{p!r}"
    second = _run_once(d, p, 0x7B0000000000, 0x7E9000000000)      # a replay at other, same-aligned addresses
    assert second[0] == "ok", f"the repeated call raised {second[1]!r}\n{p!r}"
    return "ran"


@pytest.mark.parametrize("op", FUZZ_OPS)
def test_fuzz_misaligned_arrays(fz, op):
    seen = set()

    @_settings(150)
    @given(pk=misaligned_problems(op, VALID_CPU))
    def run(pk):
        p, key = pk
        if key is not None:
            seen.add(check_misaligned(fz, p, key))
    run()
    assert "ran" in seen
    if op.startswith("grouped_matmul"):
        assert "refused" in seen


# -- the plan API: a workspace given in the launch arguments ---------------------------------------------
def test_the_plan_api_checks_a_moe_workspace(mdev):
    from runtime.arrays import as_array
    x, w, offs = mdev.a((M, K), H), mdev.a((E, N, K), H), _offs(mdev)
    plan = sf.moe.select_plan("grouped_matmul", x, w, offsets=offs)
    size = sf.moe.grouped_matmul_workspace_size(M, E, "offsets")

    def args(off):
        return sf.moe.problem.MoeArgs("grouped_matmul", as_array(x, "x"), as_array(w, "w"), None,
                              as_array(mdev.a((M, N), H), "out"), sf.moe.problem.Routing(E, M, offsets=as_array(offs, "offsets")),
                              M, N, K, E, workspace=as_array(mdev.a((size,), "uint8", offset=off), "workspace"))
    mdev.launches = []
    err(lambda: plan.run(args(8)), InvalidProblemError, "workspace at", "8 bytes past a 16-byte boundary")
    assert not mdev.launches
    plan.run(args(0))
    assert mdev.launches


def test_the_plan_api_checks_a_dynamic_reduce_workspace(dev, override_settings):
    from runtime.arrays import as_array
    from runtime.quantization.dynamic import DynamicArgs
    from runtime.plans import Descriptor, cached_plan
    from runtime.scopes import rows_view
    override_settings(schedule="two-pass")
    plan = cached_plan(Descriptor("dynamic_quantize", "tensor", "symmetric", "f32", "s8"))
    x, q = as_array(dev.a((64, 256)), "x"), as_array(dev.a((64, 256), "int8"), "q")

    def args(off):
        a = DynamicArgs(x, rows_view(x, "x"), q, rows_view(q, "q"), as_array(dev.a(()), "scale"), None, "tensor",
                        "symmetric", -127, 127, 0, 1e-8)
        a.workspace = as_array(dev.a((plan.workspace_size(a) + 8,), "uint8", offset=off), "workspace")
        return a
    err(lambda: plan.launcher.check(plan, args(2)), InvalidProblemError, "workspace at",
        "2 bytes past a 4-byte boundary", "partial results")
    plan.launcher.check(plan, args(4))
