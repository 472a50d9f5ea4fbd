"""The tile configurations (variants) of the grouped-matmul kernels and the choice among them: the
SKU's rule, ``CONFIG`` / ``SKUFORGE_MOE_CONFIG`` (docs/moe.md)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional


from .. import config
from ..axes import PASSES
from ..device import driver
from ..errors import InvalidProblemError


CONFIG_ENV = "SKUFORGE_MOE_CONFIG"
CONFIG: dict = {}           # pass ("fwd" / "dgrad" / "wgrad" / "*") -> variant name; wins over CONFIG_ENV

# -- tile configurations (variants) -----------------------------------------------------------
_PARSED = config.CACHES.new()     # configuration text -> its parsed form


def parse_config(text: str) -> dict:
    """``"name"`` -> {"*": name}; ``"fwd=a,dgrad=b"`` -> {"fwd": "a", "dgrad": "b"}."""
    text = (text or "").strip()
    got = _PARSED.get(text)
    if got is not None:
        return got
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part:
            key, _, name = (x.strip() for x in part.partition("="))
            if key not in ("fwd", "dgrad", "wgrad", "*"):
                raise InvalidProblemError(f"{CONFIG_ENV}: pass {key!r} in {text!r}; use fwd, dgrad, wgrad or *")
            out[key] = name
        else:
            out["*"] = part
    _PARSED[text] = out
    return out


@contextmanager
def use_config(spec=None, **passes):
    """``with use_config("128x128x32s5"):`` or ``use_config(fwd=..., wgrad=...)``: the variants the
    launcher runs inside the block (restores ``CONFIG`` after)."""
    if not (spec is None or isinstance(spec, (str, dict))):
        raise InvalidProblemError(f"use_config({spec!r:.60}): a configuration name, 'fwd=...,wgrad=...' or a dict "
                                  "of pass -> name is required")
    saved = dict(CONFIG)
    if isinstance(spec, str):
        CONFIG.update(parse_config(spec))
    elif spec:
        CONFIG.update(spec)
    CONFIG.update(passes)
    try:
        yield
    finally:
        CONFIG.clear()
        CONFIG.update(saved)


def variant_names(plan) -> list:
    """The tile configurations of a plan's SKU, default first (["default"] for simt)."""
    v = plan.launch.get("variants")
    if not v:
        return ["default"]
    default = plan.launch["default_variant"]
    return [default] + sorted(n for n in v if n != default)


def default_variant(plan, rows_per_expert: Optional[float] = None, cols: Optional[int] = None) -> str:
    """The SKU's configuration for a problem when none is asked for: its ``short_variant`` when the
    experts average fewer than ``short_rows`` rows, else its ``narrow_variant`` when the output tile
    axis (``cols``: N for the forward, K for the gradients) is at most ``narrow_cols`` wide, else its
    ``default_variant`` (codegen/families/moe/blocks.py declares the rule per SKU; docs/moe.md)."""
    launch, variants = plan.launch, plan.launch["variants"]
    short, narrow = launch.get("short_variant"), launch.get("narrow_variant")
    if short in variants and rows_per_expert is not None and rows_per_expert < launch["short_rows"]:
        return short
    if narrow in variants and cols is not None and cols <= launch["narrow_cols"]:
        return narrow
    return launch["default_variant"]


def _names_elsewhere(plan) -> set:
    """Configuration names of the other moe SKUs of the plan's op (another backend's): a name asked for
    configures the backend that has it, and leaves the others on their defaults."""
    reg, sku = getattr(plan, "registry", None), getattr(plan, "sku", None)
    if reg is None or sku is None:
        return set()
    out = set()
    for other in reg.query(category="moe", op=sku.op):
        if other.backend != sku.backend:
            out.update(reg.lookup(other).launch.get("variants") or ())
    return out


def variant_for(plan, op: str, dev: Optional[int] = None, rows_per_expert: Optional[float] = None,
                cols: Optional[int] = None) -> tuple:
    """(name, {"symbol", "tile", "dynamic_smem", "static_smem"}) of the tile configuration that runs ``op``:
    ``CONFIG``, else ``SKUFORGE_MOE_CONFIG``, else :func:`default_variant` (from the experts' average
    rows and the output columns ``cols``). A name of another backend's configuration leaves this
    plan on its default; an unknown name is an error. With ``dev``, a default that does not fit the
    device's shared memory falls back to the first configuration that does; an asked-for one that
    does not fit is an error."""
    variants = plan.launch.get("variants")
    if not variants:
        return "default", {"symbol": plan.entry.symbol, "tile": plan.launch["tile"],
                           "dynamic_smem": plan.launch["dynamic_smem"], "static_smem": plan.launch["static_smem"]}
    default = default_variant(plan, rows_per_expert, cols)
    key = PASSES[op]
    want = None
    for src in (CONFIG, parse_config(config.settings().moe_config)):
        want = src.get(key) or src.get("*")
        if want:
            break
    if not (want is None or isinstance(want, str)):
        raise InvalidProblemError(f"tile configuration {want!r:.60} (runtime.moe.CONFIG / use_config) is not a "
                                  f"configuration name; {plan.sku}'s: {', '.join(variants)}")
    name = default if want in (None, "", "default") else want
    if name not in variants:
        if name in _names_elsewhere(plan):
            name = default
        else:
            raise InvalidProblemError(f"tile configuration {name!r} ({CONFIG_ENV} / runtime.moe.CONFIG) is not one "
                                      f"of {plan.sku}'s: {', '.join(variants)}")
    meta = variants[name]
    if dev is not None:
        optin = driver().properties(dev)["smem_optin"]

        def fits(m):      # the kernel's static shared memory (manifest) and its dynamic ring
            return m["dynamic_smem"] + m["static_smem"] <= optin
        if not fits(meta):
            if name != default:
                raise InvalidProblemError(f"tile configuration {name!r} needs {meta['dynamic_smem'] + meta['static_smem']} "
                                          f"bytes of shared memory; this device allows {optin} per block")
            name = next((n for n in variant_names(plan) if fits(variants[n])), name)
            meta = variants[name]
    return name, meta
