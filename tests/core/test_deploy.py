"""Deploying without surprises (CPU): prebuilt kernels and cache hits without NVRTC, SKUFORGE_DISABLE_JIT,
the prebuilt index validated, the compile cache under faults (unwritable, missing, a file or a directory
in its place, corrupt entries, a held lock, orphan temporary files), what `--out` commands delete,
typed errors for a missing toolchain / device / template, settings parsing."""
import errno
import hashlib
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

from runtime import compiler, config, cuda_driver, device, errors, nvrtc

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
    nvrtc._load_nvrtc.cache_clear()
    compiler.nvrtc_version.cache_clear()
    monkeypatch.setattr(nvrtc, "_load_nvrtc", missing)
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


@pytest.mark.skipif(sys.platform != "linux", reason="the XDG layout is Linux's")
def test_the_default_cache_folder_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.default_cache_dir() == tmp_path / "xdg" / "skuforge"
    assert config.from_environ({}).cache_dir == tmp_path / "xdg" / "skuforge"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert config.default_cache_dir() == Path.home() / ".cache" / "skuforge"


def test_every_setting_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    import dataclasses
    for f in dataclasses.fields(config.Settings):
        assert f"`{f.metadata['env']}`" in doc, f.metadata["env"]


# -- NVRTC-free hits -----------------------------------------------------------------------------------
def test_cache_hit_needs_no_nvrtc(no_nvrtc, cache, monkeypatch):
    monkeypatch.undo()  # compile once with NVRTC
    first = compiler.compile_cached(SRC, UNIT, 80)
    assert not first.cached
    nvrtc._load_nvrtc.cache_clear()
    compiler.nvrtc_version.cache_clear()
    monkeypatch.setattr(nvrtc, "_load_nvrtc", lambda: (_ for _ in ()).throw(ImportError("gone")))
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


# -- the prebuilt index, validated ---------------------------------------------------------------------
def _index(out, entries, **top):
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.json").write_text(json.dumps({"schema": 1, "generator": compiler.GENERATOR_VERSION,
                                                "entries": entries, **top}))


def _entry(file, cubin=b"", **fields):
    key = compiler.cache_key(SRC, 80, ())
    return {"unit": UNIT, "arch": 80, "cache_key": key, "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
            "file": file, **fields}


def _ignored(out, match):
    """With JIT off, a lookup through an ignored index is KernelNotPrebuiltError saying why; one warning."""
    with config.override(prebuilt_dir=out, disable_jit=True), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with pytest.raises(errors.KernelNotPrebuiltError, match="ignored"):
            compiler.compile_cached(SRC, UNIT, 80)
        with pytest.raises(errors.KernelNotPrebuiltError):
            compiler.compile_cached(SRC, UNIT, 80)
    assert match in _one_warning(rec, "is ignored")
    state = compiler.prebuilt_status(out)
    assert state.entries == 0 and match in state.problem


@pytest.mark.parametrize("index, match", [
    ({"entries": 5}, "schema None"),
    ([5], "not a JSON object but list"),
    (None, "not a JSON object but NoneType"),
    ({"schema": 2, "generator": compiler.GENERATOR_VERSION, "entries": []}, "schema 2"),
    ({"schema": True, "generator": compiler.GENERATOR_VERSION, "entries": []}, "schema True"),
    ({"schema": 1, "generator": "9.9.9", "entries": []}, "generator '9.9.9'"),
    ({"schema": 1, "generator": compiler.GENERATOR_VERSION, "entries": 5}, "entries is 5"),
    ({"schema": 1, "generator": compiler.GENERATOR_VERSION, "entries": [5]}, "entries[0]: 5 is not an object"),
    ({"schema": 1, "generator": compiler.GENERATOR_VERSION, "entries": [{"unit": UNIT}]}, "arch is None"),
])
def test_a_malformed_or_foreign_index_is_ignored_with_one_warning(tmp_path, index, match):
    out = tmp_path / "pre"
    out.mkdir()
    (out / "index.json").write_text(json.dumps(index))
    _ignored(out, match)


@pytest.mark.parametrize("field, value, match", [
    ("file", None, "file is None, not a str"), ("arch", "80", "arch is '80', not an int"),
    ("cache_key", "zz", "not a sha256"), ("file", "sm_80/elsewhere.cubin", "is not 'sm_80/quantization_deploy_k-"),
])
def test_an_index_entry_with_a_wrong_field_makes_the_index_ignored(tmp_path, field, value, match):
    entry = _entry(compiler.prebuilt_file(UNIT, 80, compiler.cache_key(SRC, 80, ())))
    _index(tmp_path / "pre", [{**entry, field: value}])
    _ignored(tmp_path / "pre", match)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_an_index_naming_a_file_outside_its_folder_serves_nothing(tmp_path, where):
    victim = tmp_path / "victim"
    victim.write_bytes(b"not a kernel")
    file = "../../victim" if where == "relative" else str(victim)
    _index(tmp_path / "a" / "pre", [_entry(file, victim.read_bytes())])   # its sha256 matches the victim
    _ignored(tmp_path / "a" / "pre", "is not 'sm_80/")


def test_a_prebuilt_file_linked_out_of_its_folder_is_ignored(tmp_path):
    out = tmp_path / "pre"
    compiler.write_prebuilt(out, [{"unit": UNIT, "arch": 80, "source": SRC, "options": (), "cubin": b"\x7fELFxx",
                                   "skus": []}])
    (entry,) = json.loads((out / "index.json").read_text())["entries"]
    outside = tmp_path / "outside.cubin"
    outside.write_bytes(b"\x7fELFxx")                                   # same bytes: only the place is wrong
    (out / entry["file"]).unlink()
    (out / entry["file"]).symlink_to(outside)
    with config.override(prebuilt_dir=out, disable_jit=True):
        with pytest.warns(errors.CacheWarning, match="outside"):
            with pytest.raises(errors.KernelNotPrebuiltError):
                compiler.compile_cached(SRC, UNIT, 80)
    (out / entry["file"]).unlink()
    (out / entry["file"]).symlink_to(out / "inside.bin")                # a link inside the folder is fine
    (out / "inside.bin").write_bytes(b"\x7fELFxx")
    with config.override(prebuilt_dir=out, disable_jit=True):
        assert compiler.compile_cached(SRC, UNIT, 80).cubin == b"\x7fELFxx"


def test_an_ignored_index_falls_back_to_the_compiler(tmp_path):
    _index(tmp_path / "pre", 5)
    with config.override(prebuilt_dir=tmp_path / "pre"), pytest.warns(errors.CacheWarning, match="is ignored"):
        res = compiler.compile_cached(SRC, UNIT, 80)
    assert res.origin == "compiled" and res.cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("text", ['{"entries": 5}', "null", '{"schema": 1, "generator": "0.1.0", "entries": [{}]}',
                                  "{not json"])
def test_status_reports_a_bad_prebuilt_index_without_a_traceback(tmp_path, text):
    out = tmp_path / "pre"
    out.mkdir()
    (out / "index.json").write_text(text)
    assert "ignored" in str(compiler.prebuilt_status(out))
    res = subprocess.run([sys.executable, "-m", "codegen", "status"], capture_output=True, text=True,
                         env={**os.environ, "SKUFORGE_PREBUILT": str(out), "SKUFORGE_CACHE_DIR": str(tmp_path / "c"),
                              "COLUMNS": "200"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "0 entries" in res.stdout


# -- what --out commands delete ---------------------------------------------------------------------------
def _item(source=SRC, unit=UNIT):
    return {"unit": unit, "arch": 80, "source": source, "options": (), "cubin": b"\x7fELF" + source.encode(),
            "skus": []}


def test_compile_out_replaces_a_units_previous_cubin_and_keeps_other_files(tmp_path):
    out = tmp_path / "pre"
    first = compiler.write_prebuilt(out, [_item()])
    (old,) = json.loads(first.read_text())["entries"]
    (out / "sm_80" / "mine.cubin").write_bytes(b"mine")                 # not listed in the index
    compiler.write_prebuilt(out, [_item(SRC.replace("1.0f", "5.0f"))])
    (new,) = json.loads(first.read_text())["entries"]
    assert new["file"] != old["file"] and not (out / old["file"]).exists() and (out / new["file"]).is_file()
    assert (out / "sm_80" / "mine.cubin").read_bytes() == b"mine"


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_compile_out_never_deletes_a_file_outside_its_folder(tmp_path, where):
    # The CLI, as a user runs it: an index in DIR naming a file outside DIR for the unit it rebuilds.
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    reg, unit, source, options = _unit()
    file = "../victim" if where == "relative" else str(victim)
    out = tmp_path / "prebuilt"
    _index(out, [{"unit": unit, "arch": 90, "cache_key": "0" * 64, "cubin_sha256": "0" * 64, "file": file}])
    out = _prebuild(tmp_path)
    assert victim.read_text() == "keep me"
    (entry,) = json.loads((out / "index.json").read_text())["entries"]   # the bad index was replaced
    assert entry["unit"] == unit and (out / entry["file"]).is_file()


def test_compile_out_does_not_delete_through_a_linked_subfolder(tmp_path):
    out, elsewhere = tmp_path / "pre", tmp_path / "elsewhere"
    index = compiler.write_prebuilt(out, [_item()])
    (entry,) = json.loads(index.read_text())["entries"]
    elsewhere.mkdir()
    (elsewhere / Path(entry["file"]).name).write_bytes(b"keep me")
    (out / entry["file"]).unlink()
    (out / "sm_80").rmdir()
    (out / "sm_80").symlink_to(elsewhere)
    with pytest.raises(errors.InvalidProblemError, match="resolves outside"):
        compiler.write_prebuilt(out, [_item(SRC.replace("1.0f", "5.0f"))])
    assert (elsewhere / Path(entry["file"]).name).read_bytes() == b"keep me"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A rendered copy of the matrix (build --out DIR) to copy from."""
    from codegen import manifest
    root = tmp_path_factory.mktemp("built") / "gen"
    manifest.build(root)
    return root


def _copy(built, dest):
    import shutil
    shutil.copytree(built, dest)
    return dest


def test_build_out_removes_only_units_its_previous_manifest_listed(built, tmp_path):
    from codegen import manifest
    root = _copy(built, tmp_path / "gen")
    (root / "mine").mkdir()
    (root / "mine" / "my_kernel.cu").write_text("// mine")              # never listed by a manifest
    (root / "quantization" / "mine.cu").write_text("// mine too")
    (root / "quantization" / "dropped.cu").write_text("// a unit the matrix no longer has")
    man = json.loads((root / "manifest.json").read_text())
    man["units"]["quantization/dropped.cu"] = {}
    (root / "manifest.json").write_text(json.dumps(man))
    assert manifest.stale(root) == ["manifest.json", "quantization/dropped.cu (no longer produced by the matrix)"]
    rep = manifest.build(root)
    assert rep.removed == ["quantization/dropped.cu"] and rep.written == ["manifest.json"]
    assert (root / "mine" / "my_kernel.cu").read_text() == "// mine"
    assert (root / "quantization" / "mine.cu").read_text() == "// mine too"
    assert manifest.stale(root) == [] and manifest.build(root).removed == []


@pytest.mark.parametrize("listed", ["../victim.cu", "ABSOLUTE", "link/victim.cu", "quantization/linked.cu"])
def test_build_out_never_deletes_outside_its_folder(built, tmp_path, listed):
    from codegen import manifest
    root = _copy(built, tmp_path / "gen")
    victim = tmp_path / "victim.cu"
    victim.write_text("keep me")
    (root / "link").symlink_to(tmp_path)                                # a subfolder linking out
    (root / "quantization" / "linked.cu").symlink_to(victim)            # a unit that is a link
    listed = str(victim) if listed == "ABSOLUTE" else listed
    man = json.loads((root / "manifest.json").read_text())
    man["units"][listed] = {}
    (root / "manifest.json").write_text(json.dumps(man))
    assert manifest.build(root).removed == []
    assert victim.read_text() == "keep me"


def test_build_out_into_a_folder_with_a_foreign_manifest_removes_nothing(built, tmp_path):
    from codegen import manifest
    root = tmp_path / "gen"
    (root / "quantization").mkdir(parents=True)
    (root / "quantization" / "theirs.cu").write_text("// theirs")
    (root / "manifest.json").write_text(json.dumps({"units": {"quantization/theirs.cu": {}}}))
    with pytest.warns(UserWarning, match="not a skuforge manifest"):
        rep = manifest.build(root)
    assert rep.removed == [] and (root / "quantization" / "theirs.cu").read_text() == "// theirs"


# -- the cache under faults ------------------------------------------------------------------------------
def _one_warning(record, match):
    hits = [w for w in record if issubclass(w.category, errors.CacheWarning)]
    assert len(hits) == 1, [str(w.message) for w in hits]
    assert match in str(hits[0].message)
    return str(hits[0].message)


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


@pytest.mark.parametrize("suffix", ["", ".lock"])
def test_a_directory_in_place_of_one_entry_affects_only_that_entry(suffix):
    key = compiler.cache_key(SRC, 80, ())
    blocked = Path(f"{compiler._entry_path(UNIT, 80, key)}{suffix}")
    blocked.mkdir(parents=True)
    a = _twice_in_memory("a directory is in the place of the compile-cache file")
    assert a.cubin[:4] == b"\x7fELF"
    with warnings.catch_warnings():
        warnings.simplefilter("error", errors.CacheWarning)
        other = compiler.compile_cached(SRC.replace("1.0f", "2.0f"), "quantization/other_k.cu", 80)
    assert other.path is not None and other.path.is_file()      # the cache stays on for every other unit
    assert blocked.is_dir()                                     # and the directory is left alone


HOLDER = ("import sys, time\nfrom filelock import FileLock\nlock = FileLock(sys.argv[1])\nlock.acquire()\n"
          "print('held', flush=True)\ntime.sleep(120)\n")


@pytest.fixture
def holder():
    """Another process holding an entry's lock (alive, as one compiling a slow unit), killed on exit."""
    key = compiler.cache_key(SRC, 80, ())
    path = compiler._entry_path(UNIT, 80, key)
    path.parent.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, f"{path}.lock"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield types.SimpleNamespace(proc=proc, path=path, lock=f"{path}.lock")
    proc.kill()
    proc.wait()


def test_a_lock_held_by_a_live_process_past_the_timeout_lets_the_waiter_compile(holder):
    with config.override(lock_timeout=0.3), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        res = compiler.compile_cached(SRC, UNIT, 80)                # no exception: compiled here
        assert time.perf_counter() - t0 < 30
        again = compiler.compile_cached(SRC, UNIT, 80)
    message = _one_warning(rec, holder.lock)
    assert "alive" in message and "compiling it in this process" in message
    assert res.cubin[:4] == b"\x7fELF" and res.path is None and not res.cached
    assert not holder.path.exists()                                 # the holder's lock: not stored
    assert again.origin == "memory" and again.cubin == res.cubin
    assert holder.proc.poll() is None                               # the holder was never disturbed


def test_a_waiter_that_timed_out_stores_the_entry_when_the_lock_is_free_by_then(holder, monkeypatch):
    compile_ = compiler.nvrtc_compile

    def holder_finishes_meanwhile(*a):
        holder.proc.kill()                                          # a dead holder's lock is free
        holder.proc.wait()
        return compile_(*a)
    monkeypatch.setattr(compiler, "nvrtc_compile", holder_finishes_meanwhile)
    with config.override(lock_timeout=0.3), pytest.warns(errors.CacheWarning, match="still held"):
        res = compiler.compile_cached(SRC, UNIT, 80)
    assert res.path == holder.path and compiler.entry_meta(res.path)["unit"] == UNIT
    assert compiler.compile_cached(SRC, UNIT, 80).origin == "cache"


def test_a_lock_left_by_a_killed_holder_is_taken(holder):
    holder.proc.kill()
    holder.proc.wait()
    assert Path(holder.lock).exists()                               # the file stays; the lock does not
    with config.override(lock_timeout=5), warnings.catch_warnings():
        warnings.simplefilter("error", errors.CacheWarning)
        res = compiler.compile_cached(SRC, UNIT, 80)
    assert res.path == holder.path and res.path.is_file()


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
    monkeypatch.setattr(cuda_driver, "cupy", lambda: _fake_cupy(err))   # what CuPy says without a GPU
    with device.use(device.CudaDriver()):
        with pytest.raises(errors.DeviceRequiredError, match=err.split(":")[0]):
            device.current_device()
        with pytest.raises(errors.DeviceRequiredError):
            device.properties(0)
        from runtime.registry import default_registry
        reg = default_registry()
        with pytest.raises(errors.DeviceRequiredError, match="NVIDIA GPU"):
            reg.kernel(reg.query(SKU)[0])


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
