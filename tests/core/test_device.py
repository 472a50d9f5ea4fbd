"""The driver seam (runtime/device.py): one current driver, swapped by ``device.use``, reaching every
caller; per-driver state; the caches forgotten on a swap. On the GPU: tests/core/test_gpu_device.py."""
import struct
import subprocess
import sys
import threading

import pytest

import runtime as sf
from runtime import config, device, graphs, replay, status, tma
from runtime.quantization import fused
from tests.fakes import D, FakeDevice


def test_importing_the_runtime_makes_no_driver_and_needs_no_cuda():
    """No driver is made, and no CUDA library touched, by ``import runtime``; the real driver is made
    (still without a CUDA call) when first asked for."""
    code = ("import sys; sys.modules['cupy'] = sys.modules['cuda'] = None\n"
            "import runtime, runtime.torch\n"
            "from runtime import device\n"
            "assert device._cuda is None and device._current is None\n"
            "assert type(device.driver()) is device.CudaDriver and device.driver() is device.driver()\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_use_swaps_the_driver_of_every_thread_and_restores_the_previous_one():
    outer = device.driver()
    a, b = FakeDevice(), FakeDevice()
    seen = []
    with device.use(a):
        with device.use(b):
            t = threading.Thread(target=lambda: seen.append(device.driver()))
            t.start()
            t.join()
            assert device.driver() is b
        assert device.driver() is a
    assert device.driver() is outer and seen == [b]


def test_every_caller_reaches_the_driver_in_place():
    """Properties, arch, loaded kernels, streams, pointers and allocations all come from the driver
    ``use`` put in place: no caller holds on to another one."""
    fake = FakeDevice(props={0: {"cc": 89, "sms": 7}}, device_of=lambda p: 3, streams={3: 42})
    with device.use(fake):
        assert sf.quantization.lowbit.preference(0).arch == 89 and device.properties(0)["sms"] == 7
        assert device.compile_arch(0) == 89
        fn = sf.default_registry().kernel(sf.default_registry().skus()[0], 0)
        assert fn in fake.functions.values()
        ref = sf.arrays.as_array(D((4,), ptr=0x7F0000000000), "x")
        assert ref.device == 3 and sf.arrays.stream_handle(ref) == 42
        out = sf.arrays.empty(ref, (2, 3), "f16")
        assert fake.allocs == [((2, 3), "f16")] and out.shape == (2, 3)


def test_the_status_words_are_the_drivers():
    a, b = FakeDevice(), FakeDevice()
    with device.use(a):
        pa = status.pointer(0)
        status.words().words[0] = status.code("quantize", "scale")
        with device.use(b):
            assert status.pointer(0) != pa and status.words().words[0] == 0
            status.raise_pending(0)                          # b's word: nothing to report
        assert status.pointer(0) == pa and status.words().used == {0}
        with pytest.raises(sf.DeviceValueError, match="cuda:0"):
            status.raise_pending(0)                          # a's report, kept while b was in place


def test_graph_counts_are_the_drivers():
    with device.use(FakeDevice()):
        graphs.fixed().count = 5
        with device.use(FakeDevice()):
            assert graphs.fixed().count == 0
        assert graphs.fixed().count == 5


def test_a_swap_and_a_settings_change_forget_the_remembered_caches():
    """What was worked out from a driver or the settings (the remembered calls, the fused launches,
    the tensor maps, a cache made by CACHES.new()) is forgotten when either changes."""
    mine = config.CACHES.new()
    for forget in (lambda: device.use(FakeDevice()), lambda: config.override(schedule="")):
        for cache in (replay.CACHE, fused._LAUNCHES, tma._ENCODERS, mine):
            cache["k"] = 1
        with forget():
            assert not (replay.CACHE or fused._LAUNCHES or tma._ENCODERS or mine)
            mine["k"] = 1
        assert not mine


def test_a_fake_device_records_launches_through_the_runtimes_own_launch_path():
    """The fake replaces the driver calls only: a bound launch packs its values (a value that does not
    fit its format raises as it would on a GPU) and the kernel runs in its device's context."""
    fake = FakeDevice(check_alignment=False)            # "k" is no entry point of the manifest
    with device.use(fake):
        fn = fake.load_function(None, "u", "k", 1)
        go = device.bind_launch(fn, (2,), (32,), "Qi")
        go(9, (0x1000, 3))
        assert fake.launches == [(fn, (2,), (32,), "Qi", (0x1000, 3))]
        assert [(c.fn, c.stream, c.ctx) for c in fake.log] == [(fn, 9, 0xC1)] and fake.pushes == 1
        assert fake.stack() == [0xC0]
        with pytest.raises(struct.error):
            go(9, (0x1000, 2 ** 40))                        # an i32 parameter
        assert len(fake.launches) == 1


def test_token_quantize_launches_one_kernel(fake_device):
    """The example of docs/testing.md."""
    fake_device.props[0] = {"sms": 66}                  # what differs from the H200-like default
    x, scale = fake_device.a((8, 64), "float16"), fake_device.a((8,))
    q = sf.quantize(x, scale, scope="token")            # q: an array the fake device allocated
    (kernel, grid, block, fmt, values), = fake_device.launches
    assert "quantize_token" in kernel and values[-1] == sf.status.pointer(0)
    assert fake_device.allocs == [((8, 64), "s8")] and q.shape == (8, 64)
    assert fake_device.log[0].ctx == 0xC0              # launched with cuda:0's context current
