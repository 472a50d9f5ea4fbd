"""Probe: cache-policy hints on the loads of x and the stores of q (dynamic per-token / per-group /
per-tensor), against the shipped kernels, in one run.

On the GPU machine:

    PYTHONPATH=. python3 tools/probe_hints.py --out probe_hints.json

Each variant is the shipped generated source with one textual substitution (applied to a copy of
generated/ in a temporary folder, so its kernels compile and cache apart): ``ldcs`` (the team
kernels' 16-byte loads of x as ``ld.global.cs``, evict-first), ``stcs`` (every 8-byte vector
store as ``st.global.cs``: q streams past L2), ``both``. ``--tree NAME=DIR`` adds a variant whose
dynamic bf16 / f16 -> s8 units are those of DIR (a generated/ tree rendered from other templates:
an A/B of a template change in the same run); ``--config NAME=TEXT`` runs variant NAME under a
fused launch configuration (e.g. ``auto,fixed=0``: the run-time-TX team kernels); ``--variants``
and ``--cases`` pick what runs. Every variant must give the shipped kernel's bits (checked on the
whole output); times are CUDA events (codegen.harness.bench.timing.Timer, two input sets rotated) and "% copy" is
against the bench's device copy (codegen.harness.bench.timing.copy_bandwidth), as ``codegen bench`` reports it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import probe_dynamic as pd  # noqa: E402

LOAD = "if (j < nch) w = __ldg(reinterpret_cast<const uint4*>(p));"
STORE = "*reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(&r);"
VARIANTS = {
    "shipped": [],
    "ldcs": [(LOAD, "if (j < nch) w = __ldcs(reinterpret_cast<const uint4*>(p));")],
    "stcs": [(STORE, "__stcs(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(&r));")],
}
VARIANTS["both"] = VARIANTS["ldcs"] + VARIANTS["stcs"]
CASES = [(("bf16", "s8", "group", "symmetric"), (8192, 8192)), (("bf16", "s8", "group", "symmetric"), (65536, 4096)),
         (("bf16", "s8", "token", "symmetric"), (8192, 8192)), (("bf16", "s8", "tensor", "symmetric"), (8192, 8192)),
         (("f16", "s8", "group", "symmetric"), (8192, 8192)), (("bf16", "s8", "token", "symmetric"), (16, 4096)),
         (("bf16", "s8", "group", "symmetric"), (16, 4096))]
UNITS = ("quantization/dynamic_quantize_bf16_s8.cu", "quantization/dynamic_quantize_f16_s8.cu")


def patched_registry(name: str, subs):
    """A copy of generated/ whose every unit has the substitutions applied (each must match), or
    (subs a Path) whose dynamic units are those of that tree."""
    from codegen.manifest import GENERATED
    from runtime.registry import Registry
    if not subs:
        return Registry.load(GENERATED)
    root = Path(tempfile.mkdtemp(prefix=f"skuforge-{name}-")) / "generated"
    shutil.copytree(GENERATED, root)
    for unit in UNITS:
        if isinstance(subs, Path):
            shutil.copyfile(subs / unit, root / unit)
            continue
        text = (root / unit).read_text()
        for old, new in subs:
            assert old in text, (unit, old)
            text = text.replace(old, new)
        (root / unit).write_text(text)
    return Registry.load(root)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe_hints.json")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a variant whose dynamic units come from the generated/ tree DIR")
    ap.add_argument("--variants", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=TEXT",
                    help="run variant NAME (the shipped tree unless --tree names it) under this fused launch "
                         "configuration (runtime.quantization.fused.FusedConfig text, e.g. 'auto,fixed=0')")
    ap.add_argument("--cases", help="comma-separated substrings; a case runs when its label holds one")
    a = ap.parse_args()
    for spec in a.tree:
        name, _, d = spec.partition("=")
        VARIANTS[name] = Path(d)
    configs = {}
    for spec in a.config:
        name, _, text = spec.partition("=")
        configs[name] = text
        VARIANTS.setdefault(name, [])
    if a.variants:
        for v in [v for v in VARIANTS if v not in a.variants.split(",")]:
            del VARIANTS[v]
    if a.cases:
        CASES[:] = [(c, s) for c, s in CASES
                    if any(k in "/".join(c) + " " + "x".join(map(str, s)) for k in a.cases.split(","))]

    from codegen.harness.bench.timing import Timer, copy_bandwidth, gbps
    from codegen.harness.verify import environment
    from runtime import config
    from runtime.plans import Descriptor, Plan, Preference
    env = environment(0)
    arch = int(env["gpu"]["cc"].replace(".", ""))
    regs = {v: patched_registry(v, subs) for v, subs in VARIANTS.items()}
    plans = {(v, c): Plan.select(Descriptor("dynamic_quantize", c[2], c[3], c[0], c[1]), Preference(arch=arch), r)
             for v, r in regs.items() for c, _ in CASES}
    pd.precompile(plans.values(), arch)
    import torch
    from runtime.arrays import cupy_stream
    stream = cupy_stream(torch.cuda.current_stream().cuda_stream, 0)
    results = []
    with stream:
        timer = Timer(stream, a.samples, 5.0)
        copy = copy_bandwidth(timer)
        print(f"{env['gpu']['name']}: device copy {copy['gbps']:.0f} GB/s", flush=True)
        for case, shape in CASES:
            xs = [pd.random_x(case[0], shape, torch, specials=(i == 0)) for i in range(2)]
            sets = [pd.make_args(case, shape, x, torch) for x in xs]
            nbytes = pd.expected_bytes(case, shape)
            ref = None
            for v in VARIANTS:
                with config.override(dynamic_config=configs.get(v, "auto")):
                    plan = plans[(v, case)]
                    pd.poison(sets[0][1], torch)
                    plan.run(sets[0][0])
                    torch.cuda.synchronize()
                    outs = [None if o is None else o.clone() for o in sets[0][1]]
                    ref = ref or outs
                    exact = all(pd.bits_equal(o, w, torch) for o, w in zip(outs, ref))
                    m = timer.measure([lambda s=s, p=plan: p.run(s[0]) for s in sets])
                    r = {"case": "/".join(case), "shape": list(shape), "variant": v, "exact": exact, "us": m["ms"] * 1e3,
                         "gbps": gbps(nbytes, m["ms"]), "pct_copy": 100 * gbps(nbytes, m["ms"]) / copy["gbps"]}
                    results.append(r)
                    print(f"{r['case']:28s} {'x'.join(map(str, shape)):>10} {v:8s} {r['us']:8.1f} us {r['gbps']:6.0f} GB/s "
                          f"{r['pct_copy']:5.1f}% exact={'yes' if exact else 'NO'}", flush=True)
            del xs, sets, ref
            torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps({"env": env, "copy": copy, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
