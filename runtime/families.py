"""The runtime's kernel families, registered in one table: each launch kind's launcher.

A family is one package beside the others on one floor above the shared machinery (no family imports
another): ``runtime/quantization/`` (static, low-bit, dynamic and training quantization) and
``runtime/moe/`` (grouped matmul). Adding a family is its package (whose ``LAUNCHERS``
maps its launch kinds, declared in runtime/axes.py, to their launchers) and one entry in the table below.
"""
from __future__ import annotations

from . import moe, plans, quantization

FAMILIES: tuple = (quantization, moe)   # each declares LAUNCHERS: its launch kinds -> their launchers

LAUNCHERS: dict = {}
for _family in FAMILIES:
    _twice = set(LAUNCHERS) & set(_family.LAUNCHERS)
    if _twice:
        raise ImportError(f"{_family.__name__} declares the launch kinds {sorted(_twice)} another family declares")
    LAUNCHERS.update(_family.LAUNCHERS)
plans.install(LAUNCHERS)
