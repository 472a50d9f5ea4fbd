"""GPU checks of the moe SKUs: every op against the float64 reference (the tolerances of docs/numerics.md).

Cases: balanced, skewed and empty-expert routings, padding rows (int32 and uint32 ids),
offsets (int32 and int64), strided rows, many experts, odd shapes (M=1, N=7, K=3; simt only:
the mma kernels need N, K multiples of 8). The wgmma kernels take offsets routing only: they run
every case with its rows sorted by expert (``WGMMA_ROUTING``: the id routings become offsets, the
padding ones trusted offsets that end before M, so the rows after them are padding), plus long
experts (several k-slices of the weight gradient, with a partial last one). Extra exact checks:
padding rows and experts without rows give exact zeros, the backward gives the same bits twice,
and the plan the API picks for ``strategy=<backend>`` is the SKU under test.
"""
from __future__ import annotations

import numpy as np

import runtime as sf
from runtime import kinds
from runtime import reference_moe as ref
from runtime.axes import OPS, PASSES
from runtime.arrays import numpy_dtype

from .base import CheckResult, strided_rows, to_device, to_host

# (label, E, M, N, K, routing, strided); routing in balanced / skewed / empty / padding /
# padding_u32 / offsets_i64
CASES = [
    ("balanced", 4, 256, 64, 64, "balanced", False),
    ("skewed", 8, 333, 96, 136, "skewed", False),
    ("empty experts (offsets)", 6, 200, 40, 72, "empty", False),
    ("padding rows (int32 ids)", 5, 150, 24, 48, "padding", False),
    ("padding rows (uint32 ids), K tail", 3, 97, 128, 520, "padding_u32", False),
    ("offsets int64, strided rows", 4, 300, 136, 64, "offsets_i64", True),
    ("one row", 1, 1, 8, 8, "balanced", False),
    ("many experts", 1024, 2048, 8, 16, "skewed", False),
    ("two m-tiles per expert", 2, 520, 264, 200, "balanced", False),
]
WGMMA_CASES = [   # rows per expert past several 64-row k-slices of the weight gradient, partial tiles
    ("long experts", 3, 1000, 264, 200, "skewed", False),
    ("long experts, N and K tails", 2, 777, 136, 328, "balanced", True),
]
# routing kind of a case -> the sorted (offsets) routing the wgmma kernels run it with
WGMMA_ROUTING = {"balanced": "sorted", "skewed": "sorted_skewed", "padding": "tail_padding",
                 "padding_u32": "tail_padding"}
ODD_CASES = [   # simt only
    ("M=1 N=7 K=3", 2, 1, 7, 3, "balanced", False),
    ("odd shapes, skewed", 3, 37, 13, 5, "skewed", False),
    ("odd shapes, padding, strided", 7, 90, 9, 11, "padding", True),
    ("E=1024 odd", 1024, 700, 9, 11, "padding_u32", False),
]


def make_routing(kind: str, E: int, M: int, rng):
    """(row_experts or None, offsets or None). Sorted kinds (offsets): ``empty``, ``offsets_i64``,
    ``sorted_skewed``, ``tail_padding`` (offsets end at M - M // 5: trusted offsets, padding after),
    any other: multinomial counts."""
    if kind in ("balanced", "skewed", "padding", "padding_u32"):
        if kind == "skewed":
            p = 1.0 / (np.arange(E) + 1.0) ** 2
            ids = rng.choice(E, size=M, p=p / p.sum())
        else:
            ids = rng.permutation(np.arange(M) % E)
        if kind == "padding":
            ids = np.where(rng.random(M) < 0.2, rng.choice([-1, -7, E, E + 3], size=M), ids)
            return ids.astype(np.int32), None
        if kind == "padding_u32":
            ids = ids.astype(np.int64)
            ids = np.where(rng.random(M) < 0.2, rng.choice([E, 2**31, 2**32 - 1], size=M), ids)
            return ids.astype(np.uint32), None
        return ids.astype(np.int32), None
    rows = M - M // 5 if kind == "tail_padding" else M
    p = 1.0 / (np.arange(E) + 1.0) ** 2 if kind == "sorted_skewed" else np.ones(E)
    counts = rng.multinomial(rows, p / p.sum()) if E > 1 else np.array([rows])
    if kind == "empty" and E >= 4:
        zero = sorted({0, E // 2, E - 1})              # first, middle and last expert: no rows
        keep = min(set(range(E)) - set(zero))
        counts = counts.copy()
        counts[keep] += counts[zero].sum()
        counts[zero] = 0
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return None, offsets.astype(np.int64 if kind == "offsets_i64" else np.int32)


def random_problem(E, M, N, K, kind, rng):
    x = rng.standard_normal((M, K)).astype(numpy_dtype(kind))
    w = (rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(numpy_dtype(kind))
    dy = rng.standard_normal((M, N)).astype(numpy_dtype(kind))
    return x, w, dy


def _dev(a, fw, strided, rng):
    d = to_device(a, fw)
    if strided and a.shape[0] > 1:
        d = strided_rows(d, 8 * int(rng.integers(1, 4)), fw)   # row stride stays a multiple of 8
    return d


def _dw_dtype(sku):
    return "float32" if (sku.aux_element == "f32" or sku.element == "f32") else kinds.kind(sku.element).numpy


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def run_case(sku, case, rng, fw="cupy"):
    """(label, rel error, exact-check failures) of one case of one SKU."""
    label, E, M, N, K, routing, strided = case
    if sku.backend == "wgmma":
        routing = WGMMA_ROUTING.get(routing, routing)
    kind = sku.element
    x, w, dy = random_problem(E, M, N, K, kind, rng)
    row_experts, offsets = make_routing(routing, E, M, rng)
    trusted = routing == "tail_padding"
    if trusted:    # rows past offsets[E] are padding: the reference takes them as ids -1
        row_experts = np.concatenate([np.repeat(np.arange(E), np.diff(offsets)),
                                      np.full(M - offsets[-1], -1)]).astype(np.int32)
    experts = ref.expert_of_rows(M, E, row_experts, None if trusted else offsets)
    xd, wd, dyd = _dev(x, fw, strided, rng), to_device(w, fw), _dev(dy, fw, strided, rng)
    rd = None if row_experts is None or trusted else to_device(row_experts, fw)
    od = None if offsets is None else to_device(offsets, fw)
    route = dict(row_experts=rd, offsets=od, strategy=sku.backend, trusted_offsets=trusted)
    bad = []
    plan = sf.moe.select_plan(sku.op, xd, wd, dyd, dw_dtype=_dw_dtype(sku), **route)
    if plan.sku != sku:
        bad.append(f"strategy={sku.backend!r} selected {plan.sku}")
    if sku.op == "grouped_matmul":
        got = to_host(sf.grouped_matmul(xd, wd, **route))
        want = ref.grouped_matmul(x, w, row_experts=row_experts, offsets=None if trusted else offsets)
        if np.any(got[experts < 0].astype(np.float64) != 0):
            bad.append("padding rows of y are not exactly 0")
    else:
        need_input = sku.op == "grouped_matmul_backward_input"
        outs = []
        for _ in range(2):
            dx, dw = sf.grouped_matmul_backward(xd, wd, dyd, need_input=need_input, need_weight=not need_input,
                                                dw_dtype=_dw_dtype(sku), **route)
            outs.append(to_host(dx if need_input else dw))
        got = outs[0]
        if not _same_bits(outs[0], outs[1]):
            bad.append("two runs gave different bits")
        want_dx, want_dw = ref.grouped_matmul_backward(x, w, dy, row_experts=row_experts,
                                                       offsets=None if trusted else offsets)
        want = want_dx if need_input else want_dw
        if need_input and np.any(got[experts < 0].astype(np.float64) != 0):
            bad.append("padding rows of dx are not exactly 0")
        if not need_input:
            empty = np.setdiff1d(np.arange(E), experts[experts >= 0])
            if empty.size and np.any(got[empty].astype(np.float64) != 0):
                bad.append(f"dw of experts without rows ({empty[:5].tolist()}) is not exactly 0")
    want_kind = "f32" if sku.aux_element == "f32" else kind
    if got.dtype != numpy_dtype(want_kind):
        bad.append(f"output dtype {got.dtype}, expected {numpy_dtype(want_kind)}")
    return f"{label} E={E} M={M} N={N} K={K} {routing}", ref.rel_error(got, want), bad


def variants_of(sku) -> list:
    """The tile configurations compiled into a SKU (default first; ["default"] for simt)."""
    e = sf.default_registry().lookup(sku)
    v = e.launch.get("variants")
    if not v:
        return ["default"]
    return [e.launch["default_variant"]] + sorted(n for n in v if n != e.launch["default_variant"])


def check_moe(sku, rng, preferred_fw="cupy", variants=None) -> CheckResult:
    """Every case on every tile configuration of the SKU (``variants``: a subset by name)."""
    res = CheckResult(str(sku), False)
    tol = ref.TOLERANCE[sku.element]
    cases = CASES + {"simt": ODD_CASES, "wgmma": WGMMA_CASES}.get(sku.backend, [])
    pass_ = PASSES[sku.op]
    names = variants_of(sku) if variants is None else list(variants)
    for name in names:
        with sf.moe.use_config(**({pass_: name} if sku.backend != "simt" else {})):
            for case in cases:
                label, err, bad = run_case(sku, case, rng, preferred_fw)
                if len(names) > 1:
                    label = f"[{name}] {label}"
                res.cases += 1
                res.max_error = max(res.max_error, err)
                if err > tol or bad:
                    res.mismatches += 1
                    res.failures.append(f"{label}: rel err {err:.3g} (tol {tol:g})" + ("; " + "; ".join(bad) if bad else ""))
    res.passed = res.mismatches == 0 and res.cases > 0
    res.detail = f"{res.cases} cases ({len(names)} tile configuration{'s' if len(names) > 1 else ''}), " \
                 f"max rel Frobenius error {res.max_error:.3g} (tol {tol:g}), {res.mismatches} failing"
    return res


# the checkers of this family, by op (codegen.harness.families)
CHECKERS = dict.fromkeys(OPS["moe"], check_moe)
