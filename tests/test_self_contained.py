"""The product speaks of itself: its contract is in docs/, and no file outside generated/ and audit/
cites a document outside the repository or describes the machines it was built on."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
SKIPPED_DIRS = ("generated/", "audit/")
# Spelled in pieces, so that a search of the tree for them finds the places to fix, not this test.
FORBIDDEN = ("SPEC" + " §", "../" + "shared", "lent" + " GPU machine")
OUT_VARIABLE = "$" + "OUT"                      # the output folder of tools/gpu_round.sh: only there
OUT_ALLOWED = ("tools/gpu_round.sh",)
WALK_EXCLUDED = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis"}


def _product_files() -> list:
    """Tracked files (``git ls-files``), or every file under the root but build and cache folders
    where the tree has no usable git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=30)
        names = [n for n in out.stdout.decode().split("\0") if n] if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:
        names = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                 if p.is_file() and not (set(p.relative_to(ROOT).parts[:-1]) & WALK_EXCLUDED)
                 and not any(part.startswith(".") or part.endswith(".egg-info")
                             for part in p.relative_to(ROOT).parts[:-1])]
    return [n for n in names if n != SELF and not n.startswith(SKIPPED_DIRS) and (ROOT / n).is_file()]


def _offences(names, root=ROOT) -> list:
    found = []
    for name in names:
        text = (root / name).read_bytes().decode("utf-8", errors="ignore")
        for word in FORBIDDEN + (() if name in OUT_ALLOWED else (OUT_VARIABLE,)):
            for i, line in enumerate(text.splitlines(), 1):
                if word in line:
                    found.append(f"{name}:{i}: {word!r}: {line.strip()[:120]}")
    return found


def test_the_tree_is_listed():
    names = _product_files()
    assert "README.md" in names and "docs/numerics.md" in names and "runtime/sku.py" in names
    assert not any(n.startswith(SKIPPED_DIRS) for n in names) and SELF not in names


def test_no_file_cites_an_outside_contract_or_the_build_machines():
    assert _offences(_product_files()) == []


def test_the_check_finds_each_word(tmp_path):
    lines = [f"see {w} here" for w in FORBIDDEN + (OUT_VARIABLE,)]
    (tmp_path / "a.md").write_text("\n".join(lines) + "\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "gpu_round.sh").write_text(f'mkdir -p "{OUT_VARIABLE}"\n')
    found = _offences(["a.md", "tools/gpu_round.sh"], root=tmp_path)
    assert [f.split(":")[1] for f in found] == ["1", "2", "3", "4"], found
    assert all(f.startswith("a.md:") for f in found)
