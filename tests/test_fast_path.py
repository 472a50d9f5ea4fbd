"""The repeated-call fast path's bookkeeping (CPU): which parameter slot each argument refills.

A wrong slot launches a kernel on stale pointers (a bug of this kind was caught on the GPU);
these tests pin the slot logic without a device by describing fake arrays and recording the
values a prepared launch would receive.
"""
import numpy as np
import pytest

import runtime as sf
from runtime import quantization as qz
from runtime.launch import PreparedLaunch
from tests.fakes import FakeDeviceArray as D


class Recorder(PreparedLaunch):
    def launch(self, stream, values=None):
        self.calls.append(list(self.values if values is None else values))


@pytest.fixture
def fake_describe(monkeypatch):
    def describe(obj):
        if obj is None:
            return ("none",), 0
        if type(obj) in (float, int):
            return (type(obj),), obj
        cai = getattr(obj, "__cuda_array_interface__", None)
        if cai is None:
            return None, None        # as the real one does for types it does not know
        p = cai["data"][0]
        return (D, cai["shape"], cai["strides"], cai["typestr"], 0, p & 15), p
    monkeypatch.setattr(qz, "_describe", describe)
    monkeypatch.setattr(qz, "x_stream", lambda sig, ptr: 0)
    qz._FAST.clear()
    yield
    qz._FAST.clear()


def remembered(op, x, scale, zp, out, static=("token", None, None, "int8", None, None)):
    call = qz._FastCall(op, x, scale, zp, out, static)
    assert call.key is not None and not call.hit()
    rec = Recorder(fn=None, grid=(1,), block=(1,), fmt="", values=list(range(100, 121)))
    rec.calls = []
    call.remember(rec, sf.arrays.as_array(x, "x"), "s8", -128, 127)
    return rec


def test_device_scale_refills_the_pointer_slot(fake_describe):
    x, s, out = D((8, 64), ptr=0x1000), D((8,), ptr=0x2000), D((8, 64), "int8", ptr=0x3000)
    rec = remembered("quantize", x, s, None, out)
    with sf.trusted():
        call = qz._FastCall("quantize", D((8, 64), ptr=0x5000), D((8,), ptr=0x6000), None,
                            D((8, 64), "int8", ptr=0x7000), ("token", None, None, "int8", None, None))
        assert call.hit()
    v = rec.calls[-1]
    assert (v[0], v[2], v[4]) == (0x5000, 0x7000, 0x6000)
    assert v[5] == 105 and v[6] == 106 and v[7] == 107      # scalar scale / zp slots untouched


def test_scalar_scale_and_zero_point_refill_value_slots(fake_describe):
    static = ("tensor", None, None, "int8", None, None)
    x, out = D((8, 64), ptr=0x1000), D((8, 64), "int8", ptr=0x3000)
    rec = remembered("quantize", x, 0.5, 3, out, static)
    call = qz._FastCall("quantize", x, 0.25, -7, out, static)
    assert call.hit()
    v = rec.calls[-1]
    assert (v[4], v[5], v[6], v[7]) == (104, 0.25, 106, -7)
    # bad scalars never take the fast path (the slow path raises the typed error)
    assert not qz._FastCall("quantize", x, -1.0, 3, out, static).hit()
    assert not qz._FastCall("quantize", x, float("inf"), 3, out, static).hit()
    assert not qz._FastCall("quantize", x, 0.5, 300, out, static).hit()


def test_device_zero_point_refills_its_pointer_slot(fake_describe):
    x, s, z, out = D((8, 64), ptr=0x1000), D((8,), ptr=0x2000), D((8,), "int32", ptr=0x2800), D((8, 64), "int8", ptr=0x3000)
    rec = remembered("quantize", x, s, z, out)
    with sf.trusted():
        assert qz._FastCall("quantize", x, s, D((8,), "int32", ptr=0x9000), out,
                            ("token", None, None, "int8", None, None)).hit()
    assert rec.calls[-1][6] == 0x9000 and rec.calls[-1][7] == 107


def test_device_parameters_need_trusted_mode(fake_describe):
    x, s, out = D((8, 64), ptr=0x1000), D((8,), ptr=0x2000), D((8, 64), "int8", ptr=0x3000)
    remembered("quantize", x, s, None, out)
    assert not qz._FastCall("quantize", x, s, None, out, ("token", None, None, "int8", None, None)).hit()


def test_any_difference_in_layout_misses(fake_describe):
    x, s, out = D((8, 64), ptr=0x1000), D((8,), ptr=0x2000), D((8, 64), "int8", ptr=0x3000)
    remembered("quantize", x, s, None, out)
    static = ("token", None, None, "int8", None, None)
    with sf.trusted():
        assert not qz._FastCall("quantize", D((8, 64), ptr=0x1004), s, None, out, static).hit()   # alignment
        assert not qz._FastCall("quantize", D((8, 32)), D((8,)), None, D((8, 32), "int8"), static).hit()
        assert not qz._FastCall("quantize", x, s, None, out, ("token", None, None, "uint8", None, None)).hit()
        assert not qz._FastCall("dequantize", x, s, None, out, static).hit()
        assert not qz._FastCall("quantize", np.zeros((8, 64), np.float32), s, None, out, static).hit()
