"""The plan API (after the Rust seed): select a kernel for a problem, then run it.

    plan = Plan.select(Descriptor("quantize", scope="token", mode="symmetric",
                                  element="bf16", aux_element="s8"))
    plan.sku, plan.precision_guarantee, plan.workspace_size(args), plan.can_implement(args)
    plan.run(args, stream=None)

How a plan launches its kernel depends on the kernel's launch kind (manifest
``launch.kind``): each kind registers a :class:`Launcher` with :func:`launcher`.
Plans are cached per (descriptor, preference).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .axes import LAUNCH_KINDS
from .errors import InvalidProblemError
from .registry import Registry, default_registry
from .sku import KernelSku


@dataclass(frozen=True)
class Descriptor:
    """What problem: op, scope, mode, element kinds (input, output)."""

    op: str
    scope: Optional[str] = None
    mode: Optional[str] = None
    element: str = "f32"
    aux_element: Optional[str] = None
    category: str = "quantization"

    def check(self) -> None:
        """Every field a string (scope, mode and aux_element may be None), else an InvalidProblemError
        naming it (made when a plan is selected, not when a descriptor is made: that is on every call)."""
        for name, value in vars(self).items():
            if not (isinstance(value, str) or (value is None and name in ("scope", "mode", "aux_element"))):
                raise InvalidProblemError(f"Descriptor.{name}={value!r:.60}: a string"
                                          + ("" if name in ("op", "element", "category") else " or None")
                                          + " is required")


@dataclass(frozen=True)
class Preference:
    """How to solve it: a backend (``simt``/``mma``) and the device arch to target."""

    backend: Optional[str] = None
    arch: Optional[int] = None

    def check(self) -> None:
        """A backend name or None, a compute capability or None (as :meth:`Descriptor.check`)."""
        if not (self.backend is None or isinstance(self.backend, str)):
            raise InvalidProblemError(f"Preference.backend={self.backend!r:.60}: a backend name (simt, mma, wgmma) "
                                      "or None is required")
        if not (self.arch is None or (isinstance(self.arch, int) and not isinstance(self.arch, bool))):
            raise InvalidProblemError(f"Preference.arch={self.arch!r:.60}: a compute capability such as 90 (or "
                                      "None) is required")


class Launcher:
    """Drives one launch kind: argument checks, scratch size, grid and parameters. ``args_type``: the
    class of the arguments its plans take (the plan API refuses anything else); ``main``: the
    entry-point group :meth:`Plan.abi` gives by default."""

    args_type: type = object
    main: str = "main"
    one_launch: bool = False    # prepare(plan, args) gives the whole run as one PreparedLaunch (replayed by re-filling its slots)

    def check(self, plan: "Plan", args) -> None:
        """Raise InvalidProblemError when ``args`` do not fit ``plan``."""

    def workspace_size(self, plan: "Plan", args) -> int:
        return 0

    def run(self, plan: "Plan", args, stream=None) -> None:
        raise NotImplementedError

    def accesses(self, sku, launch: dict) -> dict:
        """{entry-point group: the pointer parameters its kernels move in words wider than an
        element (runtime.vectors.Access)} of the kernel ``sku`` with manifest ``launch`` metadata."""
        return {}


# launch kind -> its Launcher: the table of runtime/families.py, installed when the runtime is imported
LAUNCHERS: dict = {}


def install(table: dict) -> None:
    """Make ``table`` (launch kind -> Launcher) the launchers plans use: every kind of runtime/axes.py,
    no other."""
    if set(table) != set(LAUNCH_KINDS):
        raise ImportError(f"the launcher table names {sorted(table)}; runtime/axes.py declares {sorted(LAUNCH_KINDS)}")
    LAUNCHERS.clear()
    LAUNCHERS.update(table)


def _registry(registry):
    if registry is None:
        return default_registry()
    if not isinstance(registry, Registry):
        raise InvalidProblemError(f"registry={registry!r:.60}: a runtime.Registry (or None: the default one) is "
                                  "required")
    return registry


class Plan:
    def __init__(self, sku: KernelSku, registry=None):
        self.registry = _registry(registry)
        self.entry = self.registry.lookup(sku)
        self.sku = self.entry.sku
        self.launch = self.entry.launch
        try:
            self.launcher = LAUNCHERS[self.launch["kind"]]
        except KeyError:
            raise InvalidProblemError(f"{sku}: no launcher for launch kind {self.launch['kind']!r}") from None

    @classmethod
    def select(cls, descriptor: Descriptor, preference: Preference = Preference(), registry=None) -> "Plan":
        if not isinstance(descriptor, Descriptor) or not isinstance(preference, Preference):
            raise InvalidProblemError(f"Plan.select({descriptor!r:.60}, {preference!r:.60}): a runtime.Descriptor "
                                      "and a runtime.Preference are required")
        descriptor.check()
        preference.check()
        reg = _registry(registry)
        sku = reg.select(category=descriptor.category, op=descriptor.op, scope=descriptor.scope,
                         mode=descriptor.mode, element=descriptor.element, aux_element=descriptor.aux_element,
                         arch=preference.arch, backend=preference.backend)
        return cls(sku, reg)

    def __repr__(self) -> str:
        return f"Plan({self.sku})"

    @property
    def entry_points(self) -> tuple:
        """The names of this kernel's entry-point groups (``("main",)``; the MoE kernels: ``gemm``
        and their routing kernels ``route_*``), what :meth:`abi` takes."""
        return tuple(sorted(self.launch["abi"]))

    def abi(self, group: Optional[str] = None):
        """The parameter list of this kernel's ``group`` of entry points (runtime.abi.Abi); None: its
        main group (``main``; ``gemm`` for the MoE kernels)."""
        group = self.launcher.main if group is None else group
        abi_id = self.launch["abi"].get(group) if isinstance(group, str) else None
        if abi_id is None:
            raise InvalidProblemError(f"{self.sku} has no entry-point group {group!r:.60}; its groups: "
                                      f"{', '.join(self.entry_points)}")
        return self.registry.abi(abi_id)

    @property
    def precision_guarantee(self) -> str:
        p = self.sku.precision
        s = f"math in {p.math}, accumulate in {p.accumulator}"
        if p.bit_stable:
            s += "; bit-exact with runtime.reference"
        if p.deterministic:
            s += "; deterministic (same bits every run)"
        return s

    def _args(self, args, method: str):
        """``args`` where they are of the launcher's argument class, else an InvalidProblemError."""
        want = self.launcher.args_type
        if not isinstance(args, want):
            raise InvalidProblemError(f"Plan.{method}: args is of type {type(args).__name__}; {self.sku} (launch kind "
                                      f"{self.launch['kind']!r}) takes a {want.__module__}.{want.__name__}")
        return args

    def workspace_size(self, args=None) -> int:
        """Bytes of scratch ``args`` need (``workspace=`` of the launch kinds that take one); without
        ``args``, 0 for a kernel that never needs any (else the arguments are required)."""
        if args is None and type(self.launcher).workspace_size is Launcher.workspace_size:
            return 0
        return self.launcher.workspace_size(self, self._args(args, "workspace_size"))

    def can_implement(self, args) -> bool:
        """Whether the kernel takes ``args`` (of the launcher's argument class: anything else is an
        InvalidProblemError)."""
        args = self._args(args, "can_implement")
        try:
            self.launcher.check(self, args)
            return True
        except InvalidProblemError:
            return False

    def run(self, args, stream=None):
        """Launch on ``stream`` (a CuPy or torch stream, or a raw handle); default: the
        caller's current stream for the arrays' framework."""
        stream = stream_handle_of(stream)
        self.launcher.check(self, self._args(args, "run"))
        self.launcher.run(self, args, stream)


def stream_handle_of(stream):
    """A raw ``cudaStream_t`` from a CuPy stream, a torch stream or an int (None stays None)."""
    if stream is None:
        return None
    h = stream
    if type(h) is not int:
        h = getattr(stream, "ptr", None)
        h = getattr(stream, "cuda_stream", None) if h is None else h
    if type(h) is not int or not 0 <= h < 1 << 64:
        raise InvalidProblemError(f"stream={stream!r:.60} is not a CuPy stream, a torch stream or a raw handle "
                                  "(an integer cudaStream_t)")
    return h


def cached_plan(descriptor: Descriptor, preference: Preference = Preference()) -> Plan:
    """``Plan.select(descriptor, preference)``, remembered (a descriptor with a field that cannot be
    hashed gets Plan.select's error)."""
    try:
        return _cached_plan(descriptor, preference)
    except TypeError:
        return Plan.select(descriptor, preference)


_cached_plan = lru_cache(maxsize=4096)(Plan.select)
