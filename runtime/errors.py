"""Typed errors. Both are ``ValueError`` so that generic callers can catch them."""


class SkuforgeError(ValueError):
    """Base class of every error skuforge raises on purpose."""


class UnsupportedError(SkuforgeError):
    """The request is valid but no kernel implements it (an excluded or unknown cell)."""


class InvalidProblemError(SkuforgeError):
    """An argument is wrong: dtype, shape, device, range or value."""


class DeviceMismatchError(InvalidProblemError):
    """The arrays of one call live on different devices. ``devices`` maps each array argument's
    name to its device (``"cuda:1"``); the message names them all."""

    def __init__(self, devices: dict, what: str = "arguments"):
        self.devices = dict(devices)
        listed = ", ".join(f"{arg} on {dev}" for arg, dev in self.devices.items())
        super().__init__(f"{what} live on different devices: {listed}; every array of a call must be on one "
                         "device (the kernels run on that device, in its current stream)")


class DeviceRequiredError(SkuforgeError):
    """A GPU operation was asked for where no CUDA device (or CuPy) is available."""


class ToolchainUnavailableError(SkuforgeError):
    """NVRTC (``cuda-bindings`` + ``nvidia-cuda-nvrtc``) is needed to compile a kernel and cannot be
    loaded; the message says what to install, or how to use prebuilt kernels instead."""


class KernelNotPrebuiltError(SkuforgeError):
    """Run-time compilation is disabled (``SKUFORGE_DISABLE_JIT=1``) and a kernel is neither in the
    prebuilt folder nor in the compile cache; the message names the unit, its SKUs, the arch and
    the command that builds it."""


class TemplateError(SkuforgeError):
    """A Jinja template could not be found, parsed or rendered; the message names the template
    file and line."""


class InstalledTreeError(SkuforgeError):
    """The generator was asked to rewrite ``generated/`` inside an installed package."""


class CacheWarning(UserWarning):
    """The compile cache or the prebuilt folder could not be used as asked (unwritable folder, corrupt
    or misplaced entry, a lock held past ``SKUFORGE_LOCK_TIMEOUT``, a malformed or foreign prebuilt
    index): skuforge carried on (in memory, by rebuilding the entry, or without the prebuilt folder)."""
