"""What a newcomer meets: help for every flag (short and true), --version, pipes that close early,
selections that match nothing, whole plain lines and progress lines off a terminal (CI logs),
compiler logs printed verbatim, typed errors for a bad --arch or setting (one line, exit 2), and the
examples on a machine without a GPU or PyTorch."""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codegen import cli

ONE = "quantization/quantize/token/symmetric/f32/s8/*"
ONE_SKU = "quantization/quantize/token/symmetric/f32/s8/sm80/simt/f32.acc-f32.det.stable"
ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, env=None, **kw):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "codegen", *args], capture_output=True, text=True, env=env, **kw)


def _flags(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, (*path, name))
        else:
            yield path, action


def test_every_flag_has_help():
    missing = [f"{' '.join(p)} {a.option_strings or a.dest}" for p, a in _flags(cli.build_parser()) if not a.help]
    assert not missing, missing


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_help_is_short(monkeypatch):
    """``--help`` of every command fits a screen: internals live in docs/, not in the help."""
    monkeypatch.setenv("COLUMNS", "100")
    long_flags = [f"{' '.join(p)} {a.option_strings}" for p, a in _flags(cli.build_parser())
                  if a.help and a.help != argparse.SUPPRESS and len(a.help) > 160]
    assert not long_flags, long_flags
    for name, sub in _subparsers(cli.build_parser()):
        lines = sub.format_help().splitlines()
        assert len(lines) <= 30, f"{name} --help: {len(lines)} lines"


def test_clear_cache_help_says_what_it_empties():
    (status,) = [sub for name, sub in _subparsers(cli.build_parser()) if name == "status"]
    (flag,) = [a for a in status._actions if "--clear-cache" in a.option_strings]
    assert "every arch and NVRTC version" in flag.help


def test_version():
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("skuforge ") and "codegen" in out.stdout


def test_list_into_a_closed_pipe_has_no_traceback():
    res = subprocess.run(f"{sys.executable} -m codegen list | head -n 2", shell=True, capture_output=True,
                         text=True)
    assert len(res.stdout.splitlines()) == 2
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


CLOSED_PIPE_COMMANDS = [
    ("--help",), ("--version",), ("check",), ("list",), ("list", "--json", "--excluded"), ("show", ONE_SKU),
    ("status",), ("audit",), ("audit", "--format", "json"), ("compile", "--help"), ("verify", "--help"),
    ("bench", "--help"), ("build", "--out", "{tmp}/gen"),
    ("compile", "--arch", "sm_90", "--filter", ONE, "--jobs", "1"),
]


@pytest.mark.parametrize("args", CLOSED_PIPE_COMMANDS, ids=" ".join)
def test_every_command_exits_0_into_a_closed_pipe(args, tmp_path):
    """The reader is gone before the command writes (``| head -1`` that already has its line): exit 0,
    nothing on stderr (rich's own handler would exit 1; the interpreter's last flush would print a
    traceback)."""
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([sys.executable, "-m", "codegen", *(a.format(tmp=tmp_path) for a in args)],
                             stdout=write, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "SKUFORGE_CACHE_DIR": str(tmp_path / "cache")})
    finally:
        os.close(write)
    assert res.returncode == 0 and res.stderr == "", (res.returncode, res.stderr)


def test_lines_are_whole_off_a_terminal(tmp_path):
    """Piped output (COLUMNS=80 as a CI log has it) is not wrapped or cut: a long path stays on its line."""
    deep = tmp_path / ("a-folder-with-a-rather-long-name-" * 3) / "prebuilt"
    env = {"SKUFORGE_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "80"}
    out = _cli("compile", "--arch", "sm_90", "--filter", ONE, "--jobs", "1", "--out", str(deep), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert any(line.startswith("wrote 1 cubins and ") and line.endswith(f"(load them with SKUFORGE_PREBUILT={deep})")
               for line in out.stdout.splitlines()), out.stdout
    status = _cli("status", env={**env, "SKUFORGE_PREBUILT": str(deep)})
    assert ["prebuilt", f"{deep}: 1 entries"] in [ln.rstrip().split(None, 1) for ln in status.stdout.splitlines()], \
        status.stdout
    assert "…" not in status.stdout


# A template error: NVRTC's log names the instantiation as ``[with T=float]``, and an #error line
# carries text that reads like a closing markup tag.
BAD_SOURCE = ('template <typename T> __device__ T twice(T x) { return x.nope; }\n'
              '#ifdef SHOUT\n#error "[/red] is not markup"\n#endif\n'
              'extern "C" __global__ void k(float* p) { p[0] = twice(p[0]); }\n')


@pytest.mark.parametrize("options", [(), ("-DSHOUT",)], ids=["template", "error-directive"])
def test_compiler_logs_are_printed_verbatim(options, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_registry", lambda: None)
    monkeypatch.setattr(cli, "compile_jobs", lambda reg, archs, pattern: [("bad.cu", BAD_SOURCE, 90, options)])
    assert cli.main(["compile", "--arch", "sm_90", "--jobs", "1", "--no-cache"]) == 1
    out = capsys.readouterr().out
    assert "FAILED bad.cu sm_90:" in out
    want = "[/red] is not markup" if options else "[with T=float]"
    assert want in out, out


def test_an_arch_nvrtc_does_not_build_for_is_a_typed_error_before_any_compile(tmp_path):
    from runtime import compiler
    res = _cli("compile", "--arch", "sm_90,sm_999", "--filter", ONE, env={"SKUFORGE_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 2 and res.stdout == "", res.stdout
    (line,) = res.stderr.splitlines()
    assert line.startswith("error: UnsupportedError: --arch 'sm_90,sm_999': NVRTC") and "sm_999" in line
    assert all(f"sm_{a}" in line for a in compiler.supported_archs())
    assert not (tmp_path / "cubin-v2").exists()                      # nothing was compiled


def test_a_bad_setting_is_a_one_line_typed_error_where_it_is_used(tmp_path):
    env = {"SKUFORGE_LOCK_TIMEOUT": "abc"}
    imported = subprocess.run([sys.executable, "-c", "import runtime, codegen.cli"], capture_output=True, text=True,
                              env={**os.environ, **env})
    assert imported.returncode == 0, imported.stderr                   # not at import
    assert ONE_SKU in _cli("list", env=env).stdout.split()               # a command that does not read it
    res = _cli("status", env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.splitlines() == ["error: InvalidProblemError: SKUFORGE_LOCK_TIMEOUT='abc'; expected a finite "
                                       "number of seconds >= 0"], res.stderr


def test_compile_fills_the_compile_cache(tmp_path):
    from runtime import compiler, config
    from runtime.registry import default_registry
    res = _cli("compile", "--arch", "sm_90", "--filter", ONE, "--jobs", "1", env={"SKUFORGE_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 0 and "stored 1 cubins" in res.stdout, res.stdout + res.stderr
    reg = default_registry()
    unit = reg.lookup(ONE_SKU).unit
    with config.override(cache_dir=tmp_path, disable_jit=True):    # the runtime finds it without NVRTC
        hit = compiler.compile_cached(reg.unit_source(unit), unit, 90, tuple(reg.units[unit]["nvrtc_options"]))
    assert hit.origin == "cache"
    checked = _cli("compile", "--arch", "sm_90", "--filter", ONE, "--jobs", "1", "--no-cache",
                   env={"SKUFORGE_CACHE_DIR": str(tmp_path / "other")})
    assert checked.returncode == 0 and not (tmp_path / "other").exists(), checked.stdout


EXAMPLES = sorted(str(p) for p in (ROOT / "examples").glob("*.py"))
RUN_ALL = """import json, runpy, sys
{prelude}
codes = {{}}
for path in sys.argv[1:]:
    try:
        runpy.run_path(path, run_name="__main__")
        codes[path] = None
    except SystemExit as e:
        codes[path] = e.code
print(json.dumps(codes))
"""


def _run_examples(prelude: str, env: dict) -> dict:
    res = subprocess.run([sys.executable, "-c", RUN_ALL.format(prelude=prelude), *EXAMPLES], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def test_examples_without_a_gpu_say_so_in_one_line():
    pytest.importorskip("torch")
    codes = _run_examples("", {"CUDA_VISIBLE_DEVICES": ""})
    for path, code in codes.items():
        assert isinstance(code, str) and "\n" not in code and "needs a CUDA GPU" in code, (path, code)


def test_examples_without_pytorch_say_so_in_one_line():
    codes = _run_examples("sys.modules['torch'] = None", {})
    for path, code in codes.items():
        assert code == f"{Path(path).name} needs PyTorch (pip install torch) " + \
            ("with NCCL and CUDA GPUs" if path.endswith("ep_moe.py") else "and a CUDA GPU"), (path, code)


def test_examples_leave_the_environment_alone():
    import re
    for path in EXAMPLES:
        text = Path(path).read_text()
        assert not re.search(r"environ\[[^]]+\]\s*=|environ\.(update|setdefault|pop)|putenv", text), path


@pytest.mark.parametrize("args, message", [
    (("list", "--filter", "no/such/*"), "no SKU matches --filter"),
    (("compile", "--filter", "no/such/*", "--arch", "sm_90"), "no SKU matches --filter"),
    (("compile", "--filter", ONE, "--arch", "sm_75"), "selects none of them"),
    (("compile", "--filter", ONE, "--arch", "hopper"), "is not a list like"),
])
def test_empty_selections_exit_nonzero_with_a_message(args, message):
    res = _cli(*args)
    assert res.returncode != 0 and message in res.stderr, res.stderr


def test_compile_prints_progress_lines_when_not_a_terminal(tmp_path):
    res = _cli("compile", "--arch", "sm_90", "--filter", ONE, "--jobs", "1",
               env={**os.environ, "SKUFORGE_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 units to compile" in res.stdout and "1/1 units, 0 failed" in res.stdout


def test_plain_progress_heartbeat(monkeypatch, capsys):
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.2)
    with cli._PlainProgress(3, "NVRTC") as p:
        time.sleep(1.6)  # a long unit: the heartbeat prints while nothing finishes
        p.advance(False)
        time.sleep(0.6)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "NVRTC: 3 units to compile"
    assert sum("0/3 units" in ln for ln in lines) >= 2 and any("1/3 units" in ln for ln in lines)
