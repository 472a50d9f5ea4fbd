"""Deploying without surprises (CPU): prebuilt kernels and cache hits without NVRTC, SKUFORGE_DISABLE_JIT,
the compile cache under faults (unwritable, missing, a file in its place, corrupt entries, a held lock,
orphan temporary files), typed errors for a missing toolchain / device / template, settings parsing."""
import errno
import fcntl
import json
import os
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import jinja2
import pytest

from runtime import compiler, config, device, errors

SRC = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] += 1.0f; }\n'
UNIT = "quantization/deploy_k.cu"
SKU = "quantization/quantize/token/symmetric/f32/s8/*"


@pytest.fixture(autouse=True)
def cache(tmp_path):
    compiler.reset_faults()
    with config.override(cache_dir=tmp_path / "cache", prebuilt_dir=None, disable_jit=False):
        yield tmp_path / "cache"
    compiler.reset_faults()


@pytest.fixture
def no_nvrtc(monkeypatch):
    """NVRTC made unavailable: loading the bindings raises (as where cuda-bindings / libnvrtc are absent)."""
    def missing():
        raise ImportError("No module named 'cuda.bindings' (test)")
    compiler._load_nvrtc.cache_clear()
    compiler.nvrtc_version.cache_clear()
    monkeypatch.setattr(compiler, "_load_nvrtc", missing)
    yield
    compiler.nvrtc_version.cache_clear()


# -- settings ---------------------------------------------------------------------------------------
def test_settings_new_variables_and_empty_cache_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = config.from_environ({"SKUFORGE_CACHE_DIR": "", "SKUFORGE_PREBUILT": "pre", "SKUFORGE_DISABLE_JIT": "1",
                             "SKUFORGE_LOCK_TIMEOUT": "7.5"})
    assert s.cache_dir == config.default_cache_dir() and s.cache_dir.is_absolute()
    assert s.prebuilt_dir == tmp_path / "pre" and s.disable_jit and s.lock_timeout == 7.5
    rel = config.from_environ({"SKUFORGE_CACHE_DIR": "rel/cache"})
    assert rel.cache_dir == tmp_path / "rel" / "cache"          # resolved once, not at each use
    d = config.from_environ({})
    assert d.prebuilt_dir is None and not d.disable_jit and d.lock_timeout == 120.0
    assert not config.from_environ({"SKUFORGE_DISABLE_JIT": "0"}).disable_jit


def test_every_setting_is_documented():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    import dataclasses
    for f in dataclasses.fields(config.Settings):
        assert f"`{f.metadata['env']}`" in doc, f.metadata["env"]


# -- NVRTC-free hits -----------------------------------------------------------------------------------
def test_cache_hit_needs_no_nvrtc(no_nvrtc, cache, monkeypatch):
    monkeypatch.undo()  # compile once with NVRTC
    first = compiler.compile_cached(SRC, UNIT, 80)
    assert not first.cached
    compiler._load_nvrtc.cache_clear()
    compiler.nvrtc_version.cache_clear()
    monkeypatch.setattr(compiler, "_load_nvrtc", lambda: (_ for _ in ()).throw(ImportError("gone")))
    hit = compiler.compile_cached(SRC, UNIT, 80)
    assert hit.cached and hit.origin == "cache" and hit.cubin == first.cubin
    assert compiler.entry_meta(hit.path)["nvrtc_version"]  # the NVRTC version is recorded inside the entry


def test_missing_nvrtc_is_a_typed_error_with_the_install_hint(no_nvrtc):
    with pytest.raises(errors.ToolchainUnavailableError, match="pip install cuda-bindings nvidia-cuda-nvrtc"):
        compiler.compile_cached(SRC, UNIT, 80)
    with pytest.raises(errors.ToolchainUnavailableError, match="SKUFORGE_PREBUILT"):
        compiler.nvrtc_compile(SRC, UNIT, 80)


def _prebuild(tmp_path, fill_cache=False):
    out = tmp_path / "prebuilt"
    args = [sys.executable, "-m", "codegen", "compile", "--arch", "sm_90", "--filter", SKU, "--jobs", "1",
            "--out", str(out)] + (["--fill-cache"] if fill_cache else [])
    env = {**os.environ, "SKUFORGE_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run(args, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def _unit():
    from runtime.registry import default_registry
    reg = default_registry()
    unit = reg.lookup(reg.query(SKU)[0]).unit
    return reg, unit, reg.unit_source(unit), tuple(reg.units[unit]["nvrtc_options"])


def test_compile_out_writes_an_index_and_the_runtime_loads_it_without_nvrtc(tmp_path, no_nvrtc, cache):
    out = _prebuild(tmp_path, fill_cache=True)
    index = json.loads((out / "index.json").read_text())
    reg, unit, source, options = _unit()
    (entry,) = index["entries"]
    assert entry["unit"] == unit and entry["arch"] == 90 and entry["file"].startswith("sm_90/")
    assert entry["cache_key"] == compiler.cache_key(source, 90, options)
    assert entry["nvrtc_options"][0] == "--gpu-architecture=sm_90" and entry["nvrtc_version"]
    assert {"source_sha256", "cubin_sha256", "skus", "generator"} <= set(entry)
    cubin = (out / entry["file"]).read_bytes()
    assert cubin[:4] == b"\x7fELF"
    with config.override(prebuilt_dir=out, disable_jit=True, cache_dir=tmp_path / "empty"):
        res = compiler.compile_cached(source, unit, 90, options)
    assert res.origin == "prebuilt" and res.cubin == cubin
    # --fill-cache: the runtime cache alone (no prebuilt folder) serves the same bytes, without NVRTC
    with config.override(disable_jit=True):
        res = compiler.compile_cached(source, unit, 90, options)
    assert res.origin == "cache" and res.cubin == cubin


def test_disable_jit_names_the_unit_the_arch_and_the_command(tmp_path, no_nvrtc):
    reg, unit, source, options = _unit()
    with config.override(disable_jit=True, prebuilt_dir=tmp_path / "nothing-here"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", errors.CacheWarning)  # the prebuilt folder has no index
            with pytest.raises(errors.KernelNotPrebuiltError) as e:
                compiler.compile_cached(source, unit, 90, options, skus=reg.units[unit]["skus"])
    msg = str(e.value)
    assert unit in msg and "sm_90" in msg and "python -m codegen compile --arch sm_90 --filter" in msg
    assert reg.units[unit]["skus"][0] in msg and "--out DIR" in msg


def test_prebuilt_file_not_matching_its_index_is_ignored_with_a_warning(tmp_path):
    out = tmp_path / "pre"
    compiler.write_prebuilt(out, [{"unit": UNIT, "arch": 80, "source": SRC, "options": (), "cubin": b"\x7fELFxx",
                                   "skus": []}])
    (entry,) = json.loads((out / "index.json").read_text())["entries"]
    (out / entry["file"]).write_bytes(b"tampered")
    with config.override(prebuilt_dir=out):
        with pytest.warns(errors.CacheWarning, match="does not match"):
            res = compiler.compile_cached(SRC, UNIT, 80)
    assert res.origin == "compiled"


# -- the cache under faults ------------------------------------------------------------------------------
def _one_warning(record, match):
    hits = [w for w in record if issubclass(w.category, errors.CacheWarning)]
    assert len(hits) == 1, [str(w.message) for w in hits]
    assert match in str(hits[0].message)


def _twice_in_memory(match):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = compiler.compile_cached(SRC, UNIT, 80)
        b = compiler.compile_cached(SRC, UNIT, 80)
    _one_warning(rec, match)
    assert a.path is None and not a.cached
    assert b.origin == "memory" and b.cubin == a.cubin
    return a


def test_read_only_cache_falls_back_to_memory_with_one_warning(monkeypatch):
    # running as root, chmod does not stop writes: the filesystem's refusal is simulated
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(compiler.os, "replace", refuse)
    _twice_in_memory("Read-only file system")


def test_unwritable_cache_dir_falls_back_to_memory(monkeypatch):
    def refuse(self, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))
    monkeypatch.setattr(Path, "mkdir", refuse)
    _twice_in_memory("Permission denied")


def test_file_in_place_of_the_cache_dir(cache):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("not a folder")
    _twice_in_memory(str(cache))


def test_cache_dir_under_a_file_and_a_missing_parent(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with config.override(cache_dir=blocker / "sub" / "cache"):
        _twice_in_memory("not usable")
    compiler.reset_faults()
    with config.override(cache_dir=tmp_path / "a" / "b" / "c"):  # missing parents are created
        with warnings.catch_warnings():
            warnings.simplefilter("error", errors.CacheWarning)
            res = compiler.compile_cached(SRC, UNIT, 80)
    assert res.path is not None and res.path.is_file()


def test_corrupt_entry_rebuilt_with_one_warning():
    first = compiler.compile_cached(SRC, UNIT, 80)
    first.path.write_bytes(b"garbage")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        again = compiler.compile_cached(SRC, UNIT, 80)
        third = compiler.compile_cached(SRC, UNIT, 80)
    _one_warning(rec, "corrupt compile-cache entry")
    assert not again.cached and again.cubin == first.cubin and third.origin == "cache"


def test_lock_wait_is_bounded_and_names_the_lock_file():
    key = compiler.cache_key(SRC, 80, ())
    path = compiler._entry_path(UNIT, 80, key)
    path.parent.mkdir(parents=True)
    lock = str(path) + ".lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process holding the entry's lock
    try:
        with config.override(lock_timeout=0.3):
            t0 = time.perf_counter()
            with pytest.raises(errors.CacheLockTimeoutError, match=lock.replace(".", r"\.")):
                compiler.compile_cached(SRC, UNIT, 80)
            assert time.perf_counter() - t0 < 10
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def test_orphan_temporary_files_are_cleaned_and_not_counted(cache):
    folder = cache / compiler.CACHE_LAYOUT / "sm_80"
    folder.mkdir(parents=True)
    old, new = folder / ".tmp-old.cubin", folder / ".tmp-new.cubin"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    past = time.time() - compiler.ORPHAN_AGE_S - 60
    os.utime(old, (past, past))
    compiler.compile_cached(SRC, UNIT, 80)
    assert not old.exists() and new.exists()  # a recent one may belong to a live writer
    assert [p.name for p in folder.iterdir() if compiler.is_entry(p)] == [f"{compiler._stem(UNIT)}-" + p.name.split("-")[-1]
                                                                        for p in folder.glob("quantization_*.cubin")]
    res = subprocess.run([sys.executable, "-m", "codegen", "status"], capture_output=True, text=True,
                         env={**os.environ, "SKUFORGE_CACHE_DIR": str(cache), "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    assert "sm_80: 1 cubins" in res.stdout and "1 temporary files" in res.stdout


# -- typed errors ------------------------------------------------------------------------------------------
class _CudaRuntimeError(RuntimeError):
    pass


def _fake_cupy(err):
    def raise_(*a):
        raise _CudaRuntimeError(err)
    runtime_ns = types.SimpleNamespace(CUDARuntimeError=_CudaRuntimeError, getDevice=raise_,
                                       getDeviceProperties=raise_)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime_ns))


@pytest.mark.parametrize("err", ["cudaErrorInsufficientDriver: CUDA driver version is insufficient",
                                 "cudaErrorNoDevice: no CUDA-capable device is detected"])
def test_no_gpu_is_device_required(monkeypatch, err):
    monkeypatch.setattr(device, "cupy", lambda: _fake_cupy(err))
    device.properties.cache_clear()
    with pytest.raises(errors.DeviceRequiredError, match=err.split(":")[0]):
        device.current_device()
    with pytest.raises(errors.DeviceRequiredError):
        device.properties(0)
    from runtime.registry import default_registry
    reg = default_registry()
    with pytest.raises(errors.DeviceRequiredError, match="NVIDIA GPU"):
        reg.kernel(reg.query(SKU)[0])
    device.properties.cache_clear()


@pytest.fixture
def templates(tmp_path, monkeypatch):
    from codegen import render
    folder = tmp_path / "templates"
    folder.mkdir()
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render, "environment", lambda: env)
    monkeypatch.setattr(render, "TEMPLATES", folder)
    return folder


def test_template_not_found_is_typed(templates):
    from codegen import render
    with pytest.raises(errors.TemplateError, match="'missing.cu.j2' not found"):
        render._render("missing.cu.j2")


def test_template_syntax_error_names_file_and_line(templates):
    from codegen import render
    (templates / "bad.cu.j2").write_text("line one\nline two\n{% if %}\n")
    with pytest.raises(errors.TemplateError, match=r"bad\.cu\.j2:3: template syntax error"):
        render._render("bad.cu.j2")


def test_template_undefined_names_file_and_line(templates):
    from codegen import render
    (templates / "undef.cu.j2").write_text("a\nb\n{{ k.nope }}\n")
    with pytest.raises(errors.TemplateError, match=r"undef\.cu\.j2:3: UndefinedError") as e:
        render._render("undef.cu.j2", k={})
    assert "nope" in str(e.value)


def test_generator_refuses_to_rewrite_an_installed_copy(monkeypatch):
    from codegen import manifest
    monkeypatch.setattr(manifest, "installed", lambda: True)
    with pytest.raises(errors.InstalledTreeError, match="--out DIR"):
        manifest.build()
