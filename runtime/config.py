"""Runtime settings.

``sync_checks``: the synchronous debug mode of the value checks. By default the kernels check the
values they read from device arrays (scales, zero points, e8m0 codes, MoE offsets) themselves and
report an invalid one through the device's status word (runtime/status.py): no call synchronizes
the host with the device. Inside ``with runtime.sync_checks():`` (this thread), or with
``SKUFORGE_SYNC_CHECKS=1`` in the environment, each op also checks those values on the host before
it launches (a reduction and a device->host copy per array), so that a bad value raises at the
call that passed it, before anything runs. For debugging; never inside a CUDA graph capture.
"""
from __future__ import annotations

import functools
import os
import threading

_env_sync = os.environ.get("SKUFORGE_SYNC_CHECKS", "") not in ("", "0")
_local = threading.local()


def sync_checks_on() -> bool:
    """Whether the synchronous value checks run for this thread's calls."""
    return getattr(_local, "sync", _env_sync)


class sync_checks:
    """Synchronous value checks inside this block (this thread only): ``with sync_checks(): ...``;
    ``sync_checks(False)`` turns them off inside a block (over ``SKUFORGE_SYNC_CHECKS=1``).
    Also a decorator."""

    __slots__ = ("on", "prev")

    def __init__(self, on: bool = True):
        self.on = bool(on)

    def __enter__(self):
        self.prev = getattr(_local, "sync", None)
        _local.sync = self.on
        return self

    def __exit__(self, *exc):
        if self.prev is None:
            del _local.sync
        else:
            _local.sync = self.prev
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with sync_checks(self.on):
                return fn(*args, **kwargs)
        return inner
