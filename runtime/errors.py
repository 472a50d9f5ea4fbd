"""Typed errors. Both are ``ValueError`` so that generic callers can catch them."""


class SkuforgeError(ValueError):
    """Base class of every error skuforge raises on purpose."""


class UnsupportedError(SkuforgeError):
    """The request is valid but no kernel implements it (an excluded or unknown cell)."""


class InvalidProblemError(SkuforgeError):
    """An argument is wrong: dtype, shape, device, range or value."""


class DeviceRequiredError(SkuforgeError):
    """A GPU operation was asked for where no CUDA device (or CuPy) is available."""
