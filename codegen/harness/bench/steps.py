"""Step time of the examples (``python -m codegen bench --examples``): each example's step with
skuforge's ops in eager mode and under ``torch.compile(fullgraph=True)``, beside the same step in
plain PyTorch, eager and compiled, on one GPU.

A step is what the example repeats: a W8A8 / FP8 linear forward (activation quantization + the
matrix product) at 4096 x 4096 x 4096 bf16, a training step (forward, backward, optimizer) of the
QAT MLP and of the MoE layer at the examples' own sizes. Time per step is wall-clock (host and
device): 5 warm-up steps (compiles), then the median over 5 repeats of 20 steps ended by one
synchronization.
"""
from __future__ import annotations

import importlib.util
import statistics
import sys
import time

from ..records import ROOT

EXAMPLES = ROOT / "examples"
LINEAR_SHAPE = (4096, 4096, 4096)      # M, K, N


def example_module(name: str):
    """An example script as a module, registered in sys.modules (Dynamo looks up the module of every
    function it traces by name)."""
    mod_name = f"skuforge_example_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def _linear_steps(torch, device: str) -> list:
    M, K, N = LINEAR_SHAPE
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(N, K, device=device, generator=g) / K ** 0.5).to(torch.bfloat16)
    out = []
    w8, fp8 = example_module("w8a8_linear"), example_module("fp8_linear")
    wq, ws = w8.quantize_weight(w)
    out.append(("w8a8_linear forward", f"M={M} K={K} N={N} bf16", w8.w8a8_linear, w8.w8a8_linear_torch,
                (x, wq, ws)))
    fq, fs = fp8.quantize_weight(w)
    out.append(("fp8_linear row-wise forward", f"M={M} K={K} N={N} bf16", fp8.fp8_rowwise, fp8.fp8_rowwise_torch,
                (x, fq, fs)))
    return out


def _training_step(torch, layer, params: dict, x, target, make_opt, compiled: bool, clamp=None):
    params = {k: torch.nn.Parameter(v.detach().clone()) for k, v in params.items()}
    opt = make_opt(params.values())

    def loss_fn(x, target):
        return torch.nn.functional.mse_loss(layer(params, x), target)

    fn = torch.compile(loss_fn, fullgraph=True) if compiled else loss_fn

    def step():
        opt.zero_grad()
        fn(x, target).backward()
        opt.step()
        if clamp is not None:
            clamp(params)
    return step


def _train_steps(torch, device: str) -> list:
    out = []
    qat = example_module("qat_mlp")
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(256, 64, device=device, generator=g)
    target = torch.randn(256, 16, device=device, generator=g) * 0.5

    def clamp(p):
        with torch.no_grad():
            p["s1"].clamp_(min=qat.SCALE_EPS)
            p["s2"].clamp_(min=qat.SCALE_EPS)
    out.append(("qat_mlp training step", "batch 256, 64 -> 128 -> 16, f32", qat.mlp_skuforge, qat.mlp_torch,
                (qat.init(device), x, target, lambda ps: torch.optim.SGD(ps, lr=0.05), clamp)))
    moe = example_module("moe_layer")
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(512, 128, device=device, generator=g)
    target = torch.tanh(x @ torch.randn(128, 128, device=device, generator=g) / 128 ** 0.5)
    out.append(("moe_layer training step", "M=512, d=128, hidden 256, 8 experts top-1, f32", moe.moe,
                moe.moe_reference, (moe.init(device), x, target, lambda ps: torch.optim.Adam(ps, lr=3e-3), None)))
    return out


def _wall_ms(torch, step, warmup: int = 5, steps: int = 20, repeats: int = 5) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(per)


def measure_example_steps(device: int = 0, log=print) -> list:
    """Rows ``{example, shape, variant, ms}`` (or ``error``) for the four variants of every step."""
    import torch
    dev = f"cuda:{device}"
    rows = []
    for name, shape, ours, plain, args in _linear_steps(torch, dev):
        for variant, fn in (("skuforge eager", ours),
                            ("skuforge compiled", torch.compile(ours, fullgraph=True)),
                            ("plain PyTorch eager", plain),
                            ("plain PyTorch compiled", torch.compile(plain, fullgraph=True))):
            rows.append(_row(torch, name, shape, variant, lambda fn=fn: fn(*args), log))
    for name, shape, ours, plain, (params, x, target, make_opt, clamp) in _train_steps(torch, dev):
        for variant, layer, compiled in (("skuforge eager", ours, False), ("skuforge compiled", ours, True),
                                         ("plain PyTorch eager", plain, False),
                                         ("plain PyTorch compiled", plain, True)):
            try:
                step = _training_step(torch, layer, params, x, target, make_opt, compiled, clamp)
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                rows.append({"example": name, "shape": shape, "variant": variant,
                             "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            rows.append(_row(torch, name, shape, variant, step, log))
    return rows


def _row(torch, name, shape, variant, step, log) -> dict:
    r = {"example": name, "shape": shape, "variant": variant}
    try:
        r["ms"] = round(_wall_ms(torch, step), 4)
        log(f"example step {name} [{variant}]: {r['ms']:.3f} ms")
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"example step {name} [{variant}]: {r['error']}")
    finally:
        torch._dynamo.reset()
    return r


def to_markdown(rows: list) -> list:
    if not rows:
        return []
    variants = ["skuforge eager", "skuforge compiled", "plain PyTorch eager", "plain PyTorch compiled"]
    lines = ["## Example steps (wall-clock ms per step, one GPU)", "",
             "| step | size | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    seen = []
    for r in rows:
        if (r["example"], r["shape"]) not in seen:
            seen.append((r["example"], r["shape"]))
    for name, shape in seen:
        cells = []
        for v in variants:
            r = next((r for r in rows if (r["example"], r["shape"], r["variant"]) == (name, shape, v)), None)
            cells.append("" if r is None else (f"{r['ms']:.3f}" if "ms" in r else f"error: {r['error'][:80]}"))
        lines.append(f"| {name} | {shape} | " + " | ".join(cells) + " |")
    return lines + [""]
