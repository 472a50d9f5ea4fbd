"""Build hook: the wheel carries ``templates/`` and ``generated/`` (manifest included) as package
data of ``runtime``, under ``runtime/_data/``. The repository keeps its layout (both stay at the
root); ``runtime.config.data_root()`` finds them in either place. Editable installs use the
source tree directly and copy nothing. Everything else is in pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

ROOT = Path(__file__).resolve().parent
DATA = ("templates", "generated")


class build_py(_build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for name in DATA:
            src, dst = ROOT / name, Path(self.build_lib) / "runtime" / "_data" / name
            if not (src / "manifest.json").is_file() and name == "generated":
                raise SystemExit(f"{src}/manifest.json is missing: run `python -m codegen` before building")
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*.tmp"))


setup(cmdclass={"build_py": build_py})
