"""The manifest: SKU → translation unit, symbol, launch metadata and source sha256.

``build()`` renders the matrix into ``generated/`` (or ``--out DIR``); it writes only files whose
bytes changed and removes the units the previous manifest there listed that no cell produces any
more, and nothing else (a file no manifest listed, anything outside the folder). ``stale()`` lists
what a build would change, which is what ``python -m codegen check`` (and CI) fail on.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from runtime.config import installed
from runtime.errors import InstalledTreeError

from runtime.axes import GENERATOR_VERSION

from .families import FAMILIES
from .matrix import cells
from .render import ROOT, prelude, render, sha256

GENERATED = ROOT / "generated"
MANIFEST = "manifest.json"
SCHEMA = 1
FAMILY_DIR = Path(__file__).resolve().parent / "families"


def tuning_folder(family: str) -> Path:
    """Where a family keeps its per-arch tuning tables, ``<arch>.json`` (docs/tuning.md)."""
    return FAMILY_DIR / family / "tuning"


def tuning_tables(families=FAMILIES, folder=tuning_folder) -> dict:
    """{arch: {family: {"gpu", "commit", "choices": {key: {bucket: schedule}}}}} of every family's
    tables (``folder(name)``): what the manifest carries for runtime/tuning.py (the measured times stay
    in the tables)."""
    out: dict = {}
    for fam in families:
        for path in sorted(Path(folder(fam.name)).glob("sm*.json")):
            table = json.loads(path.read_text())
            out.setdefault(path.stem, {})[fam.name] = {
                "gpu": table["gpu"], "commit": table["commit"],
                "choices": {key: {b: e["schedule"] for b, e in sorted(by_bucket.items())}
                            for key, by_bucket in sorted(table["entries"].items())}}
    return {arch: out[arch] for arch in sorted(out)}


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
            "family": unit.kernels[0].cell.family.name,
            "block": unit.block.name,
            "sha256": sha256(text),
            "nvrtc_options": list(unit.block.nvrtc_options),
            "min_arch": min(k.cell.sku.arch for k in unit.kernels),
            "skus": [str(k.cell.sku) for k in unit.kernels],
        }
        for k in unit.kernels:
            kernels[str(k.cell.sku)] = {
                "unit": unit.path,
                "symbol": k.cell.sku.symbol,
                "family": k.cell.family.name,
                "block": unit.block.name,
                "sha256": k.sha256,
                "launch": k.launch,
            }
            abi.update(k.abi)
    excluded = {str(c.sku): {"family": c.family.name, "block": c.block.name, "reason": c.reason}
                for c in all_cells if not c.generated}
    manifest = {
        "schema": SCHEMA,
        "generator": f"skuforge-codegen {GENERATOR_VERSION}",
        "counts": {"generated": len(kernels), "excluded": len(excluded), "units": len(units)},
        "kernels": kernels,
        "abi": abi,           # parameter lists of the entry points (codegen/abi.py), by id
        "excluded": excluded,
        "units": unit_meta,
        "tuning": tuning_tables(families),    # schedule choices per arch and family (runtime/tuning.py)
    }
    files[MANIFEST] = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    return files


@dataclass
class BuildReport:
    written: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    unchanged: int = 0
    manifest: dict = field(default_factory=dict)


def _written_by_build(root: Path, rel) -> bool:
    """Whether ``rel`` (a unit an earlier build's manifest lists) names a generated source this build
    may remove: a relative ``.cu`` path without ``..``, a regular file (not a symlink) inside ``root``."""
    if not isinstance(rel, str):
        return False
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel or ":" in rel or pure.suffix != ".cu":
        return False
    path = root / rel
    return (path.is_file() and not path.is_symlink()
            and path.parent.resolve().is_relative_to(Path(root).resolve()))


def _previous_units(root: Path) -> list:
    """The units the manifest already in ``root`` lists (what an earlier build wrote there); none
    where there is no manifest or it is not a skuforge manifest (with a warning: nothing is removed)."""
    path = root / MANIFEST
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return []
    except (OSError, ValueError, RecursionError) as e:
        data = e
    ours = (isinstance(data, dict) and data.get("schema") == SCHEMA and isinstance(data.get("units"), dict)
            and str(data.get("generator", "")).startswith("skuforge-codegen "))
    if not ours:
        warnings.warn(f"{path} is not a skuforge manifest ({str(data)[:80]}): it is replaced, and no file is "
                      f"removed from {root}", UserWarning, stacklevel=3)
        return []
    return list(data["units"])


def orphans(root: Path, want: dict) -> list:
    """Generated sources a build removes from ``root``: units the manifest there lists that the matrix
    no longer produces. A file that manifest does not list is never touched."""
    return sorted(u for u in _previous_units(root) if u not in want and _written_by_build(root, u))


def _differs(path: Path, text: str) -> bool:
    return not path.is_file() or path.read_bytes() != text.encode()


def stale(root: Path = GENERATED, families=FAMILIES) -> list:
    """Paths a build would write or remove (empty when generated/ is up to date)."""
    root = Path(root)
    want = expected_files(families)
    out = [p for p, text in want.items() if _differs(root / p, text)]
    out += [f"{p} (no longer produced by the matrix)" for p in orphans(root, want)]
    return sorted(out)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build(root: Path = None, families=FAMILIES) -> BuildReport:
    """Render into ``root`` (default ``generated/`` of the source checkout). An installed copy (a
    wheel) is never rewritten in place: :class:`InstalledTreeError` unless ``root`` is given
    (``python -m codegen build --out DIR``). Removes only :func:`orphans`: files the previous
    manifest in ``root`` listed."""
    if root is None:
        if installed():
            raise InstalledTreeError(
                f"skuforge is installed as a package ({GENERATED} is its packaged copy, not a source checkout): the "
                f"generator does not rewrite installed files. Render elsewhere with `python -m codegen build --out DIR`, "
                f"or work in a source checkout (`pip install -e .`)")
        root = GENERATED
    root = Path(root)
    want = expected_files(families)
    report = BuildReport(manifest=json.loads(want[MANIFEST]))
    removed = orphans(root, want)          # read the previous manifest before it is replaced
    for path, text in want.items():
        if not _differs(root / path, text):
            report.unchanged += 1
            continue
        _write_atomic(root / path, text.encode())
        report.written.append(path)
    for path in removed:
        (root / path).unlink()
        report.removed.append(path)
    return report
