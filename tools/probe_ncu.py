"""Hardware-counter profile of the kernels that miss their bandwidth targets, under Nsight Compute.

On a GPU machine where Nsight Compute may read the counters (docs/audit.md, "compute-sanitizer sweep"):

    PYTHONPATH=. ncu --clock-control none --section SpeedOfLight --section SchedulerStats \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        python3 tools/probe_ncu.py > ncu.txt

Each case runs its op twice (the first call compiles and loads, so ncu profiles both; read the
second). What to read per kernel: "DRAM Throughput" (% of peak; a device copy reaches about 88 %
of peak on the H200), "Issued Warp Per Scheduler" / "No Eligible" (issue-bound or latency-bound),
and the warp stall reasons.

The MoE cases (``moe`` in the name: E128 M16384 N1536 K2048, balanced offsets routing, bf16, the
wgmma kernels) are the ones under their targets against ``torch._grouped_mm``; each runs ours,
torch's same product, and a plain device copy of w (805 MB: the floor of the forward's DRAM
stream). Profile them with the memory sections:

    PYTHONPATH=. ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis_Tables --section Occupancy --section WarpStateStats \\
        python3 tools/probe_ncu.py moe > ncu_moe.txt

and read, ours against torch's and the copy: "DRAM Throughput", "dram__bytes_read.sum",
"L2 Hit Rate", "lts__t_sectors_srcunit_tex_op_read.sum" and the long-scoreboard stalls.
"""
from __future__ import annotations

import sys

CASES = (  # (name, shape): the kernels that miss their bandwidth or host-time targets
    ("quantize token bf16->s8", (8192, 8192)),
    ("quantize group bf16->s8", (8192, 8192)),
    ("dequantize group s8->bf16", (8192, 8192)),
    ("dynamic token bf16->s8", (8192, 8192)),
    ("dynamic group bf16->s8", (8192, 8192)),
    ("dynamic group bf16->s4", (65536, 4096)),
    ("dynamic tensor bf16->s8", (8192, 8192)),
    ("fake_quantize_backward channel bf16", (8192, 8192)),
    ("moe forward E128 balanced", (128, 16384, 1536, 2048, "balanced")),
    ("moe weight gradient f32 E128 balanced", (128, 16384, 1536, 2048, "balanced")),
)


def run_moe(name: str, shape, torch, sf) -> None:
    """Ours (wgmma), then torch._grouped_mm on the same data, then a copy of w; twice each."""
    from codegen.harness.workloads.moe import calls, inputs
    d = inputs(shape)
    op = "grouped_matmul" if "forward" in name else "grouped_matmul_backward_weight"
    ours, ref = calls(op, d, backend="wgmma")
    w_copy = torch.empty_like(d["w"])
    for _ in range(2):
        ours()
        if ref is not None:
            ref()
        w_copy.copy_(d["w"])
        torch.cuda.synchronize()


def run(name: str, shape, torch, sf) -> None:
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    rows, cols = shape
    gscale = torch.rand((rows, cols // 128), device="cuda", dtype=torch.float32) + 0.01
    for _ in range(2):
        if name.startswith("quantize token"):
            sf.quantize(x, torch.rand((rows,), device="cuda") + 0.01, scope="token")
        elif name.startswith("quantize group"):
            sf.quantize(x, gscale, scope="group", group_size=128)
        elif name.startswith("dequantize group"):
            q = torch.randint(-128, 127, shape, device="cuda", dtype=torch.int8)
            sf.dequantize(q, gscale, scope="group", group_size=128, out_dtype="bfloat16")
        elif name.startswith("dynamic token"):
            sf.dynamic_quantize(x, scope="token")
        elif name.startswith("dynamic group bf16->s8"):
            sf.dynamic_quantize(x, scope="group", group_size=128)
        elif name.startswith("dynamic group bf16->s4"):
            sf.dynamic_quantize(x, scope="group", group_size=128, out_dtype="int4")
        elif name.startswith("dynamic tensor"):
            sf.dynamic_quantize(x, scope="tensor")
        elif name.startswith("fake_quantize_backward"):
            s = torch.rand((cols,), device="cuda") + 0.01
            z = torch.zeros((cols,), device="cuda", dtype=torch.int32)
            sf.fake_quantize_backward(x, x, s, z, scope="channel", axis=1, qmin=-128, qmax=127)
        torch.cuda.synchronize()


def main() -> int:
    import torch

    import runtime as sf
    for name, shape in CASES:
        if len(sys.argv) > 1 and not any(a in name for a in sys.argv[1:]):
            continue
        print(f"== {name} {shape}", flush=True)
        try:
            (run_moe if name.startswith("moe") else run)(name, shape, torch, sf)
        except Exception as exc:     # a failing case must not hide the others' profiles
            print(f"   failed: {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
