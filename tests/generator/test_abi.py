"""The kernel ABI is declared once (codegen/abi.py): the C signatures are written from it, the
manifest records it, and the launchers fill parameters by name (runtime/abi.py)."""
import re
from pathlib import Path

import pytest

import runtime as sf
from codegen.abi import PACKING
from runtime.abi import Abi

REG = sf.default_registry()
ENTRY = re.compile(r'extern "C" __global__ void (?:__\w+__\([^)]*\) )*(\w+)\((.*?)\)\s*\{', re.S)


def _c_lists(source: str) -> dict:
    """{entry point: [[name, packing], ...]} parsed from a unit's C text."""
    out = {}
    for name, params in ENTRY.findall(source):
        lst = []
        for p in params.split(","):
            decl, pname = p.strip().rsplit(None, 1)
            lst.append([pname, "ptr" if "*" in decl else PACKING.get(decl) or PACKING[decl.replace("const ", "").strip()]])
        out[name] = lst
    return out


@pytest.mark.parametrize("unit", sorted(REG.units))
def test_every_entry_point_matches_a_declared_list_of_its_kernel(unit):
    entries = _c_lists(REG.unit_source(unit))
    assert entries
    symbols = {}
    for text in REG.units[unit]["skus"]:
        e = REG.lookup(text)
        lists = {group: REG.manifest["abi"][abi_id] for group, abi_id in e.launch["abi"].items()}
        symbols[e.symbol] = lists
        assert "main" in lists or "gemm" in lists
    for name, params in entries.items():
        owner = max((s for s in symbols if name.startswith(s)), key=len)   # the SKU symbol is a prefix
        assert params in symbols[owner].values(), f"{name}: its signature is not one of {owner}'s declared lists"
    for text in REG.units[unit]["skus"]:
        e = REG.lookup(text)
        main = symbols[e.symbol].get("main") or symbols[e.symbol].get("gemm")
        sym = e.entry_point()      # its own, or that of the host SKU whose main entry point it launches
        assert entries[sym] == main, f"{sym}: the main entry point of {text} takes its main list"


def test_values_are_filled_by_name_only():
    abi = Abi("t", [("x", "ptr"), ("n", "i64"), ("s", "f32")])
    assert abi.fmt == "Qqf" and abi.slot == {"x": 0, "n": 1, "s": 2}
    assert abi.values(s=0.5, x=16, n=3) == [16, 3, 0.5]
    with pytest.raises(TypeError, match="'n'"):
        abi.values(x=16, s=0.5)
    with pytest.raises(TypeError, match="extra"):
        abi.values(x=16, n=3, s=0.5, extra=1)


def test_no_launcher_writes_a_positional_layout():
    """The packing formats come from the manifest's lists: no module outside runtime/kernel_args.py
    and runtime/abi.py builds one."""
    root = Path(sf.__file__).parent
    for path in root.rglob("*.py"):
        if path.name in ("kernel_args.py", "abi.py"):
            continue
        assert "param_format(" not in path.read_text(), path


def test_tensor_map_parameters_are_128_bytes_at_64_byte_alignment():
    """A `const __grid_constant__ CUtensorMap` parameter (packing "tmap") is 128 bytes at a 64-byte
    aligned offset of the parameter block, as in the kernel's parameter space."""
    from runtime.device import ParamBlock, pack_params, param_format
    fmt = param_format(("ptr", "i32", "tmap", "i64", "tmap"))
    assert fmt == "QiTqT"
    block = ParamBlock(fmt)
    base = block.ptrs[0]
    assert [block.ptrs[i] - base for i in range(5)] == [0, 8, 64, 192, 256]
    raw = pack_params(fmt, [7, 3, bytes(range(128)), -1, b"\xff" * 128])
    assert len(raw) == 384 and raw[64:192] == bytes(range(128)) and raw[256:] == b"\xff" * 128
    with pytest.raises(Exception):
        pack_params(fmt, [7, 3, 5, -1, b""])
