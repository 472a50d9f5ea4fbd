"""CLI hygiene: help for every flag, --version, pipes that close early, selections that match nothing,
progress lines in non-terminal output (CI logs)."""
import argparse
import os
import subprocess
import sys
import time

import pytest

from codegen import cli

ONE = "quantization/quantize/token/symmetric/f32/s8/*"


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "codegen", *args], capture_output=True, text=True, **kw)


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


def test_version():
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("skuforge ") and "codegen" in out.stdout


def test_list_into_a_closed_pipe_has_no_traceback():
    res = subprocess.run(f"{sys.executable} -m codegen list | head -n 2", shell=True, capture_output=True,
                         text=True)
    assert len(res.stdout.splitlines()) == 2
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


@pytest.mark.parametrize("args, message", [
    (("list", "--filter", "no/such/*"), "no SKU matches --filter"),
    (("compile", "--filter", "no/such/*", "--arch", "sm_90"), "no SKU matches --filter"),
    (("compile", "--filter", ONE, "--arch", "sm_70"), "selects none of them"),
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
