"""Bench workloads, one module per family (``python -m codegen bench``).

``base`` is what they share; every other module here is one bench section: its ``make(sku, shape)``
is decorated with ``codegen.harness.registry.bench_section(name)`` and the module's attributes
(``OPS``, ``SHAPES``, ``handles``, ``default``, ``TARGET_PCT``, ``host_calls`` ...) describe it
(``codegen.harness.bench``). Family modules import ``base`` and the registry, never each other.
"""
