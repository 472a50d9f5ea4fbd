"""tools/sass_diff.py: the machine code of a unit compared kernel by kernel (CPU: NVRTC and cuobjdump)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = "quantization/dequantize_backward_f32_f32.cu"


def _tool():
    spec = importlib.util.spec_from_file_location("sass_diff", ROOT / "tools" / "sass_diff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_comment_changes_no_kernel_and_an_operation_changes_each():
    tool = _tool()
    try:
        objdump = tool.cuobjdump()
    except SystemExit:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    source = (ROOT / "generated" / UNIT).read_text()
    assert "* e.s);" in source   # dequantize_backward: dq = dy * scale (quantization/elementwise.cuh, in the unit)
    base = tool.sass(tool.nvrtc_compile(source, UNIT, 90), objdump)
    assert base and all(base.values())
    commented = tool.sass(tool.nvrtc_compile("// a comment\n" + source, UNIT, 90), objdump)
    assert set(tool.compare(base, commented).values()) == {"same"}
    doubled = tool.sass(tool.nvrtc_compile(source.replace("* e.s);", "* e.s * 2);"), UNIT, 90), objdump)
    result = tool.compare(base, doubled)
    assert set(result) == set(base) and all(v.startswith("differs") for v in result.values())
    assert tool.compare(base, {}) == {k: "only in the old tree" for k in base}
