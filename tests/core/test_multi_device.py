"""Several devices, on the CPU: a fake CUDA driver (a current context per thread, push / pop) and
fake device arrays whose addresses say which device they live on.

Arrays on cuda:1 must run on device 1 while device 0 is current: every launch of every op (slow
path and replay) happens with device 1's context current and on device 1's current stream, the
status word read and passed is device 1's, and the caller's current context is unchanged after
the call. Arguments on different devices raise :class:`DeviceMismatchError` naming each argument
and its device, in the functional API and in the torch ops' fake implementations.
The same on real GPUs: tests/core/test_gpu_multi.py.
"""
import ctypes
import itertools
import threading
from types import SimpleNamespace

import pytest

import runtime as sf
from runtime import cuda_driver, device, replay, status
from runtime.errors import DeviceMismatchError, InvalidProblemError, SkuforgeError
from tests.fakes import CTX, FakeDevice, FakeDeviceArray, FakeFunction, count_replays, err
from tests.core.test_replay import CALLS as FAST_CALLS
from tests.moe.test_moe_replay import CALLS as MOE_CALLS

DEVICE1 = 0x7F8000000000            # fake arrays at or above this address live on cuda:1
STREAM = {0: 100, 1: 101}           # each device's current stream


def device_of_pointer(p: int) -> int:
    return 1 if p >= DEVICE1 else 0


@pytest.fixture
def multi(monkeypatch):
    """Two fake devices (tests/fakes.py): the runtime's launches (bound, cooperative, memset) over
    recorded driver calls, which refuse a kernel whose context is not current; kernels loaded per
    device; per-device streams; arrays on cuda:1 at addresses >= DEVICE1."""
    fake = FakeDevice(device_of=device_of_pointer, streams=STREAM)
    with device.use(fake):
        count_replays(monkeypatch, lambda hit: setattr(fake, "hits", fake.hits + hit))
        yield fake


def ran(fake) -> list:
    """(kernel, current context, stream) of every driver call the fake device logged."""
    return [(c.fn, c.ctx, c.stream) for c in fake.log]


def _call(multi, call, base):
    multi.at(base)
    multi.log, multi.launches = [], []
    hits = multi.hits
    call(multi)
    return ran(multi), multi.hits - hits


ALL_CALLS = {**{k: v[0] for k, v in FAST_CALLS.items()}, **{"moe " + k: v[0] for k, v in MOE_CALLS.items()}}


@pytest.mark.parametrize("name", list(ALL_CALLS))
def test_every_op_on_device_1_launches_there_while_device_0_is_current(multi, name):
    """Full path, then a replay: every launch (and the cooperative kernel's memset) with device 1's
    context current and on device 1's stream; the status word passed is device 1's; device 0's
    context is current again after each call."""
    call = ALL_CALLS[name]
    for base, replayed in ((DEVICE1, 0), (DEVICE1 + 0x40000000000, 1)):
        launches, hits = _call(multi, call, base)
        assert hits == replayed
        assert launches
        assert all((ctx, stream) == (CTX[1], STREAM[1]) for _, ctx, stream in launches), launches
        assert multi.stack() == [CTX[0]]
        params = [launch[4] for launch in multi.launches if launch[0] != "memset"]
        assert len(params) == len([c for c in multi.log if c.fn != "memset"]), "every launch's parameters are seen"
        words = [v for values in params for v in values if isinstance(v, int) and status.is_status_pointer(v)]
        assert all(w == status.pointer(1) for w in words), (name, words)


def test_one_layout_on_two_devices_is_two_replay_entries(multi):
    call = ALL_CALLS["quantize token"]
    launches0, hits = _call(multi, call, 0x7F0000000000)
    assert hits == 0 and {(c, s) for _, c, s in launches0} == {(CTX[0], STREAM[0])}
    assert multi.pushes == 0, "the kernel's context was current: nothing pushed"
    launches1, hits = _call(multi, call, DEVICE1)
    assert hits == 0, "the same shapes on another device are another call (the device is in the key)"
    assert {(c, s) for _, c, s in launches1} == {(CTX[1], STREAM[1])}
    assert len(replay.CACHE) == 2
    for base, d in ((0x7F2000000000, 0), (DEVICE1 + 0x1000000000, 1)):
        launches, hits = _call(multi, call, base)
        assert hits == 1 and {(c, s) for _, c, s in launches} == {(CTX[d], STREAM[d])}


def test_the_current_context_is_left_alone_when_it_is_the_kernels(multi):
    multi.set_current(CTX[1])
    launches, _ = _call(multi, ALL_CALLS["moe fwd row_experts mma"], DEVICE1)
    assert len(launches) == 4 and multi.pushes == 0
    assert multi.stack() == [CTX[1]]


def test_one_context_launches_without_asking_for_the_current_one(multi):
    """With kernels of one device loaded, a launch goes straight to the driver (no cuCtxGetCurrent);
    where the kernel's context is not current the driver's refusal is answered by one launch with it
    pushed, and nothing is launched in a wrong context."""
    call = ALL_CALLS["quantize token"]
    for base in (0x7F0000000000, 0x7F2000000000):           # full path, then a replay
        launches, _ = _call(multi, call, base)
        assert launches and {c for _, c, _ in launches} == {CTX[0]}
    assert not multi.several and multi.pushes == 0 and not multi.asked
    multi.set_current(0)                              # no context current: refused, retried
    launches, hits = _call(multi, call, 0x7F4000000000)
    assert hits == 1 and {c for _, c, _ in launches} == {CTX[0]} and multi.pushes == 1
    assert multi.stack() == []
    multi.set_current(CTX[0])
    _call(multi, call, DEVICE1)                              # a second device's kernels: now compared
    assert multi.several and multi.asked


def test_a_thread_without_a_current_context(multi):
    """A new thread has no current context until something makes one current: the launch makes
    the kernel's current for itself and leaves none current."""
    out = {}

    def run():
        multi.set_current(0)
        out["launches"], _ = _call(multi, ALL_CALLS["dequantize group"], DEVICE1)
        out["after"] = multi.stack()[:]
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["launches"] and {(c, s) for _, c, s in out["launches"]} == {(CTX[1], STREAM[1])}
    assert out["after"] == []
    assert multi.stack() == [CTX[0]], "the main thread's context is its own"


def test_a_failed_launch_restores_the_context(multi):
    multi.refuse = 700                                               # CUDA_ERROR_ILLEGAL_ADDRESS
    err(lambda: ALL_CALLS["quantize token"](multi.at(DEVICE1)), SkuforgeError, "cuLaunchKernel failed", "700")
    assert multi.stack() == [CTX[0]]


def test_the_status_word_of_the_arrays_device_is_read(multi):
    call = ALL_CALLS["moe fwd offsets i32 mma"]
    _call(multi, call, DEVICE1)                                      # the full path; remembered
    words = status.words().words
    words[0] = status.code("quantize", "scale")                     # a report of device 0: not this call's
    launches, hits = _call(multi, call, DEVICE1 + 0x1000000000)
    assert hits == 1 and launches and words[0]
    words[1] = status.code("grouped_matmul", "offsets")
    with pytest.raises(sf.DeviceValueError) as e:
        _call(multi, call, DEVICE1 + 0x2000000000)                   # a replay reads device 1's word
    assert (e.value.device, e.value.op, e.value.arg) == (1, "grouped_matmul", "offsets")
    assert not words[1] and words[0]
    replay.CACHE.clear()
    words[1] = status.code("grouped_matmul", "offsets")
    with pytest.raises(sf.DeviceValueError) as e:
        _call(multi, call, DEVICE1 + 0x3000000000)                   # so does the full path
    assert e.value.device == 1 and words[0]
    with pytest.raises(sf.DeviceValueError) as e:
        _call(multi, call, 0x7F0000000000)                           # a call on device 0 reads its own
    assert (e.value.device, e.value.op) == (0, "quantize")


def test_on_context_of_unknown_kernels_changes_nothing(multi):
    with multi.on_context_of("a symbol"):
        assert multi.stack() == [CTX[0]]
    fn = FakeFunction("k", 1)
    multi.note_context(fn.ptr, CTX[1])
    with multi.on_context_of(fn):
        assert multi.stack() == [CTX[0], CTX[1]]
    assert multi.stack() == [CTX[0]]
    with pytest.raises(RuntimeError):
        with multi.on_context_of(fn):
            raise RuntimeError("inside")
    assert multi.stack() == [CTX[0]]


class Loading(device.CudaDriver):
    """The real driver's loading over a fake device's contexts (and arch and primary contexts)."""

    def __init__(self, fake):
        super().__init__()
        self.fake = fake

    def context_current(self):
        return self.fake.context_current()

    def context_push(self, ctx):
        return self.fake.context_push(ctx)

    def context_pop(self):
        return self.fake.context_pop()

    def compile_arch(self, d):
        return 90

    def primary_context(self, d):
        return CTX[d]


def test_load_function_loads_in_the_devices_primary_context(multi, monkeypatch):
    """A module per (registry, unit, device), loaded (and its functions looked up) with that device's
    primary context current, whatever the thread has current; launched in that context."""
    class Module:
        def load(self, cubin):
            self.ctx = multi.context_current()

        def get_function(self, symbol):
            f = FakeFunction(symbol, None)
            f.module, f.looked_up_in = self, multi.context_current()
            return f

    class Reg:
        root = "/fake"
        units = {"u": {"nvrtc_options": (), "skus": ()}}

        def unit_source(self, unit):
            return "src"

    # below the driver: CuPy's module loading and the compile cache
    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(function=SimpleNamespace(Module=Module)))
    monkeypatch.setattr(cuda_driver, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(cuda_driver, "compile_cached", lambda *a, **k: SimpleNamespace(cubin=b""))
    for current in (CTX[0], 0):                     # cuda:0 current, then a thread with none
        multi.set_current(current)
        drv = Loading(multi)
        f0 = drv.load_function(Reg(), "u", "k", 0)
        f1 = drv.load_function(Reg(), "u", "k", 1)
        assert f0 is not f1 and (f0.module.ctx, f1.module.ctx) == (CTX[0], CTX[1])
        assert (f0.looked_up_in, f1.looked_up_in) == (CTX[0], CTX[1])
        assert drv.context_of(f0) == CTX[0] and drv.context_of(f1) == CTX[1] and drv.several
        assert drv.load_function(Reg(), "u", "k", 1) is f1
        assert multi.stack() == ([current] if current else [])


def test_context_calls_through_ctypes():
    """The ctypes path of the context calls: cuCtxGetCurrent writes the context into a per-thread
    slot; push takes the handle; pop writes the popped handle into the slot's second word."""
    seen = []

    class Fn:
        def __init__(self, name):
            self.name = name

        def __call__(self, arg):
            seen.append((self.name, arg))
            if self.name == "cuCtxGetCurrent":
                ctypes.c_void_p.from_address(arg).value = 0xC1
            return 0

    class Lib:
        def __getattr__(self, name):
            f = Fn(name)
            setattr(self, name, f)
            return f

    class Ctypes(device.CudaDriver):
        def libcuda(self):
            return Lib()
    drv = Ctypes()
    assert drv.context_current() == 0xC1
    assert drv.context_push(0xC0) == 0 and drv.context_pop() == 0
    assert [n for n, _ in seen] == ["cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"]
    assert seen[1][1] == 0xC0 and seen[2][1] == seen[0][1] + ctypes.sizeof(ctypes.c_void_p)


# -- arguments on different devices: a typed error naming them ---------------------------------
_addresses = itertools.count(1)


def A(shape, dtype="float32", on=0):
    """A fake array on cuda:``on`` (each at its own address)."""
    return FakeDeviceArray(shape, dtype, ptr=(DEVICE1 if on else 0x7F0000000000) + 0x100000 * next(_addresses))

H = "float16"
MIXED = {
    "quantize scale": (lambda: sf.quantize(A((8, 64)), A((8,), on=1), scope="token"), ("x", "scale")),
    "quantize zero_point": (lambda: sf.quantize(A((8, 64)), A((8,)), A((8,), "int32", on=1), scope="token"),
                            ("x", "zero_point")),
    "quantize out": (lambda: sf.quantize(A((8, 64)), 0.5, scope="tensor", out=A((8, 64), "int8", on=1)),
                     ("x", "out")),
    "dequantize scale": (lambda: sf.dequantize(A((8, 64), "int8", on=1), A((8,)), scope="token"), ("q", "scale")),
    "dynamic_quantize out": (lambda: sf.dynamic_quantize(A((8, 64)), scope="token",
                                                         out=(A((8, 64), "int8"), A((8,), on=1))),
                             ("x", "out[1] (scale)")),
    "quantize_backward x": (lambda: sf.quantize_backward(A((8, 64)), A((8, 64), on=1), A((8,)), scope="token"),
                            ("dy", "x")),
    "dequantize_backward out": (lambda: sf.dequantize_backward(A((8, 64)), 0.5, scope="tensor",
                                                               out=A((8, 64), on=1)), ("dy", "out")),
    "fake_quantize scale": (lambda: sf.fake_quantize(A((8, 64), on=1), A((64,)), scope="channel", axis=1),
                            ("x", "scale")),
    "fake_quantize_backward_from_mask mask": (lambda: sf.fake_quantize_backward_from_mask(
        A((8, 64)), A((8, 8), "uint8", on=1)), ("dy", "mask")),
    "fake_quantize_backward_from_mask out": (lambda: sf.fake_quantize_backward_from_mask(
        A((8, 64)), A((8, 8), "uint8"), out=A((8, 64), on=1)), ("dy", "out")),
    "fake_quantize_backward dy": (lambda: sf.fake_quantize_backward(A((8, 64), on=1), A((8, 64)), 0.5, 0,
                                                                    scope="tensor"), ("dy", "x")),
    "lsq scale": (lambda: sf.fake_quantize_learnable_backward(A((8, 64)), A((8, 64)), A((8,), on=1),
                                                             scope="token"), ("x", "scale")),
    "grouped_matmul w": (lambda: sf.grouped_matmul(A((16, 64), H), A((4, 32, 64), H, on=1),
                                                   row_experts=A((16,), "int32")), ("x", "w", "row_experts")),
    "grouped_matmul offsets": (lambda: sf.grouped_matmul(A((16, 64), H), A((4, 32, 64), H),
                                                         offsets=A((5,), "int32", on=1)), ("x", "offsets")),
    "grouped_matmul out": (lambda: sf.grouped_matmul(A((16, 64), H), A((4, 32, 64), H), offsets=A((5,), "int32"),
                                                     out=A((16, 32), H, on=1)), ("x", "out")),
    "grouped_matmul workspace": (lambda: sf.grouped_matmul(
        A((16, 64), H), A((4, 32, 64), H), offsets=A((5,), "int32"),
        workspace=A((sf.moe.grouped_matmul_workspace_size(16, 4, "offsets"),), "uint8", on=1)), ("x", "workspace")),
    "grouped_matmul_backward dy": (lambda: sf.grouped_matmul_backward(A((16, 64), H), A((4, 32, 64), H),
                                                                      A((16, 32), H, on=1), offsets=A((5,), "int32")),
                                   ("x", "dy")),
    "grouped_matmul_backward out": (lambda: sf.grouped_matmul_backward(
        A((16, 64), H), A((4, 32, 64), H), A((16, 32), H), offsets=A((5,), "int32"),
        out=(A((16, 64), H), A((4, 32, 64), on=1))), ("x", "out[1] (dw)")),
}


@pytest.mark.parametrize("name", list(MIXED))
def test_arguments_on_different_devices_are_a_typed_error(multi, name):
    call, named = MIXED[name]
    with pytest.raises(DeviceMismatchError) as e:
        call()
    assert isinstance(e.value, InvalidProblemError)
    msg = str(e.value)
    assert "different devices" in msg and "cuda:0" in msg and "cuda:1" in msg, msg
    for arg in named:
        assert f"{arg} on cuda:" in msg, msg
    assert set(e.value.devices.values()) == {"cuda:0", "cuda:1"}
    assert set(named) <= set(e.value.devices)


def test_torch_fakes_name_the_arguments_on_different_devices():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    import runtime.torch  # noqa: F401  (registers the ops)
    sk = torch.ops.skuforge
    with FakeTensorMode():
        x = torch.empty(16, 64, device="cuda:0", dtype=torch.bfloat16)
        cases = [
            (lambda: sk.quantize(x, torch.empty(16, device="cuda:1"), None, "token"), {"x", "scale"}),
            (lambda: sk.grouped_matmul(x, torch.empty(4, 32, 64, device="cuda:1", dtype=torch.bfloat16),
                                       torch.zeros(16, dtype=torch.int32, device="cuda:0")),
             {"x", "w", "row_experts"}),
            (lambda: sk.quantize.out(x.float(), torch.empty(16, device="cuda:0"), None, "token",
                                     out=torch.empty(16, 64, dtype=torch.int8, device="cuda:1")), {"x", "out"}),
        ]
        for call, named in cases:
            with pytest.raises(DeviceMismatchError) as e:
                call()
            assert set(e.value.devices) == named and set(e.value.devices.values()) == {"cuda:0", "cuda:1"}


def test_status_words_exist_for_64_devices(fake_device):
    assert status.pointer(63) == status.words().base + 4 * 63
    err(lambda: status.pointer(64), sf.UnsupportedError, "cuda:64", "0 to 63")
    status.raise_pending(64)                    # nothing to report for a device without a word


def test_check_visits_the_devices_launched_on(multi):
    """``runtime.check()`` visits the devices whose status word a launch was given, no other (a
    synchronization of an unused device would create its context)."""
    _call(multi, ALL_CALLS["moe fwd offsets i32 mma"], DEVICE1)
    w = status.words()
    assert w.used == {1}
    w.words[0] = status.code("quantize", "scale")                  # never visited: no launch on cuda:0
    sf.check(synchronize=False)
    w.words[1] = status.code("grouped_matmul", "offsets")
    with pytest.raises(sf.DeviceValueError) as e:
        sf.check()
    assert e.value.device == 1 and multi.synced == [1]


def test_a_prepared_launch_goes_to_the_driver(fake_device):
    """``PreparedLaunch.launch`` binds through the driver's ``bind_launch`` and calls its cuLaunchKernel
    with its grid, block, shared memory, stream and packed parameters (the binding a replay uses is
    the runtime's own; only the driver call is the fake's)."""
    from runtime.launch import PreparedLaunch
    prep = PreparedLaunch(SimpleNamespace(ptr=0x1234), (3,), (128, 2), SimpleNamespace(fmt="Qi"), [0xDEAD00, 7], 256)
    prep.launch(99)
    prep.launch(98, [0xBEEF00, 8])
    assert [(c.fn, *c.grid, *c.block, c.smem, c.stream) for c in fake_device.log] == \
        [(0x1234, 3, 1, 1, 128, 2, 1, 256, 99), (0x1234, 3, 1, 1, 128, 2, 1, 256, 98)]
    assert [v for *_, v in fake_device.launches] == [(0xDEAD00, 7), (0xBEEF00, 8)]
    fake_device.refuse = 700                                         # bound from now on: a sticky error
    prep = PreparedLaunch(SimpleNamespace(ptr=0x1234), (3,), (128, 2), SimpleNamespace(fmt="Qi"), [0xDEAD00, 7])
    err(lambda: prep.launch(99), SkuforgeError, "cuLaunchKernel failed", "700")
