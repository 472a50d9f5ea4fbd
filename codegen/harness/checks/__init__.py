"""Per-family GPU checkers (``python -m codegen verify``, the GPU tests).

``base`` is what they share; every other module here is one family's checkers (``CHECKERS``, by op),
named in the family table ``codegen.harness.families``. Family modules import ``base``, never each other.
"""
