import contextlib

import numpy as np
import pytest

from runtime import config as runtime_config
from runtime import device
from tests import knobs
from tests.fakes import FakeDevice


def _has_gpu() -> bool:
    try:
        import cupy as cp
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_device():
    """A :class:`tests.fakes.FakeDevice` (one H200-like device, cuda:0) as the current driver for the
    test: launches recorded, properties from a table (docs/testing.md)."""
    with device.use(FakeDevice()) as fake:
        yield fake


@pytest.fixture
def rng(request):
    # fresh random inputs on every run; the seed is printed on failure to reproduce
    seed = knobs.seed()
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def override_settings():
    """``override_settings(schedule="two-pass")``: runtime.config.override for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(runtime_config.override(**fields))
