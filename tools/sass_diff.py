"""The machine code of two generated trees, kernel by kernel: whether a change to the templates or the
generator changed what NVRTC makes of them.

    python tools/sass_diff.py --base main                      # the working tree's generated/ against main's
    python tools/sass_diff.py --base HEAD~3 --arch sm_80,sm_90 --filter 'quantization/quantize_*'

Every unit present in both trees whose source differs (every unit, with ``--all``) is compiled from
each tree's source with its own NVRTC options by this machine's NVRTC, disassembled with cuobjdump
(the ``nvidia-cuda-cuobjdump`` wheel of the ``test`` extra) and compared kernel by kernel, with
instruction offsets and encodings dropped. A kernel whose machine code is unchanged runs what it ran
before: a restructuring of the templates that changes no kernel needs no new measurement, though
the audit still asks for a verification at the new source hashes (docs/audit.md). One line per unit
that changed; exit 0 when every kernel is the same, 1 when one differs or is missing, 2 on a bad
argument.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.nvrtc import builds_for, nvrtc_compile  # noqa: E402

_OFFSET = re.compile(r"/\*[0-9a-f]{4,}\*/")          # /*0010*/: the instruction's offset
_ENCODING = re.compile(r"/\* 0x[0-9a-f]{16} \*/")      # /* 0x...*/: its encoding


def cuobjdump() -> str:
    """The cuobjdump of the nvidia-cuda-cuobjdump wheel, else one on the PATH."""
    try:
        import nvidia.cu13
        for base in nvidia.cu13.__path__:
            cand = Path(base) / "bin" / "cuobjdump"
            if cand.is_file():
                return str(cand)
    except ImportError:
        pass
    tool = shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit("error: no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    return tool


def sass(cubin: bytes, tool: str) -> dict:
    """{kernel symbol: its instructions, one a line} of a cubin, offsets and encodings dropped."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "unit.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([tool, "-sass", str(path)], check=True, capture_output=True, text=True).stdout
    out = {}
    for part in text.split("Function : ")[1:]:
        name, _, body = part.partition("\n")
        lines = (_ENCODING.sub("", _OFFSET.sub("", line)).strip() for line in body.splitlines())
        out[name.strip()] = [line for line in lines if line and not line.startswith(".")]
    return out


def compare(old: dict, new: dict) -> dict:
    """{kernel: "same" | "differs (old -> new instructions)" | "only in the old tree" | "only in the new
    tree"} of two :func:`sass` results."""
    out = {}
    for name in sorted(set(old) | set(new)):
        if name not in new:
            out[name] = "only in the old tree"
        elif name not in old:
            out[name] = "only in the new tree"
        else:
            out[name] = "same" if old[name] == new[name] else f"differs ({len(old[name])} -> {len(new[name])} instructions)"
    return out


def _job(job) -> tuple:
    unit, arch, old_src, old_opts, new_src, new_opts, tool = job
    old = sass(nvrtc_compile(old_src, unit, arch, tuple(old_opts)), tool)
    new = sass(nvrtc_compile(new_src, unit, arch, tuple(new_opts)), tool)
    return unit, arch, compare(old, new)


def _git_show(rev: str, path: str) -> str:
    got = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if got.returncode:
        raise SystemExit(f"error: --base {rev!r}: git show {rev}:{path} failed: {got.stderr.strip()}")
    return got.stdout


def jobs(base: str, archs, pattern: str, every: bool, tool: str) -> list:
    """The (unit, arch, old source and options, new source and options) to compare."""
    old_units = json.loads(_git_show(base, "generated/manifest.json"))["units"]
    new_units = json.loads((ROOT / "generated" / "manifest.json").read_text())["units"]
    out = []
    for unit in sorted(set(old_units) & set(new_units)):
        if not fnmatch.fnmatchcase(unit, pattern):
            continue
        if not every and old_units[unit]["sha256"] == new_units[unit]["sha256"]:
            continue
        old_src = _git_show(base, f"generated/{unit}")
        new_src = (ROOT / "generated" / unit).read_text()
        lowest = min(int(u[unit]["min_arch"].removeprefix("sm")) for u in (old_units, new_units))
        for arch in archs:
            if arch >= lowest and builds_for(new_units[unit]["nvrtc_options"], arch):
                out.append((unit, arch, old_src, old_units[unit]["nvrtc_options"], new_src,
                            new_units[unit]["nvrtc_options"], tool))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision whose generated/ is the old tree")
    ap.add_argument("--arch", default="sm_90", help="targets, e.g. sm_80,sm_90 (default sm_90)")
    ap.add_argument("--filter", default="*", help="glob on the unit path, e.g. 'moe/*'")
    ap.add_argument("--all", action="store_true", help="compare the units whose source is unchanged too")
    ap.add_argument("--jobs", type=int, default=2, help="NVRTC processes (default 2)")
    args = ap.parse_args(argv)
    try:
        archs = [int(a.strip().removeprefix("sm_")) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        print(f"error: --arch {args.arch!r}: expected e.g. sm_80,sm_90", file=sys.stderr)
        return 2
    work = jobs(args.base, archs, args.filter, args.all, cuobjdump())
    if not work:
        print("no unit to compare: no source of the selection differs (--all compares them anyway)")
        return 0
    changed = kernels = 0
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for unit, arch, result in pool.map(_job, work):
            kernels += len(result)
            diff = {k: v for k, v in result.items() if v != "same"}
            changed += len(diff)
            state = f"{len(diff)} of {len(result)} kernels changed" if diff else f"{len(result)} kernels, same"
            print(f"sm_{arch} {unit}: {state}", flush=True)
            for k, v in diff.items():
                print(f"    {k}: {v}")
    print(f"{len(work)} compiles, {kernels} kernels compared: {changed} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
