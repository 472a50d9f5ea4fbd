"""Every bad input of the static family gets a typed error before any launch (CPU)."""
import contextlib

import numpy as np
import pytest

import runtime as sf
from runtime import InvalidProblemError, UnsupportedError, device
from tests.fakes import FakeDeviceArray as D
from tests.fakes import err
from tests.core.test_replay import dev  # noqa: F401  (a fixture of mdev)
from tests.moe.test_moe_replay import mdev  # noqa: F401  (a fixture)


X = D((8, 64), "float32")


def test_wrong_input_dtype():
    err(lambda: sf.quantize(D((8, 64), "int32"), 0.1, scope="tensor"), UnsupportedError, "x", "i32", "bf16")
    err(lambda: sf.dequantize(D((8, 64), "float32"), 0.1, scope="tensor"), UnsupportedError, "q", "s8, u8")


def test_wrong_output_dtype():
    err(lambda: sf.quantize(X, 0.1, scope="tensor", out_dtype="int16"), InvalidProblemError, "out_dtype")
    err(lambda: sf.quantize(D((8, 63), "float32"), 0.1, scope="tensor", out_dtype="int4"), InvalidProblemError,
        "D=63", "even")
    err(lambda: sf.dequantize(D((8, 64), "int8"), 0.1, scope="tensor", out_dtype="int8"), UnsupportedError,
        "out_dtype")


def test_host_arrays_and_scalars():
    err(lambda: sf.quantize(np.zeros((2, 2), np.float32), 0.1, scope="tensor"), InvalidProblemError,
        "host array", "cupy.asarray")
    err(lambda: sf.quantize(X, 0.1, scope="token"), InvalidProblemError, "scalar", "(8,)")
    err(lambda: sf.quantize(X, D((8,)), 3, scope="token"), InvalidProblemError, "zero_point", "scalar")
    err(lambda: sf.quantize(X, np.ones(8, np.float32), scope="token"), InvalidProblemError, "scale", "host array")
    err(lambda: sf.quantize(3.0, 0.1, scope="tensor"), InvalidProblemError, "x", "scalar")


def test_scale_shape_and_dtype():
    err(lambda: sf.quantize(X, D((7,)), scope="token"), InvalidProblemError, "scale", "(7,)", "(8,)")
    err(lambda: sf.quantize(X, D((8, 2)), scope="group", group_size=16), InvalidProblemError, "(8, 4)")
    err(lambda: sf.quantize(X, D((64,)), scope="channel", axis=0), InvalidProblemError, "(8,)")
    err(lambda: sf.quantize(X, D((8,), "float64"), scope="token"), InvalidProblemError, "float32")
    err(lambda: sf.quantize(D((8, 64), "float64"), D((8,)), scope="token"), InvalidProblemError, "float64")
    err(lambda: sf.quantize(X, D((8, 4), strides=(1, 8)), scope="group", group_size=16), InvalidProblemError,
        "C-contiguous")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_non_positive_or_non_finite_scalar_scale(bad):
    err(lambda: sf.quantize(X, bad, scope="tensor"), InvalidProblemError, "scale", "positive and finite")


def test_zero_point_range_and_dtype():
    err(lambda: sf.quantize(X, 0.1, 200, scope="tensor"), InvalidProblemError, "zero_point=200", "[-128, 127]")
    err(lambda: sf.quantize(X, 0.1, -1, scope="tensor", out_dtype="uint8"), InvalidProblemError, "[0, 255]")
    err(lambda: sf.quantize(X, 0.1, 5, scope="tensor", qmin=10, qmax=20), InvalidProblemError, "[10, 20]")
    err(lambda: sf.quantize(X, D((8,)), D((8,), "int64"), scope="token"), InvalidProblemError, "int32")


def test_scope_arguments():
    err(lambda: sf.quantize(X, D((8, 3)), scope="group", group_size=3), InvalidProblemError,
        "group_size=3", "D=64")
    err(lambda: sf.quantize(X, D((8,)), scope="group"), InvalidProblemError, "group_size is required")
    err(lambda: sf.quantize(X, 0.1, scope="tensor", group_size=4), InvalidProblemError, "only meaningful")
    err(lambda: sf.quantize(X, D((8,)), scope="channel"), InvalidProblemError, "axis is required")
    err(lambda: sf.quantize(X, D((8,)), scope="channel", axis=2), InvalidProblemError, "axis=2")
    err(lambda: sf.quantize(X, 0.1, scope="row"), UnsupportedError, "scope='row'", "tensor, channel")


def test_qmin_qmax():
    err(lambda: sf.quantize(X, 0.1, scope="tensor", qmin=5, qmax=5), InvalidProblemError, "qmin=5", "< qmax")
    err(lambda: sf.quantize(X, 0.1, scope="tensor", qmin=-200), InvalidProblemError, "qmin=-200")
    err(lambda: sf.quantize(X, 0.1, scope="tensor", qmax=1.5), InvalidProblemError, "qmax=1.5", "integer")


def test_layouts():
    err(lambda: sf.quantize(D((8, 64), strides=(1, 8)), 0.1, scope="tensor"), InvalidProblemError,
        "non-contiguous last axis")
    # rows that do not collapse into one stride: (4, 8, 64) with a gap between the 8-row blocks...
    ok_rows = D((4, 8, 64), strides=(8 * 80, 80, 1))        # ...is fine when evenly spaced
    bad_rows = D((4, 8, 64), strides=(1000, 80, 1))
    err(lambda: sf.quantize(bad_rows, 0.1, scope="tensor"), InvalidProblemError, "collapse")
    err(lambda: sf.quantize(D((8, 64), strides=(32, 1)), 0.1, scope="tensor"), InvalidProblemError, "overlapping")
    assert sf.scopes.rows_view(sf.arrays.as_array(ok_rows, "x"), "x").row_stride == 80
    err(lambda: sf.quantize(D(()), 0.1, scope="tensor"), InvalidProblemError, "0-d")
    err(lambda: sf.quantize(D((1,) * 9), 0.1, scope="tensor"), InvalidProblemError, "rank 9")


def test_out_argument():
    err(lambda: sf.quantize(X, 0.1, scope="tensor", out=D((8, 64), "uint8")), InvalidProblemError,
        "out", "s8")
    err(lambda: sf.quantize(X, 0.1, scope="tensor", out=D((8, 32), "int8")), InvalidProblemError, "(8, 64)")


def test_mixed_devices(fake_device):
    fake_device.device_of = lambda ptr: 1 if ptr == 0x1000 else 0
    err(lambda: sf.quantize(X, D((8,), ptr=0x1000), scope="token"), InvalidProblemError, "different devices")


def test_unknown_dtype_spelling():
    err(lambda: sf.quantize(X, 0.1, scope="tensor", out_dtype="int7"), InvalidProblemError, "int7")


def test_scale_dtype_must_match_the_data():
    # scales are in the math precision; "float32" (the default spelling) means that precision
    err(lambda: sf.quantize(X, 0.1, scope="tensor", scale_dtype="float64"), UnsupportedError,
        "scale_dtype", "float32")
    err(lambda: sf.quantize(X, 0.1, scope="tensor", scale_dtype="nonsense"), InvalidProblemError, "nonsense")
    err(lambda: sf.dequantize(D((8, 64), "int8"), 0.1, scope="tensor", out_dtype="float64", scale_dtype="float16"),
        UnsupportedError, "float64")


class _Cai:
    """An object with a hand-written __cuda_array_interface__."""

    def __init__(self, **cai):
        self.__cuda_array_interface__ = cai


def test_pointers_are_checked_for_null_and_alignment():
    err(lambda: sf.quantize(D((8, 64), ptr=0), 0.5, scope="tensor"), InvalidProblemError, "x", "null")
    err(lambda: sf.quantize(D((8, 64), ptr=0x7F0000000001), 0.5, scope="tensor"), InvalidProblemError,
        "x", "aligned", "4 bytes")
    err(lambda: sf.quantize(X, D((8,), ptr=0x7F0000000002), scope="token"), InvalidProblemError, "scale", "aligned")
    err(lambda: sf.grouped_matmul(D((8, 16), "float16"), D((2, 16, 16), "float16"),
                                  offsets=D((3,), "int64", ptr=0x7F0000000004)), InvalidProblemError,
        "offsets", "aligned")
    sf.arrays.as_array(D((0, 64), ptr=0), "x")                     # an empty array needs no pointer


def test_malformed_array_interfaces_are_typed_errors():
    good = dict(shape=(8, 64), typestr="<f4", data=(0x7F0000000000, False), version=3)
    for bad, words in ((dict(good, shape=(8.0, 64)), ("shape",)), (dict(good, shape=(-1, 64)), ("shape",)),
                       (dict(good, shape=(True, 64)), ("shape",)), (dict(good, shape="8x64"), ("shape",)),
                       (dict(good, shape=(2**70, 64)), ("shape", "2**62")),
                       (dict(good, strides=(256.0, 4)), ("strides",)), (dict(good, strides=(256, 4, 1)), ("strides", "one stride per axis")),
                       (dict(good, data=("0x1", False)), ("data",)), (dict(good, data=None), ("data",)),
                       (dict(good, typestr="<q9"), ("typestr",)),
                       ({k: v for k, v in good.items() if k != "shape"}, ("shape",))):
        err(lambda bad=bad: sf.quantize(_Cai(**bad), 0.5, scope="tensor"), InvalidProblemError, "x", *words)
    err(lambda: sf.arrays.as_array(_Cai(shape=(2**40, 2**40), typestr="<f4", data=(0x7F0000000000, False)), "x"),
        InvalidProblemError, "2**62")


def test_zero_d_inputs_need_a_feature_axis():
    for scope, kw in (("token", {}), ("group", dict(group_size=1))):
        err(lambda scope=scope, kw=kw: sf.quantize(D(()), D(()), scope=scope, **kw), InvalidProblemError, "0-d")
        err(lambda scope=scope, kw=kw: sf.dynamic_quantize(D(()), scope=scope, **kw), InvalidProblemError, "0-d")


def test_huge_python_numbers_are_typed_errors():
    err(lambda: sf.quantize(X, 10 ** 400, scope="tensor"), InvalidProblemError, "scale", "float")
    err(lambda: sf.quantize(D((8, 0)), D((8, 0)), scope="group", group_size=2 ** 70), InvalidProblemError,
        "group_size", "2**62")
    err(lambda: sf.quantize(X, 0.5, 2 ** 70, scope="tensor"), InvalidProblemError, "zero_point")
    err(lambda: sf.quantize(X, 0.5, scope="tensor", qmin=-(2 ** 70)), InvalidProblemError, "qmin")
    err(lambda: sf.quantize(X, 0.5, scope="channel", axis=2 ** 70), InvalidProblemError, "axis")


def test_numpy_scalar_types_are_dtype_spellings():
    import ml_dtypes
    from runtime import kinds
    assert [kinds.of(t) for t in (np.int8, np.uint8, np.float16, np.float32, np.float64, np.int32)] == \
        ["s8", "u8", "f16", "f32", "f64", "i32"]
    assert kinds.of(ml_dtypes.bfloat16) == "bf16" and kinds.of(ml_dtypes.float8_e4m3fn) == "fp8_e4m3"
    for t in (float, int, np.bool_, np.int16):           # Python's float is not float32 (nor float64)
        err(lambda t=t: kinds.of(t, "out_dtype"), InvalidProblemError, "out_dtype")


def test_empty_arrays_take_any_strides():
    """torch.empty(3, 0, 5) has strides (5, 5, 1), torch.empty(0, 0, 0) (1, 1, 1): nothing is read."""
    for shape, strides in (((3, 0, 5), (5, 5, 1)), ((0, 0, 0), (1, 1, 1)), ((2, 0, 4, 8), (1, 7, 3, 1))):
        view = sf.scopes.rows_view(sf.arrays.as_array(D(shape, strides=strides), "x"), "x")
        assert view.rows * view.cols == 0


def test_interfaces_that_would_be_misread_are_refused():
    good = dict(shape=(8, 64), typestr="<f4", data=(0x7F0000000000, False), version=3)
    for bad, words in ((dict(good, typestr=">f4"), ("byte order",)), (dict(good, typestr=None), ("typestr",)),
                       (dict(good, mask=_Cai(**good)), ("mask",))):
        err(lambda bad=bad: sf.quantize(_Cai(**bad), 0.5, scope="tensor"), InvalidProblemError, "x", *words)
    sf.arrays.as_array(_Cai(**dict(good, mask=None)), "x")             # no mask: fine
    read_only = _Cai(**dict(good, typestr="|i1", data=(0x7F0000100000, True)))
    err(lambda: sf.quantize(X, 0.5, scope="tensor", out=read_only), InvalidProblemError, "out", "read-only")
    assert sf.arrays.as_array(read_only, "x").readonly                 # as an input it is fine


def test_dynamic_quantize_fills_a_foreign_out_of_an_empty_x(fake_device):
    """An empty x has all-zero slices: the given scale (and zero point) arrays are filled; one with
    only __cuda_array_interface__ (no fill) by the driver (through a zero-copy CuPy view)."""
    q, s, z = D((0, 64), "int8"), D((0,), ptr=0x7F0000100000), D((0,), "int32", ptr=0x7F0000200000)
    x = D((0, 64), ptr=0x7F0000300000)
    assert sf.dynamic_quantize(x, scope="token", mode="asymmetric", out=(q, s, z)) == (q, s, z)
    assert [o for o, _ in fake_device.fills] == [s, z]


def test_bad_settings_are_typed_errors_naming_the_variable():
    from runtime import config
    from runtime.quantization import fused
    for env, words in (({"SKUFORGE_DISABLE_JIT": "maybe"}, ("SKUFORGE_DISABLE_JIT", "0, false, no, off")),
                       ({"SKUFORGE_LOCK_TIMEOUT": "abc"}, ("SKUFORGE_LOCK_TIMEOUT",)),
                       ({"SKUFORGE_LOCK_TIMEOUT": "-1"}, ("SKUFORGE_LOCK_TIMEOUT",)),
                       ({"SKUFORGE_GRAPH_REPLAY": "sometimes"}, ("SKUFORGE_GRAPH_REPLAY", "off"))):
        err(lambda env=env: config.from_environ(env), InvalidProblemError, *words)
    s = config.from_environ({"SKUFORGE_SYNC_CHECKS": "", "SKUFORGE_LOCK_TIMEOUT": "", "SKUFORGE_SCHEDULE": "b128"})
    assert (s.sync_checks, s.lock_timeout, s.schedule) == (False, 120.0, "b128")
    for text in ("t8,ch=abc", "t4,threads=", "t2,threads=1e3"):
        err(lambda text=text: fused.FusedConfig.parse(text), UnsupportedError, "SKUFORGE_DYNAMIC_CONFIG", text)


def test_one_flag_parser_for_every_boolean_variable():
    """``0`` is off and ``1`` on for every flag, the runtime's settings and the harness's / tests' own."""
    from runtime import config
    for text, want in (("0", False), ("false", False), ("OFF", False), ("no", False), ("1", True), ("True", True),
                       ("on", True), (" yes ", True), ("", False)):
        assert config.from_environ({"SKUFORGE_DISABLE_JIT": text}).disable_jit is want, text
        assert config.from_environ({"SKUFORGE_SYNC_CHECKS": text}).sync_checks is want, text
        assert config.env_flag("SKUFORGE_FULL_COMPILE", {"SKUFORGE_FULL_COMPILE": text}) is want, text
    err(lambda: config.env_flag("SKUFORGE_DIRTY", {"SKUFORGE_DIRTY": "2"}), InvalidProblemError, "SKUFORGE_DIRTY")
    assert config.env_int("SKUFORGE_SEED", {}) is None and config.env_int("SKUFORGE_SEED", {"SKUFORGE_SEED": "7"}) == 7
    err(lambda: config.env_int("SKUFORGE_SEED", {"SKUFORGE_SEED": "x"}), InvalidProblemError, "SKUFORGE_SEED")


def test_lsq_reference_of_an_empty_x():
    from runtime import reference as ref
    for scope, axis, gs, want in (("channel", 0, None, (0,)), ("channel", -1, None, (4,)), ("tensor", None, None, ()),
                                  ("token", None, None, (0,)), ("group", None, 2, (0, 2))):
        shape = (0, 4)
        _, ds, dz = ref.fake_quantize_learnable_backward(np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                                                         np.ones(want, np.float32), np.zeros(want, np.int32),
                                                         scope=scope, axis=axis, group_size=gs)
        assert ds.shape == want and dz.shape == want and not ds.any()


def test_plan_and_registry_arguments_are_typed_errors():
    reg = sf.default_registry()
    for bad in (None, 5, ["a"], b"quantization"):
        err(lambda bad=bad: sf.KernelSku.parse(bad), InvalidProblemError, "SKU")
        err(lambda bad=bad: reg.lookup(bad), InvalidProblemError, "SKU")
    err(lambda: reg.query(3), InvalidProblemError, "pattern")
    err(lambda: reg.select(category="quantization", op="quantize", element="f32", arch="90"), InvalidProblemError,
        "arch")
    for m, e, words in (("8", 4, ("M=",)), (None, 4, ("M=",)), (-1, 4, ("M=",)), (1.5, 4, ("M=",)),
                        (8, 0, ("E=",)), (8, 2.0, ("E=",)), (8, 2 ** 70, ("E=",))):
        err(lambda m=m, e=e: sf.moe.grouped_matmul_workspace_size(m, e), InvalidProblemError, *words)
    assert sf.moe.grouped_matmul_workspace_size(np.int64(8), 4) == sf.moe.grouped_matmul_workspace_size(8, 4)


# -- no usable driver ----------------------------------------------------------------------------------
@contextlib.contextmanager
def without_driver(monkeypatch):
    """``with without_driver(monkeypatch):`` every CUDA runtime call CuPy makes answers
    cudaErrorInsufficientDriver (a driver older than the runtime, or none): device scopes,
    allocations, DLPack imports, device queries, the status word's pinned allocation; the block runs
    on a new real driver (nothing asked of the device yet) whose launches are recorded (:class:`Launchless`)."""
    cupy = pytest.importorskip("cupy")
    rt = cupy.cuda.runtime

    def refuse(*args, **kw):
        raise rt.CUDARuntimeError(35)         # cudaErrorInsufficientDriver

    class Device:
        def __init__(self, *args):
            pass

        def __enter__(self):
            refuse()

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    for name in ("empty", "from_dlpack"):
        monkeypatch.setattr(cupy, name, refuse)
    for name in ("getDevice", "getDeviceCount", "getDeviceProperties", "hostAlloc", "pointerGetAttributes",
                 "deviceSynchronize"):
        monkeypatch.setattr(rt, name, refuse)
    with device.use(Launchless()) as drv:
        yield drv


class Launchless(device.CudaDriver):
    """The real driver with its launch calls recorded in ``launches`` (and refused: CUresult 35)
    instead of made: without a usable driver, no call may get that far."""

    def __init__(self):
        super().__init__()
        self.launches = []

    def launch_kernel(self, *args):
        self.launches.append(args)
        return 35

    cooperative_kernel = memset_d32 = launch_kernel


@pytest.fixture
def no_driver(monkeypatch):
    with without_driver(monkeypatch) as drv:
        yield drv
    assert not drv.launches


Y = D((8, 64), ptr=0x7F0000100000)
W = D((2, 16, 64), ptr=0x7F0000200000)
OFFS = D((3,), "int32", ptr=0x7F0000300000)
EVERY_OP = {
    "quantize": lambda: sf.quantize(X, 0.1, scope="tensor"),
    "dequantize": lambda: sf.dequantize(D((8, 64), "int8"), 0.1, scope="tensor"),
    "dynamic_quantize": lambda: sf.dynamic_quantize(X, scope="token"),
    "quantize_backward": lambda: sf.quantize_backward(X, Y, 0.1, scope="tensor"),
    "dequantize_backward": lambda: sf.dequantize_backward(X, 0.1, scope="tensor"),
    "fake_quantize": lambda: sf.fake_quantize(X, 0.1, scope="tensor"),
    "fake_quantize_backward": lambda: sf.fake_quantize_backward(X, Y, 0.1, scope="tensor"),
    "fake_quantize_learnable_backward": lambda: sf.fake_quantize_learnable_backward(X, Y, 0.1, scope="tensor"),
    "grouped_matmul": lambda: sf.grouped_matmul(X, W, offsets=OFFS),
    "grouped_matmul_backward": lambda: sf.grouped_matmul_backward(X, W, D((8, 16), ptr=0x7F0000400000),
                                                                  offsets=OFFS),
}


@pytest.mark.parametrize("op", sorted(EVERY_OP))
def test_every_op_without_a_driver_raises_device_required(no_driver, op):
    """The driver's error at the first allocation (or device query) is a DeviceRequiredError that says
    what happened, for every op."""
    err(EVERY_OP[op], sf.DeviceRequiredError, "no usable CUDA device", "cudaErrorInsufficientDriver")


def test_every_op_with_out_without_a_driver_raises_device_required(no_driver):
    """Given outputs, nothing is allocated: the status word's pinned allocation is the first touch."""
    err(lambda: sf.quantize(X, 0.1, scope="tensor", out=D((8, 64), "int8", ptr=0x7F0000500000)),
        sf.DeviceRequiredError, "cudaErrorInsufficientDriver")
    err(lambda: sf.status.pointer(0), sf.DeviceRequiredError, "cudaErrorInsufficientDriver")
    sf.check(0)                          # nothing launched, nothing to check: no device is touched


def test_which_errors_say_there_is_no_device():
    cupy = pytest.importorskip("cupy")
    from runtime.device import no_device
    rt = cupy.cuda.runtime
    for status in (35, 100, 3, 34, 46, 101, 803):
        assert isinstance(no_device(rt.CUDARuntimeError(status)), sf.DeviceRequiredError), status
    for e in (rt.CUDARuntimeError(700), rt.CUDARuntimeError(2), RuntimeError("out of memory"), TypeError("x")):
        assert no_device(e) is None, e        # an illegal address, out of memory, a bug: not "no device"
    for text in ("Found no NVIDIA driver on your system", "No CUDA GPUs are available",
                 "CuPy failed to load libcuda.so.1: OSError: ..."):
        assert "no usable CUDA device" in str(no_device(RuntimeError(text)))


# -- DLPack objects ------------------------------------------------------------------------------------
def test_a_cpu_dlpack_object_is_a_typed_error():
    from tests.fuzz_cases import BareDLPack, HostDLPack
    err(lambda: sf.quantize(HostDLPack(), 0.1, scope="tensor"), InvalidProblemError, "x",
        "a CUDA device array is required; got a CPU array", "kDLCPU")
    err(lambda: sf.quantize(X, D((8,)), scope="token", out=HostDLPack()), InvalidProblemError, "out", "CPU array")
    err(lambda: sf.quantize(BareDLPack(), 0.1, scope="tensor"), InvalidProblemError, "x", "DLPack")

    class Rocm(HostDLPack):
        def __dlpack_device__(self):
            return (10, 0)

    class Junk(HostDLPack):
        def __dlpack_device__(self):
            return "cuda"
    err(lambda: sf.quantize(Rocm(), 0.1, scope="tensor"), InvalidProblemError, "x", "kDLROCM")
    err(lambda: sf.quantize(Junk(), 0.1, scope="tensor"), InvalidProblemError, "x", "__dlpack_device__")


def test_a_cuda_dlpack_object_without_a_driver(no_driver):
    from tests.fuzz_cases import HostDLPack

    class Cuda(HostDLPack):
        def __dlpack_device__(self):
            return (2, 0)
    err(lambda: sf.quantize(Cuda(), 0.1, scope="tensor"), sf.DeviceRequiredError, "cudaErrorInsufficientDriver")


# -- Python numbers packed into kernel parameters --------------------------------------------------------
SCALE_OPS = {
    "quantize": lambda s: sf.quantize(X, s, scope="tensor"),
    "dequantize": lambda s: sf.dequantize(D((8, 64), "int8"), s, scope="tensor"),
    "quantize_backward": lambda s: sf.quantize_backward(X, Y, s, scope="tensor"),
    "dequantize_backward": lambda s: sf.dequantize_backward(X, s, scope="tensor"),
    "fake_quantize": lambda s: sf.fake_quantize(X, s, scope="tensor"),
    "fake_quantize_backward": lambda s: sf.fake_quantize_backward(X, Y, s, scope="tensor"),
    "fake_quantize_learnable_backward": lambda s: sf.fake_quantize_learnable_backward(X, Y, s, scope="tensor"),
}


@pytest.fixture
def no_allocation(fake_device):
    """Any allocation fails the test: these errors come before anything is allocated."""
    def allocated(*args):
        raise AssertionError("allocated before the error")
    fake_device.new = allocated


@pytest.mark.parametrize("op", sorted(SCALE_OPS))
@pytest.mark.parametrize("scale", [1e308, 3.5e38, 1e-46, 1e-300, 10 ** 400, -(10 ** 400), np.float64(1e39)])
def test_scalar_scales_outside_float32_are_refused_before_allocating(no_allocation, op, scale):
    err(lambda: SCALE_OPS[op](scale), InvalidProblemError, "scale=", "positive and finite", "float32",
        "1.1754944e-38", "3.4028235e+38")


def test_scalar_scales_take_float64_range_for_float64_data(no_allocation):
    from runtime.params import positive_scalar
    assert positive_scalar(1e308, "scale", "f64") == 1e308 and positive_scalar(1e-300, "scale", "f64") == 1e-300
    for bad in (1e-320, 10 ** 400, float("inf")):
        err(lambda bad=bad: sf.quantize(D((8, 64), "float64"), bad, scope="tensor"), InvalidProblemError,
            "scale=", "float64", "2.2250739e-308")


@pytest.mark.parametrize("eps", [10 ** 400, 1e308, 3.5e38, 1e-46, 1e-300, 0.0, -1.0, float("nan"), float("inf")])
def test_dynamic_quantize_eps_outside_the_math_range(no_allocation, eps):
    err(lambda: sf.dynamic_quantize(X, scope="token", eps=eps), InvalidProblemError, "eps=", "positive and finite",
        "float32")


def test_dynamic_quantize_eps_of_float64_data(no_allocation):
    err(lambda: sf.dynamic_quantize(D((8, 64), "float64"), scope="token", eps=10 ** 400), InvalidProblemError,
        "eps=", "float64", "1.7976931e+308")
    err(lambda: sf.dynamic_quantize(D((8, 64), "float64"), scope="token", eps="1e-8"), InvalidProblemError, "eps=")


@pytest.mark.parametrize("g", [10 ** 400, 1e39, 1e-46, float("nan"), "1", True])
def test_grad_factor_outside_the_math_range(no_allocation, g):
    err(lambda: sf.fake_quantize_learnable_backward(X, Y, 0.1, scope="tensor", grad_factor=g), InvalidProblemError,
        "grad_factor=")


def test_grad_factor_may_be_zero_or_negative():
    from runtime.params import real_scalar
    assert real_scalar(0, "grad_factor", "f32") == 0.0 and real_scalar(-2.5, "grad_factor", "f32") == -2.5
    assert real_scalar(1e300, "grad_factor", "f64") == 1e300


def test_configuration_set_in_code_is_checked(mdev):
    from runtime.quantization import lowbit
    from runtime import moe
    for bad in ("80", None, 8.9, True):
        err(lambda bad=bad: lowbit.prefer_arch(bad).__enter__(), InvalidProblemError, "prefer_arch", "80")
    err(lambda: moe.use_config(3).__enter__(), InvalidProblemError, "use_config(3)")
    with moe.use_config(fwd=["128x128x32s5"]):
        err(lambda: sf.grouped_matmul(mdev.a((64, 64), "float16"), mdev.a((2, 64, 64), "float16"),
                                      offsets=mdev.a((3,), "int32")),
            InvalidProblemError, "tile configuration", "not a configuration name")
    assert not moe.CONFIG


# -- on a GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_dlpack_objects(rng):
    """A CUDA array behind DLPack alone runs (zero-copy, results as CuPy arrays); CPU ones are refused."""
    import cupy as cp
    from runtime import reference
    from tests.fuzz_cases import BareDLPack, HostDLPack

    class CudaDLPack:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()
    x = rng.standard_normal((33, 64)).astype(np.float32)
    q = sf.quantize(CudaDLPack(cp.asarray(x)), 0.05, scope="tensor")
    assert isinstance(q, cp.ndarray)
    np.testing.assert_array_equal(q.get(), reference.quantize(x, np.float32(0.05), scope="tensor"))
    err(lambda: sf.quantize(HostDLPack(), 0.05, scope="tensor"), InvalidProblemError, "x", "CPU array")
    err(lambda: sf.quantize(BareDLPack(), 0.05, scope="tensor"), InvalidProblemError, "x", "DLPack")


@pytest.mark.gpu
def test_gpu_scalar_scales_at_the_range_edges(rng):
    """The smallest normal and the largest finite float32 run and equal the reference; one step outside
    is refused before anything is allocated (the memory pool holds what it held)."""
    import cupy as cp
    from runtime import reference
    x = rng.standard_normal((16, 64)).astype(np.float32) * 1e-30
    xd = cp.asarray(x)
    for s in (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)):
        np.testing.assert_array_equal(sf.quantize(xd, s, scope="tensor").get(),
                                      reference.quantize(x, np.float32(s), scope="tensor"))
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    for s in (float(np.finfo(np.float32).tiny) / 2, 3.5e38, 1e308, 10 ** 400):
        err(lambda s=s: sf.fake_quantize(xd, s, scope="tensor"), InvalidProblemError, "scale=")
        err(lambda s=s: sf.dynamic_quantize(xd, scope="token", eps=s), InvalidProblemError, "eps=")
    assert pool.used_bytes() == before


@pytest.mark.gpu
def test_gpu_device_ordinals_beyond_the_devices(rng):
    """A device ordinal the process does not have is a DeviceRequiredError naming the CUDA error, from
    the registry and from sf.check; the context works afterwards."""
    import cupy as cp
    n = cp.cuda.runtime.getDeviceCount()
    reg = sf.default_registry()
    sku = reg.query("quantization/quantize/token/symmetric/f32/s8/*")[0]
    err(lambda: reg.kernel(sku, device=n), sf.DeviceRequiredError, "cudaErrorInvalidDevice")
    x = cp.asarray(rng.standard_normal((8, 64)).astype(np.float32))
    sf.quantize(x, 0.5, scope="tensor")               # the status words exist from here on
    err(lambda: sf.check(n), sf.DeviceRequiredError, "cudaErrorInvalidDevice")
    sf.check()
    assert int(sf.quantize(x, 0.5, scope="tensor").size) == 8 * 64
