"""Per-family GPU checkers (``python -m codegen verify``, the GPU tests).

``base`` is what they share; every other module here is one family and registers its checkers
with ``codegen.harness.registry.checker`` when ``codegen.harness.registry`` loads this package.
Family modules import ``base`` and the registry, never each other.
"""
