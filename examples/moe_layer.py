"""An MoE layer (top-1 routing, experts as grouped matmuls) trained for a few steps:
tokens sorted by expert -> offsets -> grouped_matmul -> GELU -> grouped_matmul -> unsorted,
scaled by the router probability. Forward and gradients are checked against a float64 PyTorch
reference first.

    python examples/moe_layer.py            # needs PyTorch and a CUDA GPU
"""
try:
    import torch
except ImportError:
    raise SystemExit("moe_layer.py needs PyTorch (pip install torch) and a CUDA GPU") from None

import runtime.torch as sft


def init(device: str, d: int = 128, hidden: int = 256, experts: int = 8, dtype=torch.float32, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        "router": (torch.randn(experts, d, device=device, generator=g) / d ** 0.5).to(dtype),
        "w1": (torch.randn(experts, hidden, d, device=device, generator=g) / d ** 0.5).to(dtype),
        "w2": (torch.randn(experts, d, hidden, device=device, generator=g) / hidden ** 0.5).to(dtype),
    }


def route(x: torch.Tensor, router: torch.Tensor):
    """(order, offsets int32 [E+1], gate [M]): top-1 expert per token, tokens sorted by expert."""
    probs = torch.softmax(x.float() @ router.float().t(), dim=-1)
    gate, expert = probs.max(dim=-1)
    order = torch.argsort(expert, stable=True)
    counts = torch.zeros(router.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
        0, expert, torch.ones_like(expert))                                   # [E]: a static shape, no graph break
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return order, offsets, gate


def moe(p: dict, x: torch.Tensor) -> torch.Tensor:
    order, offsets, gate = route(x, p["router"])
    xs = x[order]
    h = torch.nn.functional.gelu(sft.grouped_matmul(xs, p["w1"], offsets=offsets))
    ys = sft.grouped_matmul(h, p["w2"], offsets=offsets)
    y = torch.empty_like(ys).index_copy(0, order, ys)
    return y * gate[:, None].to(y.dtype)


def moe_reference(p: dict, x: torch.Tensor) -> torch.Tensor:
    """The same layer with a per-token gather of the expert weights (float64-friendly, slow)."""
    probs = torch.softmax(x @ p["router"].t(), dim=-1)
    gate, expert = probs.max(dim=-1)
    h = torch.nn.functional.gelu(torch.einsum("mk,mnk->mn", x, p["w1"][expert]))
    return torch.einsum("mk,mnk->mn", h, p["w2"][expert]) * gate[:, None]


def check_against_reference(device: str, M: int = 200) -> float:
    p = {k: torch.nn.Parameter(v) for k, v in init(device).items()}
    p64 = {k: torch.nn.Parameter(v.detach().double()) for k, v in p.items()}
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(M, 128, device=device, generator=g)
    dy = torch.randn(M, 128, device=device, generator=g)
    y = moe(p, x)
    y64 = moe_reference(p64, x.double())
    y.backward(dy)
    y64.backward(dy.double())
    worst = 0.0
    for a, b in [(y, y64)] + [(p[k].grad, p64[k].grad) for k in ("w1", "w2", "router")]:
        err = float((a.double() - b).norm() / b.norm())
        worst = max(worst, err)
    assert worst < 1e-4, worst              # float32 products, float32 accumulation (docs/numerics.md: 1e-5 per GEMM)
    return worst


def train(device: str, layer=moe, steps: int = 20, lr: float = 3e-3, M: int = 512) -> list:
    p = {k: torch.nn.Parameter(v) for k, v in init(device).items()}
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(M, 128, device=device, generator=g)
    target = torch.tanh(x @ torch.randn(128, 128, device=device, generator=g) / 128 ** 0.5)
    opt = torch.optim.Adam(p.values(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(p, x), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses]          # one host synchronization, after training


def main(device: str = "cuda") -> list:
    err = check_against_reference(device)
    losses = train(device)
    theirs = train(device, layer=moe_reference)      # the same layer in plain PyTorch (float32)
    assert losses[-1] < 0.5 * losses[0], losses
    assert abs(losses[-1] - theirs[-1]) <= 0.05 * theirs[-1], (losses, theirs)
    print(f"moe_layer: forward/gradients vs float64 reference {err:.1e}; "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps "
          f"(plain PyTorch layer: {theirs[0]:.4f} -> {theirs[-1]:.4f})")
    return losses


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("moe_layer.py needs a CUDA GPU: PyTorch sees none")
    main()
