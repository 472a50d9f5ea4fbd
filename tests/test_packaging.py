"""The wheel: built from a copy of the tree, installed into a fresh venv, used from another folder.

The fresh venv sees the test environment's dependencies (jinja2, numpy, cuda-bindings, ...) through a
``.pth`` line (their ``.pth`` hooks, such as an editable skuforge, are not run) and finds libnvrtc
through LD_LIBRARY_PATH; skuforge itself comes from the wheel only (checked)."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SKU = "quantization/quantize/token/symmetric/f32/s8/sm80/simt/f32.acc-f32.det.stable"


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    return res


def _modern_setuptools() -> bool:
    try:
        import setuptools
        return int(setuptools.__version__.split(".")[0]) >= 77
    except Exception:  # noqa: BLE001
        return False


def test_wheel_installs_and_works_from_another_folder(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".venv", "_data")
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("codegen", "runtime", "templates", "generated"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    dist = tmp_path / "dist"
    # an isolated build fetches setuptools>=77 (SPDX license metadata) from the index; skip that when present
    isolation = ["--no-build-isolation"] if _modern_setuptools() else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(dist), str(src)])
    (wheel,) = dist.glob("skuforge-*.whl")
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    assert "runtime/_data/generated/manifest.json" in names
    assert "runtime/_data/templates/common/prelude.cuh" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_skuforge_test_deps.pth").write_text("".join(d + "\n" for d in sorted(deps)))
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)]
         if _pip_has_python_option() else
         [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)])

    from cuda.pathfinder import load_nvidia_dynamic_lib
    nvrtc_dir = os.path.dirname(load_nvidia_dynamic_lib("nvrtc").abs_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SKUFORGE_"))}
    env.update(SKUFORGE_CACHE_DIR=str(tmp_path / "cache"), COLUMNS="200",
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, [nvrtc_dir, env.get("LD_LIBRARY_PATH")])))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def cli(*args, ok=True):
        res = subprocess.run([str(py), "-m", "codegen", *args], capture_output=True, text=True, cwd=elsewhere,
                             env=env)
        if ok:
            assert res.returncode == 0, f"{args}\n{res.stdout}\n{res.stderr}"
        return res

    where = _run([str(py), "-c", "import runtime, codegen; print(runtime.__file__); print(codegen.__file__)"],
                 cwd=elsewhere, env=env).stdout.split()
    assert all(p.startswith(str(site)) for p in where), where  # from the wheel, not the source tree
    assert SKU in cli("list").stdout.split()
    assert "// SKU: " + SKU in cli("show", SKU).stdout
    out = cli("compile", "--arch", "sm_90", "--filter", SKU, "--jobs", "1", "--out", str(tmp_path / "pre")).stdout
    assert "sm_90: 1 units, 1 kernels compiled" in out
    assert (tmp_path / "pre" / "index.json").is_file()
    assert "installed" in cli("--version").stdout
    assert "up to date" in cli("check").stdout
    assert "cache" in cli("status").stdout
    refused = cli(ok=False)  # the generator never rewrites the installed copy
    assert refused.returncode == 2 and "InstalledTreeError" in refused.stderr
    rendered = cli("build", "--out", str(tmp_path / "gen"))
    assert (tmp_path / "gen" / "manifest.json").read_bytes() == (ROOT / "generated" / "manifest.json").read_bytes(), \
        rendered.stdout


def _pip_has_python_option() -> bool:
    res = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    try:
        major, minor = (int(x) for x in res.stdout.split()[1].split(".")[:2])
    except (IndexError, ValueError):
        return False
    return (major, minor) >= (22, 3)
