"""Expert parallelism: an MoE layer with its experts spread over the GPUs of one machine
(runtime/torch/ep.py). Tokens go to the GPU that owns their experts and come back by
torch.distributed's all_to_all_single over NCCL; the experts run there as skuforge grouped matmuls,
forward and backward. The script checks the layer against the same layer on one GPU and, with
--bench, times a training step (forward + backward).

    torchrun --nproc-per-node 2 examples/ep_moe.py             # 2 GPUs: the checks
    torchrun --nproc-per-node 2 examples/ep_moe.py --bench     # and the time per step
    python examples/ep_moe.py                                  # one process: world size 1, NCCL

Needs PyTorch with NCCL and a CUDA GPU per process. The example leaves the environment as it
finds it: where NVLink multicast must stay off, set NCCL_NVLS_ENABLE=0 (and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1) in the command's environment.

Checks, on every rank, in float32 and bfloat16: this rank's outputs, input gradients and its
experts' weight gradients against the one-GPU layer (every expert, every rank's tokens) run on the
same GPU, and the router gradient summed over the ranks, within the grouped-matmul tolerances
(docs/numerics.md: relative Frobenius error 1e-5 float32, 1e-2 bfloat16); dw bit-identical across two runs; float32 also
against a float64 per-expert reference. --bench prints the median time of a step on W GPUs
(skuforge, torch._grouped_mm, the exchanges alone) and of the one-GPU layer on all W GPUs' tokens
(skuforge, torch._grouped_mm); --json PATH writes them as a record.
"""
import argparse
import json
import os
import statistics

try:
    import torch
    import torch.distributed as dist
except ImportError:
    raise SystemExit("ep_moe.py needs PyTorch (pip install torch) with NCCL and CUDA GPUs") from None

from runtime.torch import ep

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}     # docs/numerics.md, per grouped matmul


def setup() -> tuple:
    """(rank, world, group, device): torchrun's process group, or one process of world size 1."""
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        local = 0
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD, torch.device("cuda", local)


def step(layer, x, dy) -> tuple:
    """One forward + backward: (y, dx, dw1, dw2, drouter)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.w1.grad, layer.w2.grad, layer.router.grad


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    n = float(b.norm())
    return float((a - b).norm()) / n if n else float(a.norm())


def check(dtype, group, device, tokens=256, dim=256, hidden=512, experts=8, top_k=2) -> dict:
    world = dist.get_world_size(group)
    p = ep.init_weights(dim, hidden, experts, seed=0, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(world * tokens, dim, generator=g).to(dtype).to(device)
    DY = torch.randn(world * tokens, dim, generator=g).to(dtype).to(device)
    rows = ep.rank_slice(world * tokens, group)
    layer = ep.MoE(p["router"], p["w1"], p["w2"], top_k=top_k, group=group).to(device)
    whole = ep.MoE(p["router"], p["w1"], p["w2"], top_k=top_k, group=None).to(device)
    y, dx, dw1, dw2, drouter = step(layer, X[rows], DY[rows])
    dist.all_reduce(drouter, group=group)                 # data parallelism's sum of the router gradient
    again = step(layer, X[rows], DY[rows])
    Y, DX, DW1, DW2, DROUTER = step(whole, X, DY)
    pairs = {"y": (y, Y[rows]), "dx": (dx, DX[rows]), "dw1": (dw1, ep.owned(DW1, layer)),
             "dw2": (dw2, ep.owned(DW2, layer)), "drouter": (drouter, DROUTER)}
    out = {"err": {k: rel(a, b) for k, (a, b) in pairs.items()},
           "bits_as_one_gpu": all(torch.equal(a, b) for k, (a, b) in pairs.items() if k != "drouter"),
           "dw_deterministic": torch.equal(again[2], dw1) and torch.equal(again[3], dw2)}
    out["ok"] = max(out["err"].values()) <= TOLERANCE[dtype] and out["dw_deterministic"]
    if dtype == torch.float32:                            # the one-GPU layer against float64
        ref = ep.MoE(p["router"], p["w1"].double(), p["w2"].double(), top_k=top_k, experts="loop").to(device)
        R = step(ref, X.double(), DY.double())
        out["err_f64"] = max(rel(a, b) for a, b in zip((Y, DX, DW1, DW2), R[:4]))
        out["ok"] = out["ok"] and out["err_f64"] < 1e-4
    return out


def time_step(layer, x, dy, group, warmup: int, reps: int) -> float:
    """Median ms of a step (forward + backward) by CUDA events, every rank timing at once."""
    x = x.detach().clone().requires_grad_(True)

    def once():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)
    for _ in range(warmup):
        once()
    torch.cuda.synchronize()
    dist.barrier(group)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times)], device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)   # the slowest rank's median
    return float(t)


def bench(args, rank, group, device) -> list:
    world = dist.get_world_size(group)
    T, D, H, E, k = args.tokens, args.dim, args.hidden, args.experts, args.top_k
    p = ep.init_weights(D, H, E, seed=0, dtype=torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    dy = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    X = torch.randn(world * T, D, device=device, generator=g).to(torch.bfloat16)
    DY = torch.randn(world * T, D, device=device, generator=g).to(torch.bfloat16)
    has_gmm = hasattr(torch, "_grouped_mm")
    rows = []
    spread = f"experts over {world} GPU{'s' if world > 1 else ''}"
    for where, experts in ((spread, "skuforge"), (spread, "torch_grouped_mm"), (spread, "identity"),
                           ("one GPU, all tokens", "skuforge"), ("one GPU, all tokens", "torch_grouped_mm")):
        one = where != spread
        name = f"{where}, " + {"skuforge": "skuforge", "torch_grouped_mm": "torch._grouped_mm",
                               "identity": "exchanges only (no experts)"}[experts]
        if experts == "torch_grouped_mm" and not has_gmm:
            rows.append({"layer": name, "ms": None, "note": "torch._grouped_mm is not in this torch"})
            continue
        layer = ep.MoE(p["router"], p["w1"], p["w2"], top_k=k, group=None if one else group,
                       experts=experts).to(device)
        ms = time_step(layer, X if one else x, DY if one else dy, group, args.warmup, args.steps)
        # both layers process world * T tokens a step: forward + 2 backward products of 2 GEMMs each
        flops = 0 if experts == "identity" else 3 * 2 * 2 * world * T * k * D * H
        rows.append({"layer": name, "ms": ms, "tokens_per_s": world * T / ms * 1e3,
                     "expert_tflops": flops / ms / 1e9 if flops else None})
        del layer
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", action="store_true", help="time a step after the checks")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU (the one-GPU layer gets all GPUs')")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size of each expert")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the checks and times to this file (rank 0)")
    args = ap.parse_args(argv)
    rank, world, group, device = setup()
    try:
        checks = {str(dt).replace("torch.", ""): check(dt, group, device) for dt in (torch.float32, torch.bfloat16)}
        ok = torch.tensor([int(all(c["ok"] for c in checks.values()))], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not all(c["ok"] for c in checks.values()):
            print(f"ep_moe rank {rank}: FAILED {checks}", flush=True)
        gpu = torch.cuda.get_device_name(device)
        record = {"world": world, "gpu": gpu, "torch": torch.__version__, "checks": checks}
        if rank == 0:
            parts = []
            for name, c in checks.items():
                e = max(c["err"].values())
                extra = f", vs float64 {c['err_f64']:.1e}" if "err_f64" in c else ""
                parts.append(f"{name}: max rel err vs one GPU {e:.1e} (y, dx, dw1, dw2, drouter){extra}, "
                             f"dw bit-identical across runs: {'yes' if c['dw_deterministic'] else 'NO'}, "
                             f"bits as one GPU: {'yes' if c['bits_as_one_gpu'] else 'no'}")
            print(f"ep_moe: world {world} ({gpu}); " + "; ".join(parts), flush=True)
        if not int(ok):
            return 1
        if args.bench:
            rows = bench(args, rank, group, device)
            record["bench"] = {"config": {"tokens_per_gpu": args.tokens, "dim": args.dim, "hidden": args.hidden,
                                          "experts": args.experts, "top_k": args.top_k, "dtype": "bfloat16",
                                          "steps": args.steps}, "rows": rows}
            if rank == 0:
                print(f"ep_moe bench: {world} x {gpu}, E{args.experts} top-{args.top_k}, dim {args.dim}, hidden "
                      f"{args.hidden}, bfloat16, {args.tokens} tokens per GPU ({world * args.tokens} in all); "
                      "step = forward + backward, median of the slowest rank")
                print(f"  {'layer':50s} {'step ms':>9s} {'tokens/s':>11s} {'expert TFLOP/s':>15s}")
                for r in rows:
                    if r["ms"] is None:
                        print(f"  {r['layer']:50s} {'-':>9s}   {r['note']}")
                        continue
                    tf = f"{r['expert_tflops']:.0f}" if r["expert_tflops"] else "-"
                    print(f"  {r['layer']:50s} {r['ms']:9.3f} {r['tokens_per_s']:11.0f} {tf:>15s}")
        if args.json and rank == 0:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("ep_moe.py needs a CUDA GPU per process: PyTorch sees none")
    if not dist.is_nccl_available():
        raise SystemExit("ep_moe.py needs PyTorch built with NCCL")
    raise SystemExit(main())
