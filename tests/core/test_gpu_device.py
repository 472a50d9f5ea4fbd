"""GPU: the real driver (runtime.device.CudaDriver) answers as CuPy and the driver API do, and a new one
put in place with ``device.use`` runs the ops with state of its own (the CPU side: tests/core/test_device.py)."""
import numpy as np
import pytest

import runtime as sf
from runtime import device, reference, status, tma

pytestmark = pytest.mark.gpu


def test_properties_match_cupy():
    import cupy as cp
    d = cp.cuda.runtime.getDevice()
    raw = cp.cuda.runtime.getDeviceProperties(d)
    p = device.properties(d)
    assert (p["cc"], p["sms"], p["max_threads_per_sm"], p["smem_optin"]) == (
        raw["major"] * 10 + raw["minor"], raw["multiProcessorCount"], raw["maxThreadsPerMultiProcessor"],
        raw["sharedMemPerBlockOptin"])
    assert device.driver().attribute(d, device.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) == p["smem_optin"]


def test_resident_blocks_with_large_shared_memory_match_cupys_occupancy():
    """The moe GEMM's occupancy (dynamic shared memory above 48 KB: the function's limit raised first)
    is what CuPy's driver bindings answer for the same function and shared memory."""
    import cupy as cp
    from cupy_backends.cuda.api import driver as cu
    x, w = cp.zeros((256, 512), cp.float16), cp.zeros((8, 512, 512), cp.float16)
    plan = sf.moe.select_plan("grouped_matmul", x, w, offsets=cp.zeros(9, cp.int32), strategy="mma")
    optin = device.properties(x.device.id)["smem_optin"]
    fits = [m for m in plan.launch["variants"].values() if m["dynamic_smem"] + m["static_smem"] <= optin]
    meta = max(fits, key=lambda m: m["dynamic_smem"])
    smem, threads = meta["dynamic_smem"], meta["tile"]["THREADS"]
    if smem <= 48 * 1024:
        pytest.skip(f"no mma configuration takes more than 48 KB of dynamic shared memory here ({smem})")
    fn = device.load_function(plan.registry, plan.entry.unit, meta["symbol"], x.device.id)
    got = device.resident_blocks(fn, threads, smem)
    with device.driver().on_context_of(fn):
        cu.funcSetAttribute(fn.ptr, cu.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        want = max(1, cu.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, smem))
    assert got == want >= 1


class BindingsOnly(device.CudaDriver):
    """The real driver without libcuda's ctypes entry points: cuda-python's bindings for everything."""

    def libcuda(self):
        raise OSError("libcuda.so.1 not opened by name")


def test_tensor_maps_encode_alike_through_ctypes_and_the_bindings():
    import cupy as cp
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("tensor maps are encoded for the wgmma kernels (sm_90)")
    a = cp.zeros((64, 256), cp.float16)
    args = (tma.DATA_TYPE["f16"], 2, a.data.ptr, (256, 64), (512,), (64, 64), (1, 1), tma.INTERLEAVE_NONE,
            tma.SWIZZLE_128B, tma.L2_PROMOTION_256B, tma.OOB_FILL_ZEROS)
    err, ctypes_map = device.driver().encode_tiled(args)
    err2, bindings_map = BindingsOnly().encode_tiled(args)
    assert err == err2 == 0 and len(ctypes_map) == 128 and ctypes_map == bindings_map


@pytest.mark.parametrize("make", [device.CudaDriver, BindingsOnly], ids=["ctypes", "bindings"])
def test_a_new_driver_runs_the_ops_with_state_of_its_own(make):
    """A driver put in place loads its own modules, allocates its own status words and launches (through
    libcuda's ctypes calls, or cuda-python's bindings): the results are the reference's, and the
    process's driver is in place again after."""
    import cupy as cp
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    scale = (np.abs(x).max(axis=1) / 127).astype(np.float32)
    want = reference.quantize(x, scale, scope="token")
    dynamic = [cp.asnumpy(a) for a in sf.dynamic_quantize(cp.asarray(x), scope="tensor")[:2]]
    outer = device.driver()
    with device.use(make()) as d:
        for _ in range(3):                                     # the full path, then replays
            q = sf.quantize(cp.asarray(x), cp.asarray(scale), scope="token", out_dtype="int8")
            np.testing.assert_array_equal(cp.asnumpy(q), want)
        for _ in range(2):                                     # the cooperative launch and its memset
            got = sf.dynamic_quantize(cp.asarray(x), scope="tensor")[:2]
            for a, b in zip(got, dynamic):
                np.testing.assert_array_equal(cp.asnumpy(a), b)
        assert status.words().words is not None and d._modules
        sf.check()
    assert device.driver() is outer
