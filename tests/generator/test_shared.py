"""Shared entry points (``Family.shares``, codegen/render.py): a SKU that launches entry points of a
host SKU of its unit, which compiles the same device code once (a token SKU its group SKU's fused
kernels, a tensor SKU its channel SKU's reduction). CPU only: rendering, manifest, registry."""
import re

import pytest

from codegen import render
from codegen.matrix import cells
from runtime.errors import TemplateError, UnsupportedError
from runtime.registry import default_registry

ENTRY = re.compile(r'extern "C" __global__ void (?:__\w+__\([^)]*\) )*(\w+)\(')
CELLS = {c.sku: c for c in cells() if c.generated}
SHARED = sorted((c.sku, group, host) for c in CELLS.values() if c.block.shares
                for group, host in c.block.shares(c.sku).items())


def _split(text: str) -> tuple:
    """(the text ahead of the first entry point, {entry point: its definition}), comments dropped."""
    text = re.sub(r"//[^\n]*", "", text)
    found = list(ENTRY.finditer(text))
    defs = {}
    for m in found:
        i = text.index("{", _close(text, m.end()))
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
        defs[m.group(1)] = text[m.start(): j + 1]
    return (text[: found[0].start()] if found else text), defs


def _close(text: str, i: int) -> int:
    """The index past the parenthesis that closes the one opened just before ``i``."""
    depth = 1
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return i


def _group(name: str, symbol: str) -> str:
    """The ABI group of an entry point of a SKU whose symbol is ``symbol``."""
    if name == symbol:
        return "main"
    return "team" if re.fullmatch(re.escape(symbol) + r"_t\d+(_tx\d+)?", name) else name[len(symbol) + 1:]


def _unshared(sku) -> str:
    """The SKU's text as its template renders it without sharing: every entry point its own."""
    ctx = render.kernel_context(CELLS[sku])
    ctx["shares"] = {}
    return render.render_kernel(CELLS[sku], ctx)


def test_the_dynamic_skus_share():
    """Every s8 / u8 / int4 token SKU launches its group SKU's fused kernels, every tensor SKU its
    channel SKU's reduction; fp8 token SKUs keep their own (the group kernels also write MX scales)."""
    pairs = {(s.scope, g, h.scope) for s, g, h in SHARED}
    assert pairs == {("token", "main", "group"), ("token", "team", "group"), ("tensor", "main", "channel")}
    fp8 = {"fp8_e4m3", "fp8_e5m2"}
    for sku in CELLS:
        if sku.op == "dynamic_quantize":
            want = sku.scope == "tensor" or (sku.scope == "token" and sku.aux_element not in fp8)
            assert any(s == sku for s, _, _ in SHARED) == want, sku


@pytest.mark.parametrize("sku,group,host", SHARED, ids=lambda v: v if isinstance(v, str) else None)
def test_a_shared_entry_point_is_the_one_the_sku_would_compile(sku, group, host):
    """With the names exchanged, the SKU's own rendering of a shared entry point, and all the device
    code ahead of its entry points, is the host's text: the same device code, compiled once."""
    mine = _unshared(sku).replace(sku.symbol, host.symbol).replace(f"// SKU: {sku}\n", f"// SKU: {host}\n")
    head, entries = _split(mine)
    host_head, host_entries = _split(render.render_kernel(CELLS[host]))
    assert head == host_head
    names = [n for n in entries if _group(n, host.symbol) == group]
    assert names
    for name in names:
        assert entries[name] == host_entries.get(name), name


@pytest.mark.parametrize("sku", sorted({s for s, _, _ in SHARED}), ids=str)
def test_a_sharing_sku_compiles_none_of_the_shared_entry_points(sku):
    shares = CELLS[sku].block.shares(sku)
    _, entries = _split(render.render_kernel(CELLS[sku]))
    assert not [n for n in entries if _group(n, sku.symbol) in shares]
    assert not [n for n in entries if any(n.startswith(h.symbol) for h in shares.values())]


def test_the_registry_resolves_shared_entry_points():
    reg = default_registry()
    token = reg.query("quantization/dynamic_quantize/token/symmetric/bf16/s8/*")[0]
    group = reg.query("quantization/dynamic_quantize/group/symmetric/bf16/s8/*")[0]
    e, g = reg.lookup(token), reg.lookup(group)
    assert e.symbol == token.symbol and e.entry_point("main") == group.symbol
    assert e.entry_point("t8") == g.entry_point("t8") == group.symbol + "_t8"
    assert e.entry_point("t2_tx256") == group.symbol + "_t2_tx256"  # its own fixed-TX kernel, compiled by its host
    assert [2, 2, 256] not in g.launch["team_fixed"] and g.entry_point("main") == group.symbol
    with pytest.raises(UnsupportedError, match="no entry point 'coop'"):
        e.entry_point("coop")
    assert e.launch["shares"] == {"main": str(group), "team": str(group)}
    assert e.launch["abi"] == g.launch["abi"]
    src = reg.source(token)                                        # `codegen show`: what it runs
    assert src.index(f"// SKU: {token}\n") < src.index(f"// SKU: {group}\n")
    assert f" {group.symbol}_t8(" in src and f" {token.symbol}" not in src.replace(f"// SKU: {token}", "")
    tensor = reg.query("quantization/dynamic_quantize/tensor/asymmetric/f32/u8/*")[0]
    t = reg.lookup(tensor)
    assert t.entry_point("main") == tensor.symbol.replace("_tensor_", "_channel_")
    assert t.entry_point("coop") == t.symbol + "_coop"                # a group it does not share: its own
    assert f" {t.entry_point('coop')}(" in reg.source(tensor)


def test_the_sha256_of_a_sharing_sku_covers_its_host():
    """Its text alone would not change when the code it runs changes: its sha256 covers the host's text."""
    unit = next(u for u in render.render([CELLS[s] for s in CELLS if s.op == "dynamic_quantize"
                                         and s.element == "f16" and s.aux_element == "s8"]))
    by = {str(k.cell.sku): k for k in unit.kernels}
    pre, head = render.prelude(), render.headers(unit.block)
    for k in unit.kernels:
        hosts = dict.fromkeys((k.launch.get("shares") or {}).values())
        assert k.sha256 == render.sha256(pre + head + k.text + "".join(by[h].text for h in hosts))
    assert sum(bool(k.launch.get("shares")) for k in unit.kernels) == 4


def test_a_host_outside_the_unit_is_an_error():
    token = next(s for s, g, _ in SHARED if s.scope == "token")
    with pytest.raises(TemplateError, match="is not generated in its unit"):
        render.render([CELLS[token]])               # without its group SKU


def test_a_host_with_another_parameter_list_is_an_error():
    token, _, group = next(t for t in SHARED if t[0].scope == "token")
    unit = render.render([CELLS[token], CELLS[group]])[0]
    host = next(k for k in unit.kernels if k.cell.sku == group)
    host.launch["abi"]["team"] = "dynamic_fused.team.0000000000"
    with pytest.raises(TemplateError, match="declares another parameter list"):
        render._link_shared(unit, render.prelude())
