"""GPU: a replayed call (the replay of repeated calls) gives the same bits as the full path.

Every functional API with a replay runs on fresh arrays of a layout it has seen (the
replay), then again on the same arrays with the cache cleared (the full path); the results
must be identical, for CuPy and torch, aligned and misaligned (scalar path) inputs, device and
Python-scalar parameters. CPU tests of the slot bookkeeping: tests/core/test_replay.py.
"""
import numpy as np
import pytest

import runtime as sf
from codegen.harness.checks import base as checks
from runtime import replay
from tests.fakes import count_replays

pytestmark = pytest.mark.gpu


def _host(r):
    return tuple(None if a is None else checks.to_host(a) for a in r) if isinstance(r, tuple) else checks.to_host(r)


def _data(rng, fw, shape, offset):
    """A float32 array of ``shape`` starting ``offset`` elements into a larger buffer."""
    n = int(np.prod(shape))
    base = checks.to_device((rng.standard_normal(n + offset) * 4).astype(np.float32), fw)
    return base[offset:offset + n].reshape(shape)


def _p(rng, fw, shape, lo=0.05):
    return checks.to_device((rng.random(shape) + lo).astype(np.float32), fw)


CASES = {
    "quantize token": lambda r, fw, x: sf.quantize(x, _p(r, fw, (x.shape[0],)), scope="token"),
    "quantize tensor scalar": lambda r, fw, x: sf.quantize(x, float(r.random() + 0.1), int(r.integers(-5, 5)),
                                                           scope="tensor"),
    "dequantize channel": lambda r, fw, x: sf.dequantize(
        sf.quantize(x, 0.1, scope="tensor"), _p(r, fw, (x.shape[1],)), scope="channel", axis=1,
        out_dtype="float32"),
    "quantize_backward group": lambda r, fw, x: sf.quantize_backward(
        x * 2, x, _p(r, fw, (x.shape[0], x.shape[1] // 64), 0.01), scope="group", group_size=64),
    "dequantize_backward token": lambda r, fw, x: sf.dequantize_backward(x, _p(r, fw, (x.shape[0],)),
                                                                         scope="token"),
    "fake_quantize channel mask": lambda r, fw, x: sf.fake_quantize(x, _p(r, fw, (x.shape[0],), 0.01), scope="channel",
                                                                    axis=0, return_mask=True),
    "fake_quantize tensor scalar": lambda r, fw, x: sf.fake_quantize(x, float(r.random() + 0.01), 3, scope="tensor",
                                                                     qmin=0, qmax=255),
    "fake_quantize_backward token": lambda r, fw, x: sf.fake_quantize_backward(x + 1, x, _p(r, fw, (x.shape[0],), 0.01),
                                                                               scope="token"),
    "lsq channel": lambda r, fw, x: sf.fake_quantize_learnable_backward(
        x + 1, x, _p(r, fw, (x.shape[1],), 0.01), checks.to_device(np.zeros(x.shape[1], np.int32), fw),
        scope="channel", axis=1),
    "lsq tensor scalar": lambda r, fw, x: sf.fake_quantize_learnable_backward(x + 1, x, 0.05, scope="tensor"),
    "dynamic token": lambda r, fw, x: sf.dynamic_quantize(x, scope="token"),
    "dynamic group asymmetric": lambda r, fw, x: sf.dynamic_quantize(x, scope="group", group_size=128,
                                                                     mode="asymmetric", out_dtype="uint8"),
    "dynamic tensor": lambda r, fw, x: sf.dynamic_quantize(x, scope="tensor"),
    "dynamic channel": lambda r, fw, x: sf.dynamic_quantize(x, scope="channel", axis=1),
    # out=: nothing allocated (but the per-tensor / per-channel workspace); fresh out arrays per call
    "dynamic token out": lambda r, fw, x: sf.dynamic_quantize(
        x, scope="token", out=(_zeros(fw, x.shape, np.int8), _zeros(fw, (x.shape[0],), np.float32))),
    "dynamic group out asymmetric": lambda r, fw, x: sf.dynamic_quantize(
        x, scope="group", group_size=128, mode="asymmetric", out_dtype="uint8",
        out=(_zeros(fw, x.shape, np.uint8), _zeros(fw, (x.shape[0], x.shape[1] // 128), np.float32),
             _zeros(fw, (x.shape[0], x.shape[1] // 128), np.int32))),
    "dynamic tensor out asymmetric": lambda r, fw, x: sf.dynamic_quantize(
        x, scope="tensor", mode="asymmetric", out=(_zeros(fw, x.shape, np.int8), _zeros(fw, (), np.float32),
                                                   _zeros(fw, (), np.int32))),
    "dynamic channel out": lambda r, fw, x: sf.dynamic_quantize(
        x, scope="channel", axis=1, out=(_zeros(fw, x.shape, np.int8), _zeros(fw, (x.shape[1],), np.float32))),
}


def _zeros(fw, shape, dtype):
    """Zeros of ``shape`` (0-d included) made by the framework itself."""
    if fw == "torch":
        import torch
        return torch.zeros(shape, dtype=getattr(torch, np.dtype(dtype).name), device="cuda")
    import cupy as cp
    return cp.zeros(shape, dtype)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_replay_gives_the_full_path_bits(name, fw, offset, rng, monkeypatch):
    if fw == "torch":
        pytest.importorskip("torch")
    hits = []
    count_replays(monkeypatch, hits.append)
    call, shape = CASES[name], (48, 512)
    seed = int(rng.integers(2**31))
    replay.CACHE.clear()
    call(np.random.default_rng(seed), fw, _data(rng, fw, shape, offset))     # remembered
    assert replay.CACHE and not hits
    x = _data(rng, fw, shape, offset)
    fast = _host(call(np.random.default_rng(seed + 1), fw, x))               # replayed
    assert any(hits), "the repeated call took the replay"
    replay.CACHE.clear()
    slow = _host(call(np.random.default_rng(seed + 1), fw, x))               # full path
    fast, slow = (fast, slow) if isinstance(fast, tuple) else ((fast,), (slow,))
    assert len(fast) == len(slow)
    for f, s in zip(fast, slow):
        assert (f is None) == (s is None)
        if f is not None:
            np.testing.assert_array_equal(np.atleast_1d(f).view(np.uint8), np.atleast_1d(s).view(np.uint8))


def _cycle_call(name, r, fw, x):
    """A zero-argument call of ``name`` on ``x``, its other arguments made once."""
    if name == "quantize token":
        s = _p(r, fw, (x.shape[0],))
        return lambda: sf.quantize(x, s, scope="token")
    if name == "lsq channel":
        dy, s, z = x + 1, _p(r, fw, (x.shape[1],), 0.01), checks.to_device(np.zeros(x.shape[1], np.int32), fw)
        return lambda: sf.fake_quantize_learnable_backward(dy, x, s, z, scope="channel", axis=1)
    return lambda: sf.dynamic_quantize(x, scope="group", group_size=128, mode="asymmetric", out_dtype="uint8")


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("name", ["quantize token", "lsq channel", "dynamic group asymmetric"])
def test_replays_cycling_through_addresses_give_the_full_path_bits(name, fw, rng, monkeypatch):
    """Three inputs in turn (a loop of layers on their own activations), the results dropped: each
    input's set of parameter values comes back, gets an executable graph of its own
    (runtime/graphs.py), and from the third round on a replay instantiates and sets nothing. Then
    the last three results kept alive (the outputs move too). Every result equals the full path's."""
    if fw == "torch":
        pytest.importorskip("torch")
    from collections import deque

    from runtime import device, graphs
    hits, made, sets = [], [], []
    count_replays(monkeypatch, hits.append)
    fns = device.driver().graph_calls()
    setp = fns["cuGraphExecKernelNodeSetParams_v2"]
    monkeypatch.setitem(fns, "cuGraphExecKernelNodeSetParams_v2", lambda *a: sets.append(1) or setp(*a))
    instantiate = graphs._Graph.instantiate
    monkeypatch.setattr(graphs._Graph, "instantiate", lambda g: made.append(1) or instantiate(g))
    replay.CACHE.clear()
    calls = [_cycle_call(name, rng, fw, _data(rng, fw, (48, 512), 0)) for _ in range(3)]
    got = []
    for turn in range(4):
        if turn == 3:
            settled = len(made), len(sets)
        got += [(i, _host(c())) for i, c in enumerate(calls)]
    assert sum(hits) >= 10, "the repeated calls took the replay"
    assert len(made) >= 2 and (len(made), len(sets)) == settled, "the last round set nothing"
    ring = deque(maxlen=3)
    for _ in range(3):
        for i, c in enumerate(calls):
            ring.append(c())
            got.append((i, _host(ring[-1])))
    replay.CACHE.clear()
    want = [_host(c()) for c in calls]                                       # full path
    for i, g in got:
        g, w = (g, want[i]) if isinstance(g, tuple) else ((g,), (want[i],))
        for f, s in zip(g, w):
            assert (f is None) == (s is None)
            if f is not None:
                np.testing.assert_array_equal(np.atleast_1d(f).view(np.uint8), np.atleast_1d(s).view(np.uint8))


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("scope,kw,pshape", [("token", {}, (48,)), ("group", {"group_size": 128}, (48, 4)),
                                             ("tensor", {}, ()), ("channel", {"axis": 0}, (48,))])
def test_dynamic_out_is_written_and_returned(fw, scope, kw, pshape, rng):
    """dynamic_quantize(out=...) returns the given arrays, holding the bits of an allocating call,
    on the full path and on a replay; a replay whose q overlaps x is refused like the full path."""
    if fw == "torch":
        pytest.importorskip("torch")
    replay.CACHE.clear()
    for _ in range(2):                                        # remembered, then replayed
        x = _data(rng, fw, (48, 512), 0)
        out = (_zeros(fw, (48, 512), np.int8), _zeros(fw, pshape, np.float32))
        got = sf.dynamic_quantize(x, scope=scope, out=out, **kw)
        assert got[0] is out[0] and got[1] is out[1] and got[2] is None
        want = sf.dynamic_quantize(x, scope=scope, **kw)
        for g, w in zip(got[:2], want[:2]):
            np.testing.assert_array_equal(np.atleast_1d(checks.to_host(g)).view(np.uint8),
                                          np.atleast_1d(checks.to_host(w)).view(np.uint8))
    # one buffer holding x, then q right after it (apart), then q inside x (same layout: a replay)
    buf = _zeros(fw, (48 * 512 * 4 * 2,), np.uint8)
    xs = buf[:48 * 512 * 4].view(np.float32 if fw == "cupy" else _torch_dtype("float32")).reshape(48, 512)
    xs[:] = _data(rng, fw, (48, 512), 0)
    apart = buf[48 * 512 * 4:48 * 512 * 5].view(np.int8 if fw == "cupy" else _torch_dtype("int8")).reshape(48, 512)
    inside = buf[48 * 512:48 * 512 * 2].view(np.int8 if fw == "cupy" else _torch_dtype("int8")).reshape(48, 512)
    replay.CACHE.clear()
    sf.dynamic_quantize(xs, scope=scope, out=(apart, _zeros(fw, pshape, np.float32)), **kw)
    with pytest.raises(sf.InvalidProblemError, match="overlaps x"):
        sf.dynamic_quantize(xs, scope=scope, out=(inside, _zeros(fw, pshape, np.float32)), **kw)


def _torch_dtype(name):
    import torch
    return getattr(torch, name)
