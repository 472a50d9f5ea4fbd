"""The registry: the manifest, loaded once, as a queryable set of kernels.

``Registry.query(pattern)`` globs SKU strings; ``lookup(sku)`` returns the entry or a
typed error naming the reason (an excluded cell) or the nearest supported cells;
``select(...)`` picks the best SKU for a problem description and preference;
``kernel(sku, device)`` compiles (through the disk cache) and loads the kernel on a device.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from .config import settings
from .errors import InvalidProblemError, UnsupportedError
from .axes import BACKENDS
from .sku import KernelSku

SKU_FIELDS = ("category", "op", "scope", "mode", "element", "aux_element", "arch", "backend", "precision")


@dataclass(frozen=True)
class KernelEntry:
    sku: KernelSku
    unit: str
    symbol: str
    family: str
    sha256: str
    launch: dict

    def entry_point(self, name: str = "main") -> str:
        """The symbol of the SKU's entry point ``name`` as the manifest records it (``launch["entries"]``:
        ``main``, ``rows``, ``t8_tx4``, ``coop``, ``finish``, ``route_count``, ...; a group the SKU
        launches from a host SKU of its unit, launch metadata ``shares``, has the host's symbols)."""
        try:
            return self.launch["entries"][name]["symbol"]
        except KeyError:
            raise UnsupportedError(f"{self.sku} has no entry point {name!r}; it has "
                                   f"{', '.join(sorted(self.launch['entries']))}") from None


class Registry:
    def __init__(self, manifest: dict, root: Path):
        self.root = root
        self.manifest = manifest
        self.entries = {}
        for text, e in manifest["kernels"].items():
            sku = KernelSku.parse(text)
            self.entries[sku] = KernelEntry(sku, e["unit"], e["symbol"], e["family"], e["sha256"], e["launch"])
        self.excluded = {KernelSku.parse(t): e["reason"] for t, e in manifest["excluded"].items()}
        self._sorted = tuple(sorted(self.entries))
        self._abi = {}
        self.units = manifest["units"]
        # per-arch schedule choices (runtime/tuning.py); a manifest without them: every kind's default
        self.tuning = manifest.get("tuning") or {}

    @classmethod
    def load(cls, root: Optional[Path] = None) -> "Registry":
        """The manifest under ``root`` (default: the ``SKUFORGE_GENERATED`` setting, read now)."""
        if root is not None and not isinstance(root, (str, Path)):
            raise InvalidProblemError(f"root={root!r:.60}: the folder of a generated manifest (a path) is required")
        root = settings().generated if root is None else Path(root)
        path = root / "manifest.json"
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise UnsupportedError(f"no manifest at {path}: run `python -m codegen` to generate the kernels") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UnsupportedError(f"the manifest at {path} cannot be read ({type(e).__name__}: {e}); run "
                                   "`python -m codegen` to generate it again") from None
        return cls(manifest, root)

    # -- queries -------------------------------------------------------------------------
    def skus(self) -> list:
        return list(self._sorted)

    def query(self, pattern: str = "*", **fields) -> list:
        """SKUs whose string matches the glob and whose fields equal ``fields``."""
        if not isinstance(pattern, str):
            raise InvalidProblemError(f"pattern={pattern!r}: a glob on the SKU string is required")
        unknown = sorted(set(fields) - set(SKU_FIELDS))
        if unknown:
            raise InvalidProblemError(f"query: no SKU field named {', '.join(unknown)}; the fields are "
                                      f"{', '.join(SKU_FIELDS)}")
        out = []
        for sku in self._sorted:
            if not fnmatch.fnmatchcase(str(sku), pattern):
                continue
            if all(getattr(sku, k) == v for k, v in fields.items()):
                out.append(sku)
        return out

    def lookup(self, sku) -> KernelEntry:
        if not isinstance(sku, KernelSku):
            sku = KernelSku.parse(sku)
        entry = self.entries.get(sku)
        if entry is not None:
            return entry
        reason = self.excluded.get(sku)
        if reason:
            raise UnsupportedError(f"{sku} is not generated: {reason}")
        raise UnsupportedError(f"{sku} is not in the matrix; `python -m codegen list` shows what is")

    def select(self, *, category: str, op: str, scope=None, mode=None, element: str,
               aux_element=None, arch: Optional[int] = None, backend: Optional[str] = None) -> KernelSku:
        """The best generated SKU for a problem: matching fields, runnable on a device of compute
        capability ``arch`` (built for an arch ≤ it; an arch-specific SKU such as ``wgmma`` only on its
        own arch), preferring ``backend`` when given, then the newest arch, then tensor cores."""
        want = dict(category=category, op=op, scope=scope, mode=mode, element=element, aux_element=aux_element)
        if arch is not None and (not isinstance(arch, int) or isinstance(arch, bool)):
            raise InvalidProblemError(f"arch={arch!r}: a compute capability such as 90 (or None) is required")
        matches = [s for s in self.entries if all(getattr(s, k) == v for k, v in want.items())]
        if not matches:
            for sku, reason in sorted(self.excluded.items()):
                if all(getattr(sku, k) == v for k, v in want.items()):
                    raise UnsupportedError(f"{op} scope={scope} mode={mode} {element}->{aux_element}: {reason}")
            raise UnsupportedError(
                f"no kernel for {op} scope={scope} mode={mode} element={element} aux_element={aux_element}; "
                f"supported for {op}: " + ", ".join(sorted({f'{s.element}->{s.aux_element}' for s in self.entries if s.op == op})))
        if arch is not None:
            fit = [s for s in matches if s.runs_on(arch)]
            if not fit:
                raise UnsupportedError(f"{op} {element}->{aux_element} needs {min(s.arch for s in matches)}; the device is sm{arch}")
            theirs = sorted({s.target for s in matches if s.backend == backend and s not in fit})
            if backend is not None and theirs and not any(s.backend == backend for s in fit):
                raise UnsupportedError(f"{op} {element}->{aux_element}: the {backend!r} kernel is built for "
                                       f"{', '.join(theirs)} and runs only on such a device; the device is sm{arch}")
            matches = fit
        if backend is not None:
            fit = [s for s in matches if s.backend == backend]
            if not fit:
                raise UnsupportedError(f"{op} {element}->{aux_element} has no {backend!r} kernel; available: "
                                       + ", ".join(sorted({s.backend for s in matches})))
            matches = fit
        return max(matches, key=lambda s: (s.arch_number, BACKENDS.index(s.backend)))

    def abi(self, abi_id: str):
        """The parameter list ``abi_id`` of the manifest (its launch kind declares it) as a
        runtime.abi.Abi: names, packing format, slots."""
        a = self._abi.get(abi_id) if isinstance(abi_id, str) else None
        if a is None:
            if not isinstance(abi_id, str) or abi_id not in self.manifest["abi"]:
                raise InvalidProblemError(f"abi_id={abi_id!r:.80} is not a parameter list of the manifest "
                                          "(Plan(sku).abi(group) names a kernel's)")
            from .abi import Abi
            a = self._abi[abi_id] = Abi(abi_id, self.manifest["abi"][abi_id])
        return a

    # -- sources and kernels -------------------------------------------------------------------
    def unit_source(self, unit: str) -> str:
        if not isinstance(unit, str) or unit not in self.units:
            raise InvalidProblemError(f"unit={unit!r:.80} is not a translation unit of the manifest")
        return (self.root / unit).read_text()

    def source(self, sku) -> str:
        """The generated source of one kernel: its translation unit's prelude plus its own text, and
        the text of each SKU whose entry points it launches (launch metadata ``shares``)."""
        entry = self.lookup(sku)
        text = self.unit_source(entry.unit)
        # the shared helpers: the prelude and any family headers (each ends with "// ---- end of ...")
        prelude_end = text.rindex("// ---- end of ", 0, text.index("// SKU: "))
        prelude_end = text.index("\n", prelude_end) + 1
        hosts = dict.fromkeys((entry.launch.get("shares") or {}).values())
        return text[:prelude_end] + "".join("\n" + _section(text, s) for s in (str(entry.sku), *hosts))

    def kernel(self, sku, device: int = None):
        """The loaded ``cupy`` function of a SKU's main entry point on a device (compiled via the disk
        cache)."""
        from .device import check_device, driver
        entry = self.lookup(sku)
        return driver().load_function(self, entry.unit, entry.entry_point(),
                                      None if device is None else check_device(device))


def _section(text: str, sku: str) -> str:
    """The text of one SKU in its unit's source: from its ``// SKU:`` line to the next one."""
    start = text.index(f"// SKU: {sku}\n")
    nxt = text.find("// SKU: ", start + 1)
    return text[start: nxt if nxt >= 0 else len(text)].rstrip("\n") + "\n"


@lru_cache(maxsize=1)
def default_registry() -> Registry:
    return Registry.load()
