"""Runtime settings.

``check_values``: validate *values* held in device arrays (scales positive and finite, zero
points in range) before a launch. This costs one small reduction and a device→host sync per
array, so hot loops that pass already-validated parameters can turn it off globally
(``runtime.config.check_values = False``) or locally (``with runtime.trusted(): ...``).
Shapes, dtypes, devices and host-side values are always checked.
"""
from __future__ import annotations

import functools
import threading

check_values = True
_local = threading.local()


def values_checked() -> bool:
    return check_values and not getattr(_local, "trusted", False)


class trusted:
    """Skip device-side value checks inside this block (this thread only): ``with trusted(): ...``.

    A class rather than a generator-based context manager: entering and leaving cost about a
    third as much, which counts in a hot loop of small calls (docs/decisions.md, host overhead)."""

    __slots__ = ("prev",)

    def __enter__(self):
        self.prev = getattr(_local, "trusted", False)
        _local.trusted = True
        return self

    def __exit__(self, *exc):
        _local.trusted = self.prev
        return False

    def __call__(self, fn):
        """As a decorator (like the generator-based context manager it replaces)."""
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with trusted():
                return fn(*args, **kwargs)
        return inner
