"""Packaging: the dependencies (floors that are releases, none unused), the README's test command
(the one CI runs), and the wheel: built from a copy of the tree, installed into a fresh venv, used
from another folder.

The fresh venv sees the test environment's dependencies (jinja2, numpy, cuda-bindings, ...) through a
``.pth`` line (their ``.pth`` hooks, such as an editable skuforge, are not run) and finds libnvrtc
through LD_LIBRARY_PATH; skuforge itself comes from the wheel only (checked)."""
import ast
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
SKU = "quantization/quantize/token/symmetric/f32/s8/sm80/simt/f32.acc-f32.det.stable"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list:
    project = _pyproject()
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    return [Requirement(r) for r in project["dependencies"] + extras]


# The first release of the line a floor is in, as the package index lists them: a floor under it names
# a release that does not exist (cupy-cuda13x 13.3: the CUDA 13 builds start at 13.6.0).
FIRST_OF_LINE = {("cupy-cuda13x", 13): "13.6.0", ("cuda-bindings", 13): "13.0.0",
                 ("nvidia-cuda-nvrtc", 13): "13.0.48", ("nvidia-cuda-cuobjdump", 13): "13.2.51",
                 ("nvidia-cuda-nvdisasm", 13): "13.2.51", ("pytest-xdist", 3): "3.0.2"}
CUDA_LINE = 13      # libnvrtc.so.13, which cuda-bindings 13 loads and cupy-cuda13x is built for
CUDA_PACKAGES = ("cupy-cuda13x", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm")


def test_dependency_floors_are_releases_and_what_is_tested_meets_them():
    for req in _requirements():
        name = canonicalize_name(req.name)
        (spec,) = [s for s in req.specifier if s.operator in (">=", "==")] or [None]
        assert spec is not None, f"{req}: every dependency names its floor (>=) or its release (==)"
        floor = Version(spec.version)
        first = FIRST_OF_LINE.get((name, floor.major))
        assert first is None or floor >= Version(first), f"{req}: the {floor.major}.x line starts at {first}"
        if name in CUDA_PACKAGES:
            assert floor.major == CUDA_LINE, f"{req}: not the CUDA {CUDA_LINE} line"
        try:
            installed = md.version(req.name)
        except md.PackageNotFoundError:
            continue                                  # an extra this environment does not install (plot)
        assert req.specifier.contains(installed, prereleases=True), f"{req}: the tested {installed} does not meet it"


# What skuforge imports from each direct dependency; a dependency that is not imported is a library
# the runtime loads (its file named here) or it is not a dependency of skuforge.
IMPORTED_AS = {"jinja2": "jinja2", "numpy": "numpy", "ml-dtypes": "ml_dtypes", "cupy-cuda13x": "cupy",
               "cuda-bindings": "cuda.bindings", "filelock": "filelock", "rich": "rich",
               "platformdirs": "platformdirs"}
LOADED_LIBRARY = {"nvidia-cuda-nvrtc": "libnvrtc.so"}     # cuda-bindings loads it (through cuda-pathfinder)


def _imports() -> set:
    names = set()
    for path in [*(ROOT / "runtime").rglob("*.py"), *(ROOT / "codegen").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_every_direct_dependency_is_used():
    imports = _imports()
    for text in _pyproject()["dependencies"]:
        name = canonicalize_name(Requirement(text).name)
        files = [str(f) for f in md.files(name) or ()]
        if name in LOADED_LIBRARY:
            assert any(LOADED_LIBRARY[name] in f for f in files), f"{name} does not ship {LOADED_LIBRARY[name]}"
            continue
        assert name in IMPORTED_AS, f"{name}: a direct dependency that skuforge neither imports nor loads"
        module = IMPORTED_AS[name]
        assert any(i == module or i.startswith(module + ".") for i in imports), f"no module imports {module} ({name})"
        folder = module.replace(".", "/")
        assert any(f.startswith(folder + "/") or f == folder + ".py" for f in files), f"{name} does not ship {module}"


def _readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    (cmd,) = [ln for ln in lines if ln.startswith('pip install -e ".[test]"')]
    return cmd


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    cmd = _readme_test_command()
    assert ci[-1] == cmd
    assert "python -m pytest" in cmd and "python -m codegen compile" in cmd
    # nothing installed beside it: PyTorch comes with the test extra
    assert [ln for ln in ci if ln.startswith(("pip ", "python -m pip"))] == ["python -m pip install -q --upgrade pip",
                                                                              cmd]
    assert any(canonicalize_name(Requirement(r).name) == "torch" for r in _pyproject()["optional-dependencies"]["test"])


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


@pytest.mark.slow
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
