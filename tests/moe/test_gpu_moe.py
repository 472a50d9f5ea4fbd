"""GPU: the moe grouped matmul against the float64 reference, torch._grouped_mm and a
per-expert torch.mm loop; invalid offsets, determinism, frameworks, streams, big tensors."""
import numpy as np
import pytest

import runtime as sf
from codegen.harness import verify
from codegen.harness.checks import base as checks
from codegen.harness.checks import moe as checks_moe
from runtime import reference_moe as ref
from runtime.axes import PASSES
from tests.fakes import count_replays

pytestmark = pytest.mark.gpu

REG = sf.default_registry()
MOE = [s for s in REG.skus() if s.category == "moe"]


def _sm90() -> bool:
    """The wgmma kernels (sm_90a) run on compute capability 9.0 only."""
    import cupy as cp
    return cp.cuda.Device().compute_capability == "90"


def _skip_unless_runs(strategy):
    if strategy == "wgmma" and not _sm90():
        pytest.skip("the wgmma kernels run on sm_90 (H100 / H200) only")


@pytest.mark.parametrize("sku", MOE, ids=str)
def test_moe_sku(sku, rng):
    _skip_unless_runs(sku.backend)
    res = verify.check(sku, rng)
    assert res.passed, f"{res.detail}: {res.failures[:6]}"


@pytest.mark.parametrize("strategy", ["mma", "wgmma"])
@pytest.mark.parametrize("op", ["grouped_matmul", "grouped_matmul_backward_input", "grouped_matmul_backward_weight"])
def test_every_tile_configuration_poisoned(op, strategy, rng):
    """Each mma / wgmma configuration writes every element (NaN-poisoned outputs), matches torch.mm
    per expert, and gives the same bits twice; partial tiles, padding rows, an expert without rows,
    K and N tails. wgmma: the rows sorted by expert, the padding rows last (trusted offsets)."""
    torch = pytest.importorskip("torch")
    _skip_unless_runs(strategy)
    E, M, N, K = 6, 700, 264, 392
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    ids_h = rng.integers(-1, E + 1, M).astype(np.int32)
    ids_h[ids_h == 2] = 0                                 # expert 2: no rows
    route = {}
    if strategy == "wgmma":
        ids_h = np.sort(np.where((ids_h >= 0) & (ids_h < E), ids_h, E)).astype(np.int32)
        offs = np.searchsorted(ids_h, np.arange(E + 1)).astype(np.int32)     # offsets[E] < M: padding after
        route = dict(offsets=torch.tensor(offs, device="cuda"), trusted_offsets=True)
    ids = torch.tensor(ids_h, device="cuda")
    route = route or dict(row_experts=ids)
    sku = REG.select(category="moe", op=op, element="bf16", backend=strategy, arch=90,
                     aux_element="f32" if op.endswith("weight") else None)
    shape = {"grouped_matmul": (M, N), "grouped_matmul_backward_input": (M, K),
             "grouped_matmul_backward_weight": (E, N, K)}[op]
    dt = torch.float32 if op.endswith("weight") else torch.bfloat16
    want = torch.zeros(shape, dtype=torch.float32, device="cuda")
    for e in range(E):
        r = ids == e
        if op == "grouped_matmul":
            want[r] = x[r].float() @ w[e].float().t()
        elif op == "grouped_matmul_backward_input":
            want[r] = dy[r].float() @ w[e].float()
        else:
            want[e] = dy[r].float().t() @ x[r].float()
    for name in checks_moe.variants_of(sku):
        outs = []
        with sf.moe.use_config(**{PASSES[op]: name}):
            for _ in range(2):
                o = torch.full(shape, float("nan"), dtype=dt, device="cuda")
                assert _run_pass(op, o, x, w, dy, strategy=strategy, **route) is o
                outs.append(o)
        assert torch.isfinite(outs[0]).all(), name
        err = ((outs[0].float() - want).norm() / want.norm()).item()
        assert err < 1e-2, (name, err)
        assert torch.equal(outs[0], outs[1]), name
        if op != "grouped_matmul_backward_weight":
            assert bool((outs[0][(ids < 0) | (ids >= E)] == 0).all()), name      # padding rows: exact zeros
        else:
            assert bool((outs[0][2] == 0).all()), name                           # no rows: exact zeros


def _run_pass(op, o, x, w, dy, **kw):
    """One pass into ``o`` through out= (y, dx or dw: the backward with the other gradient off)."""
    if op == "grouped_matmul":
        return sf.grouped_matmul(x, w, out=o, **kw)
    if op == "grouped_matmul_backward_input":
        return sf.grouped_matmul_backward(x, w, dy, need_weight=False, out=(o, None), **kw)[0]
    return sf.grouped_matmul_backward(x, w, dy, need_input=False, dw_dtype=o.dtype, out=(None, o), **kw)[1]


def _torch_problem(rng, E, M, N, K, dtype, sorted_rows=True, empty=()):
    import torch
    counts = rng.multinomial(M, np.ones(E) / E)
    for e in empty:
        counts[(e + 1) % E] += counts[e]
        counts[e] = 0
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(E, N, K, device="cuda", dtype=dtype) / K ** 0.5
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    return x, w, dy, torch.tensor(offsets, device="cuda"), counts


@pytest.mark.parametrize("strategy", ["mma", "simt", "wgmma", "auto"])
def test_against_torch_grouped_mm(strategy, rng):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    _skip_unless_runs(strategy)
    E, M, N, K = 8, 1000, 256, 384
    x, w, dy, offs, _ = _torch_problem(rng, E, M, N, K, torch.bfloat16, empty=(3,))
    ends = offs[1:].contiguous()
    y = sf.grouped_matmul(x, w, offsets=offs, strategy=strategy)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    y_t = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    dx, dw = sf.grouped_matmul_backward(x, w, dy, offsets=offs, strategy=strategy)
    dx_t = torch._grouped_mm(dy, w, offs=ends)
    dw_t = torch._grouped_mm(dy.t(), x, offs=ends)
    for got, theirs in ((y, y_t), (dx, dx_t), (dw, dw_t)):
        assert ref.rel_error(got.float().cpu().numpy(), theirs.float().cpu().numpy()) < 1e-2
    assert dw.dtype == torch.float32
    assert torch.all(dw[3] == 0)   # expert without rows: exact zeros
    if strategy == "auto":         # bf16, offsets routing, aligned: wgmma on an H100 / H200
        cc = torch.cuda.get_device_capability()
        want = "wgmma" if cc == (9, 0) else "mma"
        assert sf.moe.select_plan("grouped_matmul", x, w, offsets=offs).sku.backend == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_against_per_expert_mm_loop(dtype, rng):
    """Unsorted row_experts with padding ids, forward and both gradients vs torch.mm per expert."""
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    E, M, N, K = 5, 777, 136, 200
    x = torch.randn(M, K, device="cuda", dtype=dt)
    w = torch.randn(E, N, K, device="cuda", dtype=dt) / K ** 0.5
    dy = torch.randn(M, N, device="cuda", dtype=dt)
    ids = torch.tensor(rng.integers(-1, E + 1, M), device="cuda", dtype=torch.int32)
    y = sf.grouped_matmul(x, w, row_experts=ids)
    dx, dw = sf.grouped_matmul_backward(x, w, dy, row_experts=ids)
    y_l, dx_l, dw_l = torch.zeros(M, N, device="cuda"), torch.zeros(M, K, device="cuda"), torch.zeros(E, N, K, device="cuda")
    for e in range(E):
        rows = torch.nonzero(ids == e).flatten()
        xe, dye = x[rows].double(), dy[rows].double()
        y_l[rows] = (xe @ w[e].double().t()).float()
        dx_l[rows] = (dye @ w[e].double()).float()
        dw_l[e] = (dye.t() @ xe).float()
    tol = ref.TOLERANCE[{"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]]
    for got, want in ((y, y_l), (dx, dx_l), (dw, dw_l)):
        assert ref.rel_error(got.float().cpu().numpy(), want.cpu().numpy()) <= tol
    pad = (ids < 0) | (ids >= E)
    assert torch.all(y[pad] == 0) and torch.all(dx[pad] == 0)


def _clear_pending():
    """Wait for the device and drop what earlier tests' kernels reported (runtime/status.py)."""
    try:
        sf.check()
    except sf.DeviceValueError:
        pass


@pytest.mark.parametrize("strategy", ["mma", "simt", "wgmma"])
def test_invalid_offsets_give_nan_and_trusted_stays_in_bounds(strategy):
    """Invalid offsets: every output element NaN, no exception from the call itself; the routing
    kernel reports them to the status word, so the next call (or runtime.check()) raises
    DeviceValueError naming the pass that routed and ``offsets``. trusted_offsets=True: clamped,
    finite, nothing reported."""
    import cupy as cp
    _skip_unless_runs(strategy)
    E, M, N, K = 4, 64, 32, 32
    x = cp.random.standard_normal((M, K), dtype=cp.float32).astype(cp.float16)
    w = cp.random.standard_normal((E, N, K), dtype=cp.float32).astype(cp.float16)
    dy = cp.random.standard_normal((M, N), dtype=cp.float32).astype(cp.float16)
    good = cp.asarray(np.array([0, 16, 32, 48, 64], np.int64))
    _clear_pending()
    for bad in ([0, 10, 5, 30, 64], [1, 10, 20, 30, 64], [0, 10, 20, 30, 63], [0, 10, 20, 30, 1 << 30],
                [-5, 10, 20, 30, 64]):
        offs = cp.asarray(np.array(bad, np.int64))
        y = sf.grouped_matmul(x, w, offsets=offs, strategy=strategy)
        cp.cuda.Device().synchronize()
        assert bool(cp.all(cp.isnan(y))), bad
        with pytest.raises(sf.DeviceValueError) as ei:           # the next call on the device
            sf.grouped_matmul(x, w, offsets=good, strategy=strategy)
        assert (ei.value.op, ei.value.arg) == ("grouped_matmul", "offsets"), bad
        assert "grouped_matmul" in str(ei.value) and "offsets" in str(ei.value)
        dx, dw = sf.grouped_matmul_backward(x, w, dy, offsets=offs, strategy=strategy)
        for out in (dx, dw):
            assert bool(cp.all(cp.isnan(out))), bad
        with pytest.raises(sf.DeviceValueError) as ei:           # the explicit check point
            sf.check()
        assert (ei.value.op, ei.value.arg) == ("grouped_matmul_backward_input", "offsets"), bad
        _, dw = sf.grouped_matmul_backward(x, w, dy, offsets=offs, strategy=strategy, need_input=False)
        assert bool(cp.all(cp.isnan(dw))), bad
        with pytest.raises(sf.DeviceValueError) as ei:
            sf.check()
        assert (ei.value.op, ei.value.arg) == ("grouped_matmul_backward_weight", "offsets"), bad
        with pytest.raises(sf.InvalidProblemError, match="offsets"):
            sf.moe.validate_offsets(offs, M, E)
        y = sf.grouped_matmul(x, w, offsets=offs, strategy=strategy, trusted_offsets=True)
        assert bool(cp.all(cp.isfinite(y))), bad
        _, dw = sf.grouped_matmul_backward(x, w, dy, offsets=offs, strategy=strategy, need_input=False,
                                           trusted_offsets=True)
        assert bool(cp.all(cp.isfinite(dw))), bad
        sf.check()                                               # trusted: nothing reported
    y = sf.grouped_matmul(x, w, offsets=good, strategy=strategy)  # valid offsets run normally
    sf.check()
    assert bool(cp.all(cp.isfinite(y)))


def test_invalid_offsets_sync_checks_raise_at_the_call():
    """runtime.sync_checks(): the offsets are validated on the host before the launch."""
    import cupy as cp
    E, M, N, K = 2, 32, 16, 16
    x = cp.ones((M, K), cp.float32)
    w = cp.ones((E, N, K), cp.float32)
    _clear_pending()
    with sf.sync_checks():
        with pytest.raises(sf.InvalidProblemError, match="offsets"):
            sf.grouped_matmul(x, w, offsets=cp.asarray(np.array([0, 20, 10], np.int64)))
        y = sf.grouped_matmul(x, w, offsets=cp.asarray(np.array([0, 20, 32], np.int64)))
    sf.check()
    assert bool(cp.all(y == K))


@pytest.mark.parametrize("routing", ["offsets", "row_experts"])
def test_default_calls_do_not_synchronize(routing):
    """Offsets are validated on the device and row_experts need no check: no host sync."""
    torch = pytest.importorskip("torch")
    E, M, N, K = 4, 128, 64, 64
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    if routing == "offsets":
        kw = dict(offsets=torch.tensor([0, 10, 60, 60, M], device="cuda", dtype=torch.int64))
    else:
        kw = dict(row_experts=torch.randint(-1, E + 1, (M,), device="cuda", dtype=torch.int32))
    sf.grouped_matmul(x, w, **kw)                     # warm: compile and module load may sync
    sf.grouped_matmul_backward(x, w, dy, **kw)
    _clear_pending()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = sf.grouped_matmul(x, w, **kw)
        dx, dw = sf.grouped_matmul_backward(x, w, dy, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sf.check()
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(dx).all()) and bool(torch.isfinite(dw).all())


def test_backward_is_deterministic(rng):
    """Skewed, unsorted routing with long reductions: three runs, identical bits."""
    import cupy as cp
    E, M, N, K = 16, 20000, 64, 128
    x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
    w = cp.asarray(rng.standard_normal((E, N, K)).astype(np.float16))
    dy = cp.asarray(rng.standard_normal((M, N)).astype(np.float16))
    p = 1.0 / (np.arange(E) + 1.0) ** 2
    ids = cp.asarray(rng.choice(E, size=M, p=p / p.sum()).astype(np.int32))
    order = cp.asarray(np.argsort(ids.get(), kind="stable"))
    offs = cp.asarray(np.searchsorted(np.sort(ids.get()), np.arange(E + 1)).astype(np.int64))
    for strategy in ("mma", "simt") + (("wgmma",) if _sm90() else ()):
        if strategy == "wgmma":      # rows sorted by expert (offsets routing)
            xs, dys = x[order], dy[order]
            runs = [sf.grouped_matmul_backward(xs, w, dys, offsets=offs, strategy=strategy) for _ in range(3)]
        else:
            runs = [sf.grouped_matmul_backward(x, w, dy, row_experts=ids, strategy=strategy) for _ in range(3)]
        for dx, dw in runs[1:]:
            assert bool(cp.all(dx.view(cp.uint16) == runs[0][0].view(cp.uint16)))
            assert bool(cp.all(dw.view(cp.uint32) == runs[0][1].view(cp.uint32)))


def test_cupy_in_cupy_out_and_empty(rng):
    import cupy as cp
    x = cp.asarray(rng.standard_normal((0, 16)).astype(np.float32))
    w = cp.asarray(rng.standard_normal((3, 8, 16)).astype(np.float32))
    y = sf.grouped_matmul(x, w, offsets=cp.zeros(4, cp.int32))
    assert isinstance(y, cp.ndarray) and y.shape == (0, 8)
    dx, dw = sf.grouped_matmul_backward(x, w, cp.zeros((0, 8), cp.float32), row_experts=cp.zeros(0, cp.int32))
    assert dx.shape == (0, 16) and dw.shape == (3, 8, 16) and bool(cp.all(dw == 0))


def test_plan_shows_the_chosen_sku():
    import cupy as cp
    x = cp.ones((32, 64), cp.float16)
    w = cp.ones((2, 16, 64), cp.float16)
    ids = cp.zeros(32, cp.int32)
    assert sf.moe.select_plan("grouped_matmul", x, w, row_experts=ids).sku.backend == "mma"
    assert sf.moe.select_plan("grouped_matmul", x[:, :60], w[:, :, :60], row_experts=ids).sku.backend == "simt"
    plan = sf.moe.select_plan("grouped_matmul_backward_weight", x, w, cp.ones((32, 16), cp.float16), row_experts=ids)
    assert plan.sku.aux_element == "f32" and "deterministic" in plan.precision_guarantee


def test_torch_non_default_stream(rng):
    torch = pytest.importorskip("torch")
    E, M, N, K = 4, 4096, 512, 512
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, E, (M,), device="cuda", dtype=torch.int32)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x2 = x * 2           # queued on the side stream: routing and product must follow it
        y = sf.grouped_matmul(x2, w, row_experts=ids)
    s.synchronize()
    want = ref.grouped_matmul(checks.to_host(x2), checks.to_host(w), row_experts=ids.cpu().numpy())
    assert ref.rel_error(y.float().cpu().numpy(), want) < 1e-2


@pytest.mark.slow
def test_more_than_2_pow_31_elements(rng):
    """x with 2.15e9 elements (64-bit offsets end to end); rows checked at both ends."""
    import cupy as cp
    M, K, N, E = 2**19 + 3, 4104, 16, 4
    x = cp.empty((M, K), cp.float16)
    x[:] = cp.asarray(rng.standard_normal(K).astype(np.float16))[None, :]
    tail = rng.standard_normal((5, K)).astype(np.float16)
    x[-5:] = cp.asarray(tail)
    w = cp.asarray((rng.standard_normal((E, N, K)) / 64).astype(np.float16))
    ids_h = rng.integers(-1, E, M).astype(np.int32)
    ids = cp.asarray(ids_h)
    for strategy in ("mma", "simt"):
        y = sf.grouped_matmul(x, w, row_experts=ids, strategy=strategy)
        got = y[-5:].get()
        want = ref.grouped_matmul(tail, w.get(), row_experts=ids_h[-5:])
        assert ref.rel_error(got, want) < 1e-2, strategy
        head = y[:3].get()
        assert ref.rel_error(head, ref.grouped_matmul(x[:3].get(), w.get(), row_experts=ids_h[:3])) < 1e-2
        del y
    del x
    cp.get_default_memory_pool().free_all_blocks()


# -- the replay of repeated calls and out= (runtime/replay.py; CPU twins in tests/moe/test_moe_replay.py) --
def _hits(monkeypatch):
    from runtime import replay
    hits = []
    count_replays(monkeypatch, hits.append)
    replay.CACHE.clear()
    return hits


def _moe_data(fw, dtype, routing, rng, E=8, M=256, N=512, K=512, seed_ids=None):
    """x, w, dy and the routing keyword of one problem in framework ``fw`` (new arrays each call);
    ``dtype="half"``: bfloat16 for torch, float16 for CuPy."""
    if dtype == "half":
        dtype = "bfloat16" if fw == "torch" else "float16"
    if routing == "offsets":
        counts = rng.multinomial(M, np.ones(E) / E)
        counts[2] += counts[5]
        counts[5] = 0                                            # an expert without rows
        r = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    else:
        r = rng.integers(-1, E + 1, M).astype(np.int32)          # unsorted, padding ids
    host = [rng.standard_normal(s).astype(np.float32) for s in ((M, K), (E, N, K), (M, N))]
    host[1] /= K ** 0.5
    if fw == "torch":
        import torch
        dt = getattr(torch, dtype)
        arrs = [torch.tensor(h, device="cuda").to(dt) for h in host]
        rt = torch.tensor(r, device="cuda")
    else:
        import cupy as cp
        arrs = [cp.asarray(h.astype(dtype)) for h in host]
        rt = cp.asarray(r)
    return (*arrs, {routing: rt})


def _same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if type(a).__module__.startswith("torch"):
        import torch
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    import cupy as cp
    return a.dtype == b.dtype and a.shape == b.shape and bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8)))


BACKWARD_NEEDS = [(True, True), (True, False), (False, True)]


@pytest.mark.parametrize("fw", ["torch", "cupy"])
@pytest.mark.parametrize("routing", ["row_experts", "offsets"])
@pytest.mark.parametrize("dtype", ["half", "float32"])
def test_replay_equals_the_full_path_bit_for_bit(fw, routing, dtype, rng, monkeypatch):
    """A repeated call on new data (same layouts) replays the remembered launches; its results equal
    the full path's on that data bit for bit: forward and every backward combination."""
    if fw == "torch":
        pytest.importorskip("torch")
    from runtime import replay
    _clear_pending()
    hits = _hits(monkeypatch)
    calls = [("fwd", lambda x, w, dy, kw: sf.grouped_matmul(x, w, **kw))]
    for ni, nw in BACKWARD_NEEDS:
        calls.append((f"bwd {ni} {nw}", lambda x, w, dy, kw, ni=ni, nw=nw:
                      sf.grouped_matmul_backward(x, w, dy, need_input=ni, need_weight=nw, **kw)))
    for name, call in calls:
        replay.CACHE.clear()
        del hits[:]
        call(*_moe_data(fw, dtype, routing, rng))                # remembered
        x, w, dy, kw = _moe_data(fw, dtype, routing, rng)        # new data, same layouts
        fast = call(x, w, dy, kw)
        assert hits == [True], (name, hits)
        replay.CACHE.clear()
        slow = call(x, w, dy, kw)
        assert hits == [True], name
        fast = fast if isinstance(fast, tuple) else (fast,)
        slow = slow if isinstance(slow, tuple) else (slow,)
        for a, b in zip(fast, slow):
            assert _same_bits(a, b), name
    sf.check()


@pytest.mark.parametrize("fw", ["torch", "cupy"])
@pytest.mark.parametrize("routing", ["row_experts", "offsets"])
def test_out_equals_the_allocating_call(fw, routing, rng, monkeypatch):
    """out= (and workspace=) results equal the allocating call's bit for bit, are the given arrays,
    and a repeated call with both replays."""
    if fw == "torch":
        pytest.importorskip("torch")
    _clear_pending()
    hits = _hits(monkeypatch)
    x, w, dy, kw = _moe_data(fw, "half", routing, rng)
    half = "bfloat16" if fw == "torch" else "float16"
    M, K = x.shape
    E, N, _ = w.shape
    size = sf.moe.grouped_matmul_workspace_size(M, E, routing)
    if fw == "torch":
        import torch

        def new(shape, dt):
            return torch.full(shape, float("nan"), device="cuda", dtype=getattr(torch, dt))
        ws = torch.empty(size, device="cuda", dtype=torch.uint8)
    else:
        import cupy as cp

        def new(shape, dt):
            return cp.full(shape, np.nan, dtype=dt)
        ws = cp.empty(size, cp.uint8)
    y_want = sf.grouped_matmul(x, w, **kw)
    dx_want, dw_want = sf.grouped_matmul_backward(x, w, dy, **kw)
    _, dw16_want = sf.grouped_matmul_backward(x, w, dy, need_input=False, dw_dtype=half, **kw)
    for extra in ({}, {"workspace": ws}):
        for _ in range(2):                                       # the second call replays
            y = new((M, N), half)
            assert sf.grouped_matmul(x, w, out=y, **kw, **extra) is y
            assert _same_bits(y, y_want)
            dx, dw = new((M, K), half), new((E, N, K), "float32")
            got = sf.grouped_matmul_backward(x, w, dy, out=(dx, dw), **kw, **extra)
            assert got[0] is dx and got[1] is dw
            assert _same_bits(dx, dx_want) and _same_bits(dw, dw_want)
            dw16 = new((E, N, K), half)
            got = sf.grouped_matmul_backward(x, w, dy, need_input=False, dw_dtype=half, out=(None, dw16),
                                             **kw, **extra)
            assert got[0] is None and got[1] is dw16
            assert _same_bits(dw16, dw16_want)
    assert hits.count(True) >= 6, hits
    sf.check()
