"""Bench workloads, one module per family (``python -m codegen bench``).

``base`` is what they share; every other module here is one bench section, named in the family
table ``codegen.harness.families``: its ``make(sku, shape)`` and attributes (``OPS``, ``SHAPES``,
``handles``, ``default``, ``TARGET_PCT``, ``host_calls`` ...) describe it (docs/audit.md, "Workload
modules"). Family modules import ``base``, never each other.
"""
