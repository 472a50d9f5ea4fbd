"""Runtime settings.

``check_values``: validate *values* held in device arrays (scales positive and finite, zero
points in range) before a launch. This costs one small reduction and a device→host sync per
array, so hot loops that pass already-validated parameters can turn it off globally
(``runtime.config.check_values = False``) or locally (``with runtime.trusted(): ...``).
Shapes, dtypes, devices and host-side values are always checked.
"""
from __future__ import annotations

import contextlib
import threading

check_values = True
_local = threading.local()


def values_checked() -> bool:
    return check_values and not getattr(_local, "trusted", False)


@contextlib.contextmanager
def trusted():
    """Skip device-side value checks inside this block (this thread only)."""
    prev = getattr(_local, "trusted", False)
    _local.trusted = True
    try:
        yield
    finally:
        _local.trusted = prev
