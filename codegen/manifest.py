"""The manifest: SKU → translation unit, symbol, launch metadata and source sha256.

``build()`` renders the matrix into ``generated/``; it writes only files whose bytes
changed and removes generated files no cell produces any more. ``stale()`` lists what a
build would change, which is what ``python -m codegen check`` (and CI) fail on.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import installed
from runtime.errors import InstalledTreeError

from . import GENERATOR_VERSION
from .matrix import FAMILIES, cells
from .render import ROOT, prelude, render, sha256

GENERATED = ROOT / "generated"
MANIFEST = "manifest.json"
SCHEMA = 1


def expected_files(families=FAMILIES) -> dict:
    """{path relative to generated/: text} for the whole matrix, manifest included."""
    all_cells = cells(families)
    units = render(all_cells)
    pre = prelude()
    files, kernels, unit_meta, abi = {}, {}, {}, {}
    for unit in units:
        text = unit.text(pre)
        files[unit.path] = text
        unit_meta[unit.path] = {
            "family": unit.family.name,
            "sha256": sha256(text),
            "nvrtc_options": list(unit.family.nvrtc_options),
            "min_arch": min(k.cell.sku.arch for k in unit.kernels),
            "skus": [str(k.cell.sku) for k in unit.kernels],
        }
        for k in unit.kernels:
            kernels[str(k.cell.sku)] = {
                "unit": unit.path,
                "symbol": k.cell.sku.symbol,
                "family": unit.family.name,
                "sha256": k.sha256,
                "launch": k.launch,
            }
            abi.update(k.abi)
    excluded = {str(c.sku): {"family": c.family.name, "reason": c.reason}
                for c in all_cells if not c.generated}
    manifest = {
        "schema": SCHEMA,
        "generator": f"skuforge-codegen {GENERATOR_VERSION}",
        "counts": {"generated": len(kernels), "excluded": len(excluded), "units": len(units)},
        "kernels": kernels,
        "abi": abi,           # parameter lists of the entry points (codegen/abi.py), by id
        "excluded": excluded,
        "units": unit_meta,
    }
    files[MANIFEST] = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    return files


def _on_disk(root: Path) -> dict:
    out = {}
    if root.exists():
        for p in sorted(root.rglob("*")):
            if p.is_file() and (p.suffix == ".cu" or p.name == MANIFEST):
                out[p.relative_to(root).as_posix()] = p
    return out


@dataclass
class BuildReport:
    written: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    unchanged: int = 0
    manifest: dict = field(default_factory=dict)


def stale(root: Path = GENERATED, families=FAMILIES) -> list:
    """Paths a build would write or remove (empty when generated/ is up to date)."""
    want = expected_files(families)
    have = _on_disk(root)
    out = [p for p, text in want.items()
           if p not in have or have[p].read_bytes() != text.encode()]
    out += [f"{p} (not produced by the matrix)" for p in have if p not in want]
    return sorted(out)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build(root: Path = None, families=FAMILIES) -> BuildReport:
    """Render into ``root`` (default ``generated/`` of the source checkout). An installed copy (a
    wheel) is never rewritten in place: :class:`InstalledTreeError` unless ``root`` is given
    (``python -m codegen build --out DIR``)."""
    if root is None:
        if installed():
            raise InstalledTreeError(
                f"skuforge is installed as a package ({GENERATED} is its packaged copy, not a source checkout): the "
                f"generator does not rewrite installed files. Render elsewhere with `python -m codegen build --out DIR`, "
                f"or work in a source checkout (`pip install -e .`)")
        root = GENERATED
    root = Path(root)
    want = expected_files(families)
    have = _on_disk(root)
    report = BuildReport(manifest=json.loads(want[MANIFEST]))
    for path, text in want.items():
        data = text.encode()
        if path in have and have[path].read_bytes() == data:
            report.unchanged += 1
            continue
        _write_atomic(root / path, data)
        report.written.append(path)
    for path, p in have.items():
        if path not in want:
            p.unlink()
            report.removed.append(path)
    return report
