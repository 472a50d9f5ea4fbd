"""The records under ``audit/`` that verify, bench and audit share: where they live, JSON in and
out, the commit they describe, the GPU slug that names them.

The harness's own environment variables are read here, when a command needs them (docs/audit.md,
"Environment"): ``SKUFORGE_AUDIT_DIR`` (the records folder, default ``<repo>/audit``),
``SKUFORGE_COMMIT`` (the commit records name, for a copy of the tree without ``.git``) and
``SKUFORGE_DIRTY`` (with it: the tree had uncommitted changes; a flag, runtime.config.parse_flag)."""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
from pathlib import Path

from runtime import config

ROOT = Path(__file__).resolve().parent.parent.parent


def audit_dir() -> Path:
    """The records folder: ``SKUFORGE_AUDIT_DIR``, else ``<repo>/audit``."""
    text = os.environ.get("SKUFORGE_AUDIT_DIR", "").strip()
    return Path(text).expanduser().absolute() if text else ROOT / "audit"


def _records_dir(text: str) -> Path:
    return Path(text) if text else audit_dir()


def add_records_argument(parser) -> None:
    """``--records DIR`` of verify, bench and audit (resolved when the arguments are parsed)."""
    parser.add_argument("--records", type=_records_dir, default="", metavar="DIR",
                        help="records folder (default: $SKUFORGE_AUDIT_DIR, else audit/)")


def slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``: the file name of a GPU's records."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def read_json(path: Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default


def write_json(path: Path, obj) -> None:
    """Atomic write (temp file + rename), stable key order, trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def git_info() -> dict:
    """``{"commit": sha or None, "dirty": bool or None}``; ``SKUFORGE_COMMIT`` (and ``SKUFORGE_DIRTY``)
    override, for copies of the tree without ``.git`` or with a stale one."""
    commit = os.environ.get("SKUFORGE_COMMIT", "").strip()
    if commit:
        return {"commit": commit, "dirty": config.env_flag("SKUFORGE_DIRTY")}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
        return {"commit": head.stdout.strip(), "dirty": bool(st.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
