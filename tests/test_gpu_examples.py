"""GPU: every script in examples/ runs as a subprocess and exits 0 (each asserts its own check
against a PyTorch reference: W8A8 within int8 error, FP8 row-wise and 1x128 groups, QAT equal to
PyTorch's fake-quant ops, the MoE layer vs a float64 reference and a falling loss, the
expert-parallel layer in one process (world size 1 over NCCL) vs the one-process layer; on two GPUs
under torchrun: tests/core/test_gpu_multi.py)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


def test_the_examples_are_the_five_documented_ones():
    assert EXAMPLES == ["ep_moe.py", "fp8_linear.py", "moe_layer.py", "qat_mlp.py", "w8a8_linear.py"]


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs(script):
    pytest.importorskip("torch")
    # NVLink multicast off for the NCCL example, as on the machines that run these tests
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    r = subprocess.run([sys.executable, os.path.join("examples", script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{script} failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    assert script.split(".")[0] in r.stdout
