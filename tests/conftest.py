import contextlib

import numpy as np
import pytest

from runtime import config as runtime_config
from tests import knobs


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


@pytest.fixture(autouse=True)
def host_status_words(monkeypatch):
    """Without a GPU there is no mapped host memory: the status words (runtime/status.py) are
    ordinary memory, so that CPU tests with fake device arrays can reach a launch."""
    if HAS_GPU:
        yield None
        return
    import ctypes

    from runtime import status
    words = (ctypes.c_uint32 * status.MAX_DEVICES)()
    monkeypatch.setattr(status, "_words", words)
    monkeypatch.setattr(status, "_base", ctypes.addressof(words))
    yield words


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
