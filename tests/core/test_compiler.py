"""NVRTC on the CPU and the content-keyed compile cache."""
import multiprocessing as mp

import pytest

from runtime import compiler, config

SRC = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] *= 2.0f; }\n'


@pytest.fixture(autouse=True)
def cache_dir(tmp_path):
    compiler.reset_faults()
    with config.override(cache_dir=tmp_path / "cache"):
        yield tmp_path / "cache"
    compiler.reset_faults()


def test_compiles_without_gpu_for_sm80_and_sm90():
    for arch in (80, 90):
        cubin = compiler.nvrtc_compile(SRC, "k.cu", arch)
        assert cubin[:4] == b"\x7fELF"


def test_compiling_leaves_the_interpreters_shared_bytes_alone():
    # An empty NVRTC log is one byte (its NUL): read into `b" " * 1`, the interpreter's shared
    # one-byte object, it turned every b" " of the process into b"\x00" (and rendered sources with it).
    compiler.nvrtc_compile(SRC, "k.cu", 80)
    assert bytes([32])[0] == 32 and bytes([32]).decode() == " "


def test_compile_error_carries_log():
    with pytest.raises(compiler.CompileError, match="identifier"):
        compiler.nvrtc_compile("__global__ void k() { undefined_name = 1; }", "bad.cu", 80)


def test_key_depends_on_every_input(monkeypatch):
    base = compiler.cache_key(SRC, 80, ())
    assert compiler.cache_key(SRC, 80, ()) == base
    assert compiler.cache_key(SRC + " ", 80, ()) != base
    assert compiler.cache_key(SRC, 90, ()) != base
    assert compiler.cache_key(SRC, 80, ("--fmad=false",)) != base
    monkeypatch.setattr(compiler, "GENERATOR_VERSION", "9.9.9")
    assert compiler.cache_key(SRC, 80, ()) != base


def test_cache_hit_layout_and_corrupt_entry_recovery(cache_dir):
    first = compiler.compile_cached(SRC, "quantization/k.cu", 80)
    assert not first.cached
    assert first.path.parent.name == "sm_80" and first.path.parent.parent.name == compiler.CACHE_LAYOUT
    assert first.path.name.startswith("quantization_k-")
    second = compiler.compile_cached(SRC, "quantization/k.cu", 80)
    assert second.cached and second.cubin == first.cubin
    # truncate the entry: it must be detected and rebuilt, not loaded
    first.path.write_bytes(first.path.read_bytes()[:100])
    with pytest.warns(compiler.CacheWarning, match="corrupt"):
        third = compiler.compile_cached(SRC, "quantization/k.cu", 80)
    assert not third.cached and third.cubin == first.cubin
    # flip a payload byte: checksum mismatch, rebuilt
    data = bytearray(first.path.read_bytes())
    data[-1] ^= 0xFF
    first.path.write_bytes(bytes(data))
    compiler.reset_faults()  # one warning per entry and process: forget the first one
    with pytest.warns(compiler.CacheWarning, match="checksum"):
        assert not compiler.compile_cached(SRC, "quantization/k.cu", 80).cached
    assert not list(first.path.parent.glob(".tmp-*"))  # no temporary files left behind


SRC_B = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] += 3.0f; }\n'


@pytest.mark.parametrize("how", ["copy", "symlink"])
def test_an_entry_of_another_unit_in_place_is_rebuilt_not_loaded(how):
    # Another unit's valid entry (its checksum matches its payload) copied or linked into this
    # unit's place: the header names another key and unit, so it is rebuilt, never loaded.
    a = compiler.compile_cached(SRC, "quantization/a.cu", 80)
    b = compiler.compile_cached(SRC_B, "quantization/b.cu", 80)
    assert a.cubin != b.cubin
    b.path.unlink()
    if how == "copy":
        b.path.write_bytes(a.path.read_bytes())
    else:
        b.path.symlink_to(a.path)
    with pytest.warns(compiler.CacheWarning, match="holds another entry: unit 'quantization/a.cu'"):
        again = compiler.compile_cached(SRC_B, "quantization/b.cu", 80)
    assert not again.cached and again.cubin == b.cubin
    assert compiler.entry_meta(b.path)["unit"] == "quantization/b.cu" and not b.path.is_symlink()
    assert compiler.entry_meta(a.path)["unit"] == "quantization/a.cu"      # a link's target is not rewritten
    assert compiler.compile_cached(SRC_B, "quantization/b.cu", 80).origin == "cache"


def test_an_entry_is_used_only_for_its_unit_and_arch(cache_dir):
    entry = compiler.compile_cached(SRC, "quantization/a.cu", 80)
    key = compiler.cache_key(SRC, 80, ())
    assert compiler._read_entry(entry.path, key, "quantization/a.cu", 80)[0] == entry.cubin
    for name, arch, other in (("quantization/other.cu", 80, key), ("quantization/a.cu", 90, key),
                              ("quantization/a.cu", 80, compiler.cache_key(SRC_B, 80, ()))):
        payload, problem = compiler._read_entry(entry.path, other, name, arch)
        assert payload is None and "holds another entry" in problem


def _worker(args):
    d, src = args
    from pathlib import Path

    from runtime import compiler as c
    with config.override(cache_dir=Path(d)):
        return c.compile_cached(src, "race.cu", 80).cubin


def test_concurrent_processes_agree(cache_dir):
    ctx = mp.get_context("spawn")
    with ctx.Pool(3) as pool:
        outs = pool.map(_worker, [(str(cache_dir), SRC)] * 3)
    assert len(set(outs)) == 1
    entries = list(cache_dir.rglob("race-*.cubin"))
    assert len(entries) == 1


# A thread's array that must live in memory (volatile: every access is a real one) is placed in
# local memory: ptxas reports a stack frame.
LOCAL_SRC = ('extern "C" __global__ void k(float* p) {\n'
             '    volatile float a[8];\n'
             '    a[threadIdx.x & 7] = p[threadIdx.x];\n'
             '    p[threadIdx.x] = a[(threadIdx.x + 1) & 7];\n'
             '}\n')


def test_local_memory_use_names_kernels_with_a_stack_frame():
    rep = compiler.resource_report(LOCAL_SRC, "local.cu", 90)
    assert rep["k"]["stack"] > 0
    assert "k" in compiler.local_memory_use(rep)
    clean = compiler.resource_report(SRC, "k.cu", 90)
    assert clean["k"]["stack"] == 0 and compiler.local_memory_use(clean) == {}


def test_the_build_check_fails_on_local_memory_and_deployment_still_writes_the_kernel():
    from codegen.cli import _compile_one
    unit, arch, err, _, report = _compile_one(("local.cu", LOCAL_SRC, 90, ()))
    assert err and err.startswith("local memory in k")           # `compile`: a failure
    *_, err2, _, _, cubin = _compile_one(("local.cu", LOCAL_SRC, 90, (), True))
    assert err2 == err and cubin                                   # --out / --fill-cache: written, warned


@pytest.mark.parametrize("unit", ["quantization/dynamic_quantize_bf16_s8.cu", "quantization/dynamic_quantize_bf16_u8.cu"])
def test_bf16_dynamic_kernels_keep_their_chunks_in_registers(unit):
    # The scalar path's one-element bf16 chunks were once read as a 32-bit pair: the 2-byte chunk
    # went to the stack and the read ran past it (compute-sanitizer: invalid __local__ reads).
    # `python -m codegen compile` checks every kernel this way; this is the focused case.
    from runtime.registry import default_registry
    reg = default_registry()
    rep = compiler.resource_report(reg.unit_source(unit), unit, 90, tuple(reg.units[unit]["nvrtc_options"]))
    assert rep and compiler.local_memory_use(rep) == {}
