"""The replay of repeated calls of the MoE grouped matmul, on the CPU (fake device arrays, launches
recorded instead of run; the ``dev`` fixture of tests/core/test_replay.py).

A replay of grouped_matmul / grouped_matmul_backward must launch exactly what the full path
launches for the same arrays: the routing kernels and the GEMM kernels, with the same grids,
blocks and every parameter value (the workspace regions are pointers into the re-allocated
workspace; the status word is a constant). With ``out=`` and ``workspace=`` a repeated call
allocates nothing.
"""
import pytest

import runtime as sf
from runtime import replay
from runtime.moe import grouped as moe
from runtime.tma import MapSpec
from tests.fakes import err, fake_tensor_map
from tests.core.test_replay import _run, dev, replay_matches_full_path  # noqa: F401  (dev: a fixture)


@pytest.fixture
def mdev(dev):  # noqa: F811
    """``dev`` for the moe calls: the fake device answers their device queries (kernels, properties,
    occupancy, shared memory, arch), encodes tensor maps (``fake_tensor_map``) and logs every
    allocation (``mdev.allocs``: (shape, kind))."""
    return dev


M, N, K, E = 256, 512, 512, 8
H = "float16"


def _ids(d):
    return d.a((M,), "int32")


def _offs(d, kind="int32"):
    return d.a((E + 1,), kind)


def _ws(d, routing):
    return d.a((sf.moe.grouped_matmul_workspace_size(M, E, routing),), "uint8")


CALLS = {
    # forward: routing kernels (3 for row_experts, 1 for offsets) + the product
    "fwd row_experts mma": (lambda d: sf.grouped_matmul(d.a((M, K), H), d.a((E, N, K), H), row_experts=_ids(d)), 4),
    "fwd offsets i32 mma": (lambda d: sf.grouped_matmul(d.a((M, K), H), d.a((E, N, K), H), offsets=_offs(d)), 2),
    "fwd offsets i64 trusted": (lambda d: sf.grouped_matmul(d.a((M, K), H), d.a((E, N, K), H),
                                                            offsets=_offs(d, "int64"), trusted_offsets=True), 2),
    "fwd offsets wgmma, strided x": (lambda d: sf.grouped_matmul(d.a((M, K), H, strides=(K + 8, 1)), d.a((E, N, K), H),
                                                                 offsets=_offs(d), strategy="wgmma"), 2),
    "fwd f32 simt": (lambda d: sf.grouped_matmul(d.a((M, 40)), d.a((E, 24, 40)), row_experts=_ids(d)), 4),
    "fwd simt asked, strided x": (lambda d: sf.grouped_matmul(d.a((M, K), H, strides=(K + 8, 1)), d.a((E, N, K), H),
                                                              offsets=_offs(d), strategy="simt"), 2),
    "fwd out=": (lambda d: sf.grouped_matmul(d.a((M, K), H), d.a((E, N, K), H), row_experts=_ids(d),
                                             out=d.a((M, N), H)), 4),
    "fwd out= workspace=": (lambda d: sf.grouped_matmul(d.a((M, K), H), d.a((E, N, K), H), offsets=_offs(d),
                                                        out=d.a((M, N), H), workspace=_ws(d, "offsets")), 2),
    # backward: routing once + one product per gradient
    "bwd row_experts": (lambda d: sf.grouped_matmul_backward(d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H),
                                                             row_experts=_ids(d)), 5),
    "bwd offsets": (lambda d: sf.grouped_matmul_backward(d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H),
                                                         offsets=_offs(d)), 3),
    "bwd input only": (lambda d: sf.grouped_matmul_backward(d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H),
                                                            row_experts=_ids(d), need_weight=False), 4),
    "bwd weight only, dw f16": (lambda d: sf.grouped_matmul_backward(d.a((M, K), H), d.a((E, N, K), H),
                                                                     d.a((M, N), H), offsets=_offs(d),
                                                                     need_input=False, dw_dtype="float16"), 2),
    "bwd offsets wgmma, dw f16": (lambda d: sf.grouped_matmul_backward(
        d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H), offsets=_offs(d, "int64"), strategy="wgmma",
        dw_dtype=H), 3),
    "bwd f32 simt": (lambda d: sf.grouped_matmul_backward(d.a((M, 40)), d.a((E, 24, 40)), d.a((M, 24)),
                                                          row_experts=_ids(d)), 5),
    "bwd out=": (lambda d: sf.grouped_matmul_backward(d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H),
                                                      offsets=_offs(d), out=(d.a((M, K), H), d.a((E, N, K))),), 3),
    "bwd out= weight only, workspace=": (
        lambda d: sf.grouped_matmul_backward(d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H), row_experts=_ids(d),
                                             need_input=False, out=(None, d.a((E, N, K))),
                                             workspace=_ws(d, "row_experts")), 4),
    "bwd out= input only": (lambda d: sf.grouped_matmul_backward(d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H),
                                                                 row_experts=_ids(d), need_weight=False,
                                                                 out=(d.a((M, K), H), None)), 4),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_replay_launches_what_the_full_path_launches(mdev, name):
    call, n = CALLS[name]
    launches = replay_matches_full_path(mdev, call)[0]
    assert len(launches) == n
    names = [fn for fn, *_ in launches]
    routes = [f for f in names if "_route_" in f]
    assert names[:len(routes)] == routes, "the routing runs first, once"
    assert len(routes) == (3 if any(f.endswith("_route_count") for f in routes) else 1)


def test_a_replay_fills_every_workspace_region_of_the_new_workspace(mdev):
    """The routing's and the GEMM's workspace pointers are the regions (layout offsets) of this
    call's workspace; the status word is the device's."""
    from runtime import status
    made = {}

    def call(d):
        made.update(x=d.a((M, K), H), w=d.a((E, N, K), H), offs=_offs(d), out=d.a((M, N), H), ws=_ws(d, "offsets"))
        return sf.grouped_matmul(made["x"], made["w"], offsets=made["offs"], out=made["out"], workspace=made["ws"])
    _run(mdev, call, 0x7F0000000000)
    (route, gemm), y = _run(mdev, call, 0x7F4000000000)
    assert mdev.hits == 1 and y == made["out"].ptr
    lay = moe.workspace_layout(M, E, "offsets")
    plan = sf.moe.select_plan("grouped_matmul", made["x"], made["w"], offsets=made["offs"])
    ws = made["ws"].ptr
    v, abi = gemm[4], plan.abi("gemm")
    assert (v[abi.slot["x"]], v[abi.slot["w"]], v[abi.slot["out"]], v[abi.slot["dy"]]) == \
        (made["x"].ptr, made["w"].ptr, y, 0)
    assert (v[abi.slot["ws_status"]], v[abi.slot["row_start"]], v[abi.slot["tile_start"]], v[abi.slot["counter"]],
            v[abi.slot["perm"]]) == (ws, ws + lay["row_start"], ws + lay["tile_start"], ws + lay["counters"], 0)
    v, abi = route[4], plan.abi("route_offsets_i32")
    assert (v[abi.slot["off"]], v[abi.slot["ws_status"]], v[abi.slot["row_start"]], v[abi.slot["counters"]],
            v[abi.slot["status"]]) == (made["offs"].ptr, ws, ws + lay["row_start"], ws + lay["counters"],
                                       status.pointer(0))


@pytest.mark.parametrize("backward", [False, True])
def test_repeated_call_with_out_and_workspace_allocates_nothing(mdev, backward):
    d = mdev.at(0x7F0000000000)
    x, w, dy, ids = d.a((M, K), H), d.a((E, N, K), H), d.a((M, N), H), _ids(d)
    ws = _ws(d, "row_experts")
    if backward:
        out = (d.a((M, K), H), d.a((E, N, K)))

        def call(**kw):
            return sf.grouped_matmul_backward(x, w, dy, row_experts=ids, **kw)
    else:
        out = d.a((M, N), H)

        def call(**kw):
            return sf.grouped_matmul(x, w, row_experts=ids, **kw)
    for kw, allocations in ((dict(out=out, workspace=ws), 0), (dict(out=out), 1), ({}, 3 if backward else 2)):
        call(**kw)
        del mdev.allocs[:]
        hits = mdev.hits
        again = call(**kw)
        assert mdev.hits == hits + 1, "the repeated call replays"
        assert len(mdev.allocs) == allocations, (kw.keys(), mdev.allocs)
        if "out" in kw:
            assert again is out if not backward else (again[0] is out[0] and again[1] is out[1])
        if allocations:
            assert mdev.allocs[-1][1] == "u8", "the workspace is allocated last"


def test_offsets_replay_by_default_and_not_under_sync_checks(mdev, monkeypatch):
    seen = []
    monkeypatch.setattr(moe, "validate_offsets", lambda offsets, M, E=None: seen.append((M, E)))
    call, _ = CALLS["fwd offsets i32 mma"]
    _run(mdev, call, 0x7F0000000000)
    _run(mdev, call, 0x7F4000000000)
    assert mdev.hits == 1 and not seen
    _run(mdev, call, 0x7F4000000000, sync=True)
    assert mdev.hits == 1 and seen == [(M, E)], "under sync_checks the offsets are validated again"
    # trusted offsets are not validated: the replay serves the debug mode too
    trusted, _ = CALLS["fwd offsets i64 trusted"]
    _run(mdev, trusted, 0x7F0000000000)
    _run(mdev, trusted, 0x7F4000000000, sync=True)
    assert mdev.hits == 2 and len(seen) == 1


def test_a_tile_configuration_in_code_is_part_of_the_key(mdev):
    call, _ = CALLS["fwd row_experts mma"]
    first = _run(mdev, call, 0x7F0000000000)[0]
    from tests.fakes import D
    plan = sf.moe.select_plan("grouped_matmul", D((M, K), H), D((E, N, K), H), row_experts=D((M,), "int32"))
    other = next(n for n in sf.moe.variant_names(plan) if n != plan.launch["default_variant"])
    with sf.moe.use_config(fwd=other):
        launched = _run(mdev, call, 0x7F0000000000)[0]
    assert mdev.hits == 0 and launched[-1][0] == plan.launch["variants"][other]["symbol"] != first[-1][0]
    _run(mdev, call, 0x7F0000000000)
    assert mdev.hits == 1


def test_a_replay_checks_the_given_outputs_apart(mdev):
    """A replay whose out= overlaps an input (same layouts, other addresses) takes the full path,
    which raises the typed error."""
    from tests.fakes import D
    mdev.at(0x7F0010000000)                  # allocations
    x, w, ids = D((M, K), H), D((E, N, K), H, ptr=0x7F0001000000), D((M,), "int32", ptr=0x7F0002000000)
    sf.grouped_matmul(x, w, row_experts=ids, out=D((M, N), H, ptr=0x7F0003000000))
    err(lambda: sf.grouped_matmul(x, w, row_experts=ids, out=D((M, N), H, ptr=0x7F0001000000)),
        sf.InvalidProblemError, "out overlaps w")
    ws = D((sf.moe.grouped_matmul_workspace_size(M, E),), "uint8", ptr=0x7F0004000000)
    sf.grouped_matmul(x, w, row_experts=ids, workspace=ws)
    err(lambda: sf.grouped_matmul(x, w, row_experts=ids, workspace=D(ws.shape, "uint8", ptr=0x7F0000000000)),
        sf.InvalidProblemError, "workspace overlaps x")
    assert mdev.hits == 0
    assert len(replay.CACHE) == 2


def test_out_and_none_out_are_different_calls(mdev):
    """out=(None, None) is an error when the gradients are asked for, even after a call without out=."""
    from tests.fakes import D
    x, w, dy = D((M, K), H), D((E, N, K), H, ptr=0x7F0001000000), D((M, N), H, ptr=0x7F0002000000)
    ids = D((M,), "int32", ptr=0x7F0003000000)
    sf.grouped_matmul_backward(x, w, dy, row_experts=ids)
    err(lambda: sf.grouped_matmul_backward(x, w, dy, row_experts=ids, out=(None, None)), sf.InvalidProblemError,
        "out[0] (dx) is None")


def test_inputs_may_overlap_each_other_and_still_replay(mdev):
    """Only pairs with a written array are tested: x and w views of one buffer replay with out=."""
    from tests.fakes import D
    mdev.at(0x7F0010000000)
    for base in (0x7F0000000000, 0x7F0100000000):
        x, w = D((M, K), H, ptr=base), D((E, N, K), H, ptr=base + 1024)
        ids, y = D((M,), "int32", ptr=base + 0x1000000), D((M, N), H, ptr=base + 0x2000000)
        assert sf.grouped_matmul(x, w, row_experts=ids, out=y) is y
    assert mdev.hits == 1


def test_a_replay_encodes_the_tensor_maps_of_the_new_arrays(mdev):
    """The wgmma launch's tensor-map parameters are the maps of this call's x, w and output (by
    address), in a replay too: a map describes one array at one address."""
    made = {}

    def call(d):
        made.update(x=d.a((M, K), H), w=d.a((E, N, K), H))
        made["y"] = sf.grouped_matmul(made["x"], made["w"], offsets=_offs(d), strategy="wgmma")
        return made["y"]
    for base in (0x7F0000000000, 0x7F4000000000):
        launches, _ = _run(mdev, call, base)
        fn, grid, block, fmt, values = launches[-1]
        assert fmt.count("T") == 3 and block == (384,)
        maps = [v for c, v in zip(fmt, values) if c == "T"]
        assert [m == fake_tensor_map(made[a].ptr, spec) for m, (a, spec) in zip(
            maps, (("x", MapSpec("f16", (K, M), (2 * K,), (64, 64))),   # 32 rows an expert: 64-row tiles
                   ("w", MapSpec("f16", (K, N, E), (2 * K, 2 * N * K), (64, 256, 1))),
                   ("y", MapSpec("f16", (N, M), (2 * N,), (64, 64)))))] == [True, True, True]
    assert mdev.hits == 1
