"""NVRTC: one translation unit compiled to a cubin, and ptxas's report of its kernels' resources.

No GPU is needed to compile: NVIDIA's ``cuda-bindings`` NVRTC wrapper finds ``libnvrtc``
(the ``nvidia-cuda-nvrtc`` wheel) through ``cuda-pathfinder``. The generated sources need
no CUDA headers. The bindings are loaded on first use (``import runtime`` stays cheap); where they
or ``libnvrtc`` are missing, a :class:`ToolchainUnavailableError` says how to install them or to
run from prebuilt kernels. What is compiled when, and cached where: runtime/compiler.py.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional

from .errors import SkuforgeError, ToolchainUnavailableError

BASE_OPTIONS = ("-std=c++17",)
INSTALL_HINT = ("install NVRTC with `pip install cuda-bindings nvidia-cuda-nvrtc` (skuforge's own "
                "dependencies: `pip install skuforge`), or run from prebuilt kernels: "
                "`python -m codegen compile --arch sm_XX --out DIR` on a machine with NVRTC, then "
                "SKUFORGE_PREBUILT=DIR (docs/deploy.md)")


class CompileError(SkuforgeError):
    """NVRTC rejected a translation unit; the message carries its log."""


@lru_cache(maxsize=1)
def _load_nvrtc():
    from cuda.bindings import nvrtc  # imported lazily: `import runtime` stays cheap
    err, major, minor = nvrtc.nvrtcVersion()  # loads libnvrtc: fails here when it is missing
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return nvrtc


def _nvrtc():
    """The NVRTC bindings, loaded; :class:`ToolchainUnavailableError` with the install hint where
    ``cuda-bindings`` or ``libnvrtc`` is missing."""
    try:
        return _load_nvrtc()
    except ToolchainUnavailableError:
        raise
    except Exception as e:  # ImportError, RuntimeError from cuda-pathfinder, OSError from dlopen
        raise ToolchainUnavailableError(f"NVRTC is not available ({type(e).__name__}: {e}); {INSTALL_HINT}") from e


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple:
    err, major, minor = _nvrtc().nvrtcVersion()
    return (major, minor)


@lru_cache(maxsize=1)
def supported_archs() -> tuple:
    nvrtc = _nvrtc()
    err, n = nvrtc.nvrtcGetNumSupportedArchs()
    archs = [0] * n
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    return tuple(archs)


def _log(prog) -> str:
    nvrtc = _nvrtc()
    err, n = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = bytearray(n)  # NVRTC writes into it: never a bytes object (``b" " * 1`` is the interpreter's shared b" ")
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00 \n")


ARCH_OPTION = "--gpu-architecture="


def pinned_target(options) -> Optional[str]:
    """The target a unit's own options name (``--gpu-architecture=sm_90a``: an arch-specific unit,
    built for that target whatever device arch it is compiled for), or None."""
    for o in options:
        if o.startswith(ARCH_OPTION):
            return o[len(ARCH_OPTION):]
    return None


def builds_for(options, arch: int) -> bool:
    """Whether a unit with these options is built for devices of ``sm_<arch>``: every unit is, but one
    pinned to an arch-specific target (``sm_90a``) only for its own arch."""
    target = pinned_target(options)
    return target is None or int(re.sub(r"\D", "", target)) == arch


def _target_options(arch: int, options) -> list:
    """``--gpu-architecture=sm_<arch>`` unless the unit's options pin a target of their own."""
    return [] if pinned_target(options) else [f"{ARCH_OPTION}sm_{arch}"]


def _compile(source: str, name: str, arch: int, options, report: bool) -> tuple:
    """(cubin, ptxas log) of one translation unit for ``sm_<arch>``; the log holds ptxas's
    per-kernel resource lines when ``report`` is set (``--ptxas-options=-v``)."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if int(err) != 0:
        raise CompileError(f"nvrtcCreateProgram failed on {name}: {err}")
    try:
        opts = [o.encode() for o in _target_options(arch, options)] + ([b"--ptxas-options=-v"] if report else []) + \
               [o.encode() for o in (*BASE_OPTIONS, *options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _log(prog)
        if int(err) != 0:
            raise CompileError(f"NVRTC failed on {name} for sm_{arch}: {err}\n{log}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        buf = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        if int(err) != 0:
            raise CompileError(f"nvrtcGetCUBIN failed on {name}: {err}")
        return bytes(buf), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def nvrtc_compile(source: str, name: str, arch: int, options=()) -> bytes:
    """Compile one translation unit to a cubin for ``sm_<arch>`` (no cache)."""
    return _compile(source, name, arch, options, False)[0]


_RESOURCE_PATTERNS = (("registers", r"Used (\d+) registers"), ("smem", r"(\d+) bytes smem"),
                      ("stack", r"(\d+) bytes stack frame"),
                      ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads"))


def resource_report(source: str, name: str, arch: int, options=()) -> dict:
    """ptxas's resource usage per kernel symbol (registers, stack frame, spill bytes, shared
    memory), from an uncached compile with ``--ptxas-options=-v``: the first thing to read about
    a kernel's speed, and the machine-code check of ``python -m codegen compile`` (a kernel with a
    stack frame or spills keeps data in local memory)."""
    return compile_with_report(source, name, arch, options)[1]


def compile_with_report(source: str, name: str, arch: int, options=()) -> tuple:
    """(cubin, :func:`resource_report`) from one uncached compile (``compile --out`` / ``--fill-cache``
    keep the cubin that was checked)."""
    cubin, log = _compile(source, name, arch, options, True)
    out, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = out.setdefault(m.group(1), {key: 0 for key, _ in _RESOURCE_PATTERNS})
        elif current is not None:
            for key, pat in _RESOURCE_PATTERNS:
                m = re.search(pat, line)
                if m:
                    current[key] = int(m.group(1))
    return cubin, out


def local_memory_use(report: dict) -> dict:
    """The kernels of a :func:`resource_report` that use local memory (a stack frame or spills):
    symbol -> a short description. Every shipped kernel keeps its data in registers."""
    return {sym: f"{r['stack']} B stack frame, {r['spill_stores']}/{r['spill_loads']} B spill stores/loads"
            for sym, r in report.items() if r["stack"] or r["spill_stores"] or r["spill_loads"]}

def full_options(arch: int, options=()) -> list:
    """The NVRTC options a unit is compiled with (recorded in entries and the prebuilt index)."""
    return [*_target_options(arch, options), *BASE_OPTIONS, *options]
