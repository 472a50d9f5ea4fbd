"""Rendering: matrix cells → CUDA source text, with Jinja (StrictUndefined: no silent blanks).

Each kernel is rendered on its own (so its text, and the sha256 of prelude + text, is a
property of that SKU), then kernels that share an op and dtypes are concatenated into one
translation unit, which NVRTC compiles once. A SKU that launches entry points of another SKU of
its unit (``Block.shares``: a host that compiles the same device code) renders only the rest,
and its sha256 covers its host's text too: what it runs.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from functools import lru_cache

import jinja2

from runtime.config import data_root
from runtime.errors import TemplateError
from runtime.kinds import CTYPE, SIZE
from runtime.status import ARGS, code as status_code

from runtime.axes import GENERATOR_VERSION

from .matrix import Cell
from .spec import Block

ROOT = data_root()               # the repository root, or runtime/_data in an installed wheel
TEMPLATES = ROOT / "templates"
PRELUDE = "common/prelude.cuh"
END_OF_HEADER = "// ---- end of "   # the last line of every header (runtime/registry.py reads it)


def _template_line(tb, fallback: str):
    """(file, line) of the innermost template frame of a traceback (Jinja rewrites tracebacks so
    that template frames carry the template's file name and line)."""
    where = None
    while tb is not None:
        fname = tb.tb_frame.f_code.co_filename
        if fname.endswith((".j2", ".cuh", ".cu")) or fname.startswith(str(TEMPLATES)):
            where = (fname, tb.tb_lineno)
        tb = tb.tb_next
    return where or (fallback, None)


def _get(name: str, what: str = "") -> jinja2.Template:
    try:
        return environment().get_template(name)
    except jinja2.TemplateNotFound as e:
        raise TemplateError(f"template {e.name!r} not found under {TEMPLATES}{what}") from None
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{e.filename or name}:{e.lineno}: template syntax error: {e.message}{what}") from None


def _render(name: str, what: str = "", **ctx) -> str:
    """Render one template; :class:`TemplateError` naming the template file and line on any Jinja
    error (not found, syntax, undefined variable, an error raised inside the template)."""
    template = _get(name, what)
    try:
        return template.render(**ctx)
    except jinja2.TemplateSyntaxError as e:  # an included template
        raise TemplateError(f"{e.filename or name}:{e.lineno}: template syntax error: {e.message}{what}") from None
    except jinja2.TemplateNotFound as e:
        raise TemplateError(f"template {e.name!r} (included from {TEMPLATES / name}) not found{what}") from None
    except (jinja2.UndefinedError, jinja2.TemplateError, TypeError, KeyError, ValueError, AttributeError) as e:
        fname, line = _template_line(sys.exc_info()[2], str(TEMPLATES / name))
        raise TemplateError(f"{fname}:{line if line is not None else '?'}: {type(e).__name__}: {e}{what}") from None


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


@lru_cache(maxsize=None)
def header(name: str) -> str:
    """A device-code header (``templates/**/*.cuh``): plain CUDA C++, taken verbatim (no Jinja), so
    that it reads and compiles as written; :class:`TemplateError` when it is missing."""
    path = TEMPLATES / name
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TemplateError(f"header {name!r} not found under {TEMPLATES}") from None
    # its last line closes it: the registry finds where a unit's shared helpers end by that line
    last = text.rstrip("\n").rsplit("\n", 1)[-1]
    if f"(templates/{name})" not in text.split("\n", 1)[0] or not last.startswith(END_OF_HEADER):
        raise TemplateError(f"header {name!r}: its first line must name it ('(templates/{name})') and its last line "
                            f"must start with {END_OF_HEADER!r}")
    return text


def prelude() -> str:
    return header(PRELUDE)


def headers(block: Block) -> str:
    """The block's extra shared headers (``Block.headers``, in order), each followed by a blank line;
    empty for blocks without any, whose units are then exactly prelude + kernels."""
    return "".join(header(h) + "\n" for h in block.headers)


def _stream_kind(stream, sku) -> str:
    return {"element": sku.element, "aux": sku.aux_element}.get(stream.element, stream.element)


UNROLL = 4  # vectors each thread has in flight in the elementwise skeleton


def vector_width(kinds) -> int:
    """Elements per thread and access: 16 bytes of the widest stream, so the widest stream moves
    in 16-byte accesses and the narrower ones in 8/4-byte accesses, all coalesced across a warp."""
    return max(1, 16 // max(SIZE[k] for k in kinds))


def kernel_context(cell: Cell) -> dict:
    """Everything a template needs to spell one kernel."""
    sku, block = cell.sku, cell.block
    math = sku.precision.math
    ins = [{"name": s.name, "kind": _stream_kind(s, sku)} for s in block.ins]
    outs = [{"name": s.name, "kind": _stream_kind(s, sku)} for s in block.outs]
    for s in ins + outs:
        s["ctype"] = CTYPE[s["kind"]]
    ctx = {
        "sku": str(sku),
        "symbol": sku.symbol,
        "op": sku.op,
        "scope": sku.scope,
        "mode": sku.mode,
        "element": sku.element,
        "aux_element": sku.aux_element,
        "M": CTYPE[math],
        "to_math": "to_" + math,
        "from_math": "from_" + math,
        "out_ctype": outs[0]["ctype"] if outs else None,
        "ins": ins,
        "outs": outs,
        "vec": vector_width([s["kind"] for s in ins + outs]) if ins + outs else 1,
        "unroll": UNROLL,
        "arch": sku.arch,
        "backend": sku.backend,
        "launch_extra": {},
        # the codes this kernel writes to the status word for an invalid value it reads
        "status": {arg: status_code(sku.op, arg) for arg in ARGS},
    }
    if block.extra_context is not None:
        extra = dict(block.extra_context(cell, ctx))
        ctx["launch_extra"] = extra.pop("launch", {})
        ctx.update(extra)
    kind = block.launch_kind(sku)
    ctx["launch_kind"] = kind.name
    # {ABI group: {"sku", "symbol"}} of the entry points it launches from a host SKU of its unit
    ctx["shares"] = {group: {"sku": str(host), "symbol": host.symbol}
                     for group, host in (block.shares(sku) if block.shares else {}).items()}
    # the parameter lists of the kernel's entry points: {{ k.abi.<group> }} in its template
    ctx["abi"] = kind.signatures(ctx)
    # {entry point: {"symbol", "group"}} (the manifest's record), and {entry point: symbol}, the names
    # templates define their entry points by ({{ k.entries.main }})
    ctx["entry_points"] = kind.symbols(ctx)
    ctx["entries"] = {name: point["symbol"] for name, point in ctx["entry_points"].items()}
    return ctx


def launch_metadata(cell: Cell, ctx: dict) -> dict:
    """What the runtime launcher needs to know about a kernel, recorded in the manifest."""
    meta = {
        "kind": ctx["launch_kind"],
        "abi": {group: sig.key(ctx["launch_kind"], group) for group, sig in ctx["abi"].items()},
        "entries": ctx["entry_points"],
        "vec": ctx["vec"],
        "unroll": ctx["unroll"],
        "block_threads": 256,
        "ins": [{"name": s["name"], "kind": s["kind"]} for s in ctx["ins"]],
        "outs": [{"name": s["name"], "kind": s["kind"]} for s in ctx["outs"]],
    }
    meta.update(cell.block.launch_kind(cell.sku).launch_schedules(ctx))
    meta.update(ctx["launch_extra"])
    if ctx["shares"]:
        meta["shares"] = {group: host["sku"] for group, host in ctx["shares"].items()}
    return meta


def render_kernel(cell: Cell, ctx: dict = None) -> str:
    ctx = kernel_context(cell) if ctx is None else ctx
    text = _render(cell.block.template_for(cell.sku), f" (rendering {cell.sku})", k=ctx)
    return text.strip("\n") + "\n"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class RenderedKernel:
    cell: Cell
    text: str
    sha256: str       # of prelude (+ block headers) + this kernel (+ its hosts' texts, Block.shares): changes
                      # when anything it compiles from changes
    launch: dict
    abi: dict         # {abi id: [[name, packing], ...]} of its entry points' parameter lists


@dataclass
class RenderedUnit:
    path: str         # relative to generated/
    block: Block
    kernels: list

    def text(self, prelude_text: str) -> str:
        block = self.block
        head = (
            f"// Generated by skuforge codegen {GENERATOR_VERSION} -- do not edit; run `python -m codegen`.\n"
            f"// Family: {block.name}; template: templates/{block.template}\n"
            f"// Translation unit {self.path}: {len(self.kernels)} kernels\n"
        )
        body = "\n".join(k.text for k in self.kernels)
        return head + "\n" + prelude_text + "\n" + headers(block) + body


def render(cells) -> list:
    """Render every generated cell, grouped into translation units (sorted, deterministic)."""
    pre = prelude()
    units: dict = {}
    for cell in cells:
        if not cell.generated:
            continue
        ctx = kernel_context(cell)
        text = render_kernel(cell, ctx)
        meta = launch_metadata(cell, ctx)
        abi = {meta["abi"][group]: sig.record() for group, sig in ctx["abi"].items()}
        kernel = RenderedKernel(cell, text, sha256(pre + headers(cell.block) + text), meta, abi)
        path = cell.block.unit(cell.sku)
        units.setdefault(path, RenderedUnit(path, cell.block, [])).kernels.append(kernel)
    for unit in units.values():
        _link_shared(unit, pre)
    return [units[p] for p in sorted(units)]


def _link_shared(unit: RenderedUnit, pre: str) -> None:
    """The sha256 of a SKU that launches a host's entry points covers the host's text (what it
    runs); a host outside the unit, one that shares in turn, or a different parameter list for a
    shared group is a TemplateError."""
    by_sku = {str(k.cell.sku): k for k in unit.kernels}
    for k in unit.kernels:
        shares = k.launch.get("shares") or {}
        hosts = []
        for group, host_sku in sorted(shares.items()):
            host = by_sku.get(host_sku)
            why = ("is not generated in its unit" if host is None else
                   "launches shared entry points itself" if host.launch.get("shares") else
                   "declares another parameter list" if host.launch["abi"].get(group) != k.launch["abi"][group]
                   else None)
            if why:
                raise TemplateError(f"{k.cell.sku} launches the {group!r} entry points of {host_sku}, which {why}")
            if host not in hosts:
                hosts.append(host)
        if hosts:
            k.sha256 = sha256(pre + headers(unit.block) + k.text + "".join(h.text for h in hosts))
