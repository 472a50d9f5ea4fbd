"""Latency probe: the (16, 4096) benchmark shape, skuforge against torch.compile.

On the GPU machine:

    PYTHONPATH=. python3 tools/probe_small.py --out probe_small.json
    PYTHONPATH=. ncu --clock-control none --kernel-name regex:'sf_|triton' --metrics \\
        gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \\
        python3 tools/probe_small.py --ncu > ncu_small.txt

Cases: dynamic_quantize token / group(128) bf16 -> s8 under each fused launch configuration
(runtime.quantization.fused.FusedConfig), per-tensor (one cooperative launch and the two-pass path), the static
quantize token bf16 -> s8, and the torch.compile of each composite, timed the way ``codegen bench``
times (codegen.harness.bench.timing.Timer: CUDA events, GPU time per call, L2-rotated input sets). ``--ncu``: each
case a few times with no timing, for Nsight Compute's in-kernel durations (what the events add).
"""
from __future__ import annotations

import argparse
import json
import sys

SHAPE = (16, 4096)
# t2 (2 chunks per thread; ch=1: one, Triton's shape for token) and small blocks (more of them):
# the candidates for auto on problems too small for two warps per SM
FUSED = ("auto", "auto,fixed=0", "block", "t4", "t8", "t4,threads=64", "t4,threads=32", "t2", "t2,ch=1", "t2,threads=64",
         "t2,threads=32", "t2,ch=1,threads=64", "t2,ch=1,threads=32")


def cases(torch, sf):
    """(label, our call, torch composite or None, runtime.config fields) for every case; inputs rotate
    over 8 sets."""
    from codegen.harness.workloads import dynamic as bench_dynamic
    from codegen.harness.workloads import static as bench_static
    from runtime.registry import default_registry
    reg = default_registry()
    sku_of = {(s.op, s.scope, s.mode, s.element, s.aux_element): s for s in reg.skus() if s.arch == "sm80"}
    out = []
    for scope in ("token", "group", "tensor"):
        sku = sku_of[("dynamic_quantize", scope, "symmetric", "bf16", "s8")]
        ws = [bench_dynamic.make(sku, SHAPE) for _ in range(8)]
        variants = FUSED if scope != "tensor" else ("one-launch", "two-pass")
        for v in variants:
            def call(ws=ws, i=[0]):
                i[0] += 1
                return ws[i[0] % 8]["call"]()
            fields = {"schedule": v} if scope == "tensor" else {"dynamic_config": v}
            out.append((f"dynamic {scope} {v}", call, None, fields))
        compiled = torch.compile(ws[0]["torch_fn"], fullgraph=True, dynamic=False)
        out.append((f"dynamic {scope} torch.compile", None,
                    lambda ws=ws, c=compiled, i=[0]: (i.__setitem__(0, i[0] + 1), c(*ws[i[0] % 8]["torch_args"])), {}))
    sku = sku_of[("quantize", "token", "symmetric", "bf16", "s8")]
    ws = [bench_static.make(sku, SHAPE) for _ in range(8)]
    out.append(("quantize token", lambda ws=ws, i=[0]: (i.__setitem__(0, i[0] + 1), ws[i[0] % 8]["call"]()), None, {}))
    if ws[0].get("torch_fn") is not None:
        compiled = torch.compile(ws[0]["torch_fn"], fullgraph=True, dynamic=False)
        out.append(("quantize token torch.compile", None,
                    lambda ws=ws, c=compiled, i=[0]: (i.__setitem__(0, i[0] + 1), c(*ws[i[0] % 8]["torch_args"])), {}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--ncu", action="store_true")
    a = ap.parse_args(argv)
    import torch

    import runtime as sf
    from codegen.harness.bench.timing import Timer
    from runtime import config
    results = []
    for label, ours, theirs, fields in cases(torch, sf):
        fn = ours or theirs
        if a.ncu:
            with config.override(**fields):
                for _ in range(4):
                    fn()
                torch.cuda.synchronize()
            print(label, flush=True)
            continue
        from runtime.arrays import cupy_stream
        stream = cupy_stream(torch.cuda.current_stream().cuda_stream, 0)
        with stream, config.override(**fields):
            r = Timer(stream, a.samples, 5.0).measure([fn])
        results.append({"label": label, "us": round(r["ms"] * 1e3, 2), "p10_us": round(r["p10_ms"] * 1e3, 2),
                        "p90_us": round(r["p90_ms"] * 1e3, 2)})
        print(f"{label:40s} {results[-1]['us']:7.2f} µs  (p10 {results[-1]['p10_us']:.2f}, p90 {results[-1]['p90_us']:.2f})",
              flush=True)
    if a.out and results:
        with open(a.out, "w") as f:
            json.dump({"shape": SHAPE, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
