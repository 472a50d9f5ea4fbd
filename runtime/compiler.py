"""NVRTC compilation with a content-keyed disk cache.

No GPU is needed to compile: NVIDIA's ``cuda-bindings`` NVRTC wrapper finds ``libnvrtc``
(the ``nvidia-cuda-nvrtc`` wheel) through ``cuda-pathfinder``. The generated sources need
no CUDA headers.

Cache layout (after FlashInfer's JIT): ``$SKUFORGE_CACHE_DIR`` (default
``~/.cache/skuforge``) / ``nvrtc-<major.minor>`` / ``<arch>`` / ``<unit-name>-<key>.cubin``,
where ``key`` = sha256 of (source, options, NVRTC version, arch, generator version). An
entry is written to a temporary file and ``os.replace``d into place (atomic, after CuPy's
compiler cache), under a per-entry ``filelock`` so that concurrent processes compile once;
every entry carries the sha256 of its payload and a corrupt entry is recompiled.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .config import settings
from .errors import SkuforgeError

GENERATOR_VERSION = "0.1.0"  # kept equal to codegen.GENERATOR_VERSION (a test checks)
_MAGIC = b"SKUFORGE-CUBIN1\n"
BASE_OPTIONS = ("-std=c++17",)


class CompileError(SkuforgeError):
    """NVRTC rejected a translation unit; the message carries its log."""


@lru_cache(maxsize=1)
def _nvrtc():
    from cuda.bindings import nvrtc  # imported lazily: `import runtime` stays cheap
    return nvrtc


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


def cache_dir() -> Path:
    return settings().cache_dir


def _log(prog) -> str:
    nvrtc = _nvrtc()
    err, n = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00 \n")


def _compile(source: str, name: str, arch: int, options, report: bool) -> tuple:
    """(cubin, ptxas log) of one translation unit for ``sm_<arch>``; the log holds ptxas's
    per-kernel resource lines when ``report`` is set (``--ptxas-options=-v``)."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if int(err) != 0:
        raise CompileError(f"nvrtcCreateProgram failed on {name}: {err}")
    try:
        opts = [f"--gpu-architecture=sm_{arch}".encode()] + ([b"--ptxas-options=-v"] if report else []) + \
               [o.encode() for o in (*BASE_OPTIONS, *options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _log(prog)
        if int(err) != 0:
            raise CompileError(f"NVRTC failed on {name} for sm_{arch}: {err}\n{log}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        buf = b" " * size
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
    log = _compile(source, name, arch, options, True)[1]
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
    return out


def local_memory_use(report: dict) -> dict:
    """The kernels of a :func:`resource_report` that use local memory (a stack frame or spills):
    symbol -> a short description. Every shipped kernel keeps its data in registers."""
    return {sym: f"{r['stack']} B stack frame, {r['spill_stores']}/{r['spill_loads']} B spill stores/loads"
            for sym, r in report.items() if r["stack"] or r["spill_stores"] or r["spill_loads"]}


def cache_key(source: str, arch: int, options=()) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join((*BASE_OPTIONS, *options)), "%d.%d" % nvrtc_version(),
                 f"sm_{arch}", GENERATOR_VERSION):
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()


@dataclass
class CompileResult:
    cubin: bytes
    path: Path
    cached: bool


def _entry_path(name: str, arch: int, key: str) -> Path:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name.rsplit(".", 1)[0])
    major, minor = nvrtc_version()
    return cache_dir() / f"nvrtc-{major}.{minor}" / f"sm_{arch}" / f"{stem}-{key[:24]}.cubin"


def _read_entry(path: Path):
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 65:
        return None
    digest, payload = data[len(_MAGIC):len(_MAGIC) + 64], data[len(_MAGIC) + 65:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        return None  # corrupt or truncated: recompile
    return payload


def compile_cached(source: str, name: str, arch: int, options=()) -> CompileResult:
    """Compile through the disk cache: safe across threads and processes."""
    from filelock import FileLock

    key = cache_key(source, arch, options)
    path = _entry_path(name, arch, key)
    payload = _read_entry(path)
    if payload is not None:
        return CompileResult(payload, path, True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        payload = _read_entry(path)  # another process may have finished meanwhile
        if payload is not None:
            return CompileResult(payload, path, True)
        cubin = nvrtc_compile(source, name, arch, options)
        blob = _MAGIC + hashlib.sha256(cubin).hexdigest().encode() + b"\n" + cubin
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return CompileResult(cubin, path, False)
