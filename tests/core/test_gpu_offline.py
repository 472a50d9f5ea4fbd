"""Offline deployment on a GPU: kernels compiled ahead of time (`compile --out`) are loaded and run in a
process where NVRTC cannot be loaded and run-time compilation is disabled."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SKU = "quantization/quantize/token/symmetric/f32/s8/*"

CHILD = textwrap.dedent("""
    from runtime import nvrtc

    def _missing():
        raise ImportError("NVRTC disabled for this test")
    nvrtc._load_nvrtc = _missing              # any NVRTC use raises ToolchainUnavailableError

    import cupy as cp
    import numpy as np
    import runtime as sf
    from runtime import device, reference

    arch = device.compile_arch(cp.cuda.runtime.getDevice())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    scale = (np.abs(x).max(axis=1) / 127).astype(np.float32)
    q = sf.quantize(cp.asarray(x), cp.asarray(scale), scope="token", out_dtype="int8")
    want = reference.quantize(x, scale, scope="token")
    np.testing.assert_array_equal(cp.asnumpy(q), want)
    print("OFFLINE-OK", arch)
""")


def test_prebuilt_kernel_runs_without_nvrtc(tmp_path):
    import cupy as cp

    from runtime import device
    arch = device.compile_arch(cp.cuda.runtime.getDevice())
    out = tmp_path / "prebuilt"
    res = subprocess.run([sys.executable, "-m", "codegen", "compile", "--arch", f"sm_{arch}", "--filter", SKU,
                          "--out", str(out)], capture_output=True, text=True,
                         env={**os.environ, "SKUFORGE_CACHE_DIR": str(tmp_path / "build-cache")})
    assert res.returncode == 0, res.stdout + res.stderr
    env = {**os.environ, "SKUFORGE_PREBUILT": str(out), "SKUFORGE_DISABLE_JIT": "1",
           "SKUFORGE_CACHE_DIR": str(tmp_path / "empty-cache")}
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OFFLINE-OK" in run.stdout
