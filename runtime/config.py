"""Settings: every ``SKUFORGE_*`` environment variable of the runtime is read here, once, and nowhere
else (the harness and the tests read their own, docs/audit.md "Environment").

:func:`settings` returns the :class:`Settings` (a frozen dataclass, typed, each field documented;
the table is docs/configuration.md). The environment is read on the first call (never at import:
a bad value is a typed error where a setting is first used); the value is kept. Every boolean
variable goes through :func:`parse_flag`, here and in the harness and tests, which read their own
variables with :func:`env_flag` / :func:`env_int`. :func:`override` replaces fields inside a
``with`` block (tools and tests)::

    with runtime.config.override(dynamic_config="block", schedule="b128"):
        ...

and forgets what was worked out from them (:data:`CACHES`: the replay of repeated calls, the fused
dynamic launches, ...) on entry and on exit. :func:`reload` re-reads the environment.

``sync_checks``: the synchronous debug mode of the value checks. By default the kernels check the
values they read from device arrays (scales, zero points, e8m0 codes, MoE offsets) themselves and
report an invalid one through the device's status word (runtime/status.py): no call synchronizes
the host with the device. Inside ``with runtime.sync_checks():`` (this thread), or with
``SKUFORGE_SYNC_CHECKS=1`` in the environment, each op also checks those values on the host before
it launches (a reduction and a device->host copy per array), so that a bad value raises at the
call that passed it, before anything runs. For debugging; never inside a CUDA graph capture.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import InvalidProblemError

_local = threading.local()


# Whether the synchronous checks were ever turned on in this process (a block, or the settings):
# until then a repeated call need not ask :func:`sync_checks_on` (runtime/replay.py).
SYNC_EVER = [False]


def sync_checks_on() -> bool:
    """Whether the synchronous value checks run for this thread's calls."""
    on = getattr(_local, "sync", None)
    return settings().sync_checks if on is None else on


class sync_checks:
    """Synchronous value checks inside this block (this thread only): ``with sync_checks(): ...``;
    ``sync_checks(False)`` turns them off inside a block (over ``SKUFORGE_SYNC_CHECKS=1``).
    Also a decorator."""

    __slots__ = ("on", "prev")

    def __init__(self, on: bool = True):
        self.on = bool(on)

    def __enter__(self):
        self.prev = getattr(_local, "sync", None)
        _local.sync = self.on
        if self.on:
            SYNC_EVER[0] = True
        return self

    def __exit__(self, *exc):
        if self.prev is None:
            del _local.sync
        else:
            _local.sync = self.prev
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with sync_checks(self.on):
                return fn(*args, **kwargs)
        return inner


_PACKAGE = Path(__file__).resolve().parent


def data_root() -> Path:
    """Where ``templates/`` and ``generated/`` are: the repository root in a source checkout (or an
    editable install), ``runtime/_data`` in an installed wheel (setup.py's build hook copies them
    there; the repository layout is unchanged)."""
    packaged = _PACKAGE / "_data"
    return packaged if (packaged / "generated" / "manifest.json").is_file() else _PACKAGE.parent


def installed() -> bool:
    """Whether this is an installed copy (a wheel / ``pip install .``), not a source checkout."""
    return data_root() != _PACKAGE.parent


def default_cache_dir() -> Path:
    """The platform's user cache folder for skuforge: ``$XDG_CACHE_HOME/skuforge`` (else
    ``~/.cache/skuforge``) on Linux, ``~/Library/Caches/skuforge`` on macOS, under ``%LOCALAPPDATA%`` on Windows."""
    import platformdirs  # imported here: only the default needs it
    return Path(platformdirs.user_cache_dir("skuforge")).absolute()


@dataclass(frozen=True)
class Settings:
    """Tuning knobs and switches; ``env`` in each field's metadata names its variable."""

    # -- runtime: where things are ------------------------------------------------------------
    cache_dir: Path = dataclasses.field(
        default_factory=default_cache_dir, metadata={"env": "SKUFORGE_CACHE_DIR",
        "doc": "NVRTC compile cache (``<cache_dir>/cubin-v2/sm_<arch>/``), an absolute path; empty: the default; "
               "read at each compile"})
    generated: Path = dataclasses.field(
        default_factory=lambda: data_root() / "generated", metadata={"env": "SKUFORGE_GENERATED",
        "doc": "generated sources + manifest.json the runtime loads (non-editable installs); read when the "
               "default registry is first loaded"})
    prebuilt_dir: Optional[Path] = dataclasses.field(
        default=None, metadata={"env": "SKUFORGE_PREBUILT",
        "doc": "folder written by ``python -m codegen compile --out DIR`` (cubins + index.json): kernels found "
               "there are loaded without NVRTC; read at each compile"})
    disable_jit: bool = dataclasses.field(
        default=False, metadata={"env": "SKUFORGE_DISABLE_JIT",
        "doc": "never compile at run time: a kernel that is neither prebuilt nor cached is a "
               "runtime.errors.KernelNotPrebuiltError naming the unit, the arch and the command that builds it"})
    lock_timeout: float = dataclasses.field(
        default=120.0, metadata={"env": "SKUFORGE_LOCK_TIMEOUT",
        "doc": "seconds a process waits for a compile-cache entry's lock before a "
               "CacheWarning naming the lock file, and the process compiles the unit itself"})
    # -- runtime: launch configuration switches (measurements, A/B) ---------------------------
    schedule: str = dataclasses.field(
        default="", metadata={"env": "SKUFORGE_SCHEDULE",
        "doc": "a schedule variant (docs/tuning.md) every launch of a kind that declares it takes, instead of "
               "the tuning table's choice (measurements, A/B); empty: the table"})
    dynamic_config: str = dataclasses.field(
        default="auto", metadata={"env": "SKUFORGE_DYNAMIC_CONFIG",
        "doc": "fused dynamic-quantize launch: ``auto`` or a runtime.quantization.dynamic.FusedConfig text "
               "(``block``, ``t8,ch=4,threads=256``, ``...,fixed=0``)"})
    moe_config: str = dataclasses.field(
        default="", metadata={"env": "SKUFORGE_MOE_CONFIG",
        "doc": "MoE tile configuration per pass (``128x128x32s5`` or ``fwd=...,dgrad=...,wgrad=...``); "
               "runtime.moe.CONFIG / use_config() win over it"})
    graph_replay: str = dataclasses.field(
        default="on", metadata={"env": "SKUFORGE_GRAPH_REPLAY",
        "doc": "a repeated call's kernels: ``on`` (one CUDA graph launch, runtime/graphs.py) "
               "or ``off`` (each kernel launched on the stream)"})
    sync_checks: bool = dataclasses.field(
        default=False, metadata={"env": "SKUFORGE_SYNC_CHECKS",
        "doc": "synchronous host checks of device-array values before each launch (debug mode; "
               "``runtime.sync_checks()`` sets it per thread)"})


FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("0", "false", "no", "off")


def parse_flag(var: str, text: str, default: bool = False) -> bool:
    """The one reading of every boolean ``SKUFORGE_*`` variable: ``1 true yes on`` / ``0 false no off``
    (any case), empty: ``default``; anything else an InvalidProblemError naming the variable."""
    value = text.strip().lower()
    if not value:
        return default
    if value in FLAG_ON or value in FLAG_OFF:
        return value in FLAG_ON
    raise InvalidProblemError(f"{var}={text!r}; a flag is one of {', '.join(FLAG_ON)} (on), "
                              f"{', '.join(FLAG_OFF)} (off) or empty (the default)")


def _number(var: str, text: str, kind, default, ok, what: str):
    """A number from an environment variable (empty: ``default``), or a typed error naming it."""
    if not text.strip():
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise InvalidProblemError(f"{var}={text!r}; expected {what}")
    return value


def env_flag(var: str, environ=None) -> bool:
    """A boolean variable outside :class:`Settings` (the harness's, the tests'), read now."""
    return parse_flag(var, (os.environ if environ is None else environ).get(var, ""))


def env_int(var: str, environ=None) -> Optional[int]:
    """An integer variable outside :class:`Settings` (None when unset or empty), read now."""
    return _number(var, (os.environ if environ is None else environ).get(var, ""), int, None, lambda v: True,
                   "an integer")


CHOICES = {"graph_replay": ("on", "off")}


def _field_value(f, text: str):
    """One field's value from its variable's text (empty: the default), or a typed error naming it."""
    var = f.metadata["env"]
    if f.type == "bool":
        return parse_flag(var, text, f.default)
    if f.type == "float":
        return _number(var, text, float, f.default, lambda v: math.isfinite(v) and v >= 0,
                       "a finite number of seconds >= 0")
    if f.name in CHOICES:
        value = text.strip().lower() or f.default
        if value not in CHOICES[f.name]:
            raise InvalidProblemError(f"{var}={text!r}; one of {', '.join(CHOICES[f.name])}")
        return value
    if "Path" in f.type:
        # resolved once, here: a later chdir does not move the folder
        return Path(text).expanduser().absolute() if text.strip() else dataclasses.MISSING
    return text


def from_environ(environ=None) -> Settings:
    """:class:`Settings` from ``environ`` (default ``os.environ``): the one place that reads it."""
    env = os.environ if environ is None else environ
    values = {}
    for f in dataclasses.fields(Settings):
        text = env.get(f.metadata["env"])
        if text is not None:
            value = _field_value(f, text)
            if value is not dataclasses.MISSING:    # an empty path: the default
                values[f.name] = value
    return Settings(**values)


_SETTINGS: Optional[Settings] = None


def settings() -> Settings:
    """The current settings (the environment, read on the first call; or an :func:`override`)."""
    s = _SETTINGS
    return s if s is not None else reload()


def reload(environ=None) -> Settings:
    """Re-read the environment (and forget what depends on the settings)."""
    global _SETTINGS
    _SETTINGS = from_environ(environ)
    _forget()
    return _SETTINGS


class Caches:
    """What the runtime works out once and remembers, from the settings or from a device (the
    remembered calls, the fused dynamic launches, the schedule choices, the tensor maps): each one a
    dict made by :meth:`new`, all forgotten together by :meth:`forget` when the settings change
    (:func:`override`, :func:`reload`) or another driver is put in place (``runtime.device.use``)."""

    def __init__(self):
        self._dicts: list = []

    def new(self) -> dict:
        d: dict = {}
        self._dicts.append(d)
        return d

    def forget(self) -> None:
        for d in self._dicts:
            d.clear()


CACHES = Caches()


def _forget() -> None:
    if _SETTINGS is not None and _SETTINGS.sync_checks:
        SYNC_EVER[0] = True
    CACHES.forget()


@contextlib.contextmanager
def override(**fields):
    """``with override(schedule="two-pass"): ...``: these fields replaced inside the block
    (every thread: the settings are process-wide), the previous settings restored after."""
    global _SETTINGS
    prev = settings()
    _SETTINGS = dataclasses.replace(prev, **fields)
    _forget()
    try:
        yield _SETTINGS
    finally:
        _SETTINGS = prev
        _forget()
