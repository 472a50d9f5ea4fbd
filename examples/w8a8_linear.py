"""W8A8 linear: int8 per-token activations (skuforge dynamic_quantize), int8 per-channel weights,
int32 products with ``torch._int_mm``, rescaled in float32. Compared with the float linear.

    python examples/w8a8_linear.py          # needs PyTorch and a CUDA GPU
"""
try:
    import torch
except ImportError:
    raise SystemExit("w8a8_linear.py needs PyTorch (pip install torch) and a CUDA GPU") from None

import runtime.torch as sft


def quantize_weight(w: torch.Tensor):
    """int8 weights with one scale per output channel (a row of w [N, K])."""
    wq, ws, _ = sft.dynamic_quantize(w, scope="token")
    return wq, ws


def w8a8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with x quantized per token on the fly: int8 x int8 -> int32, then the scales."""
    q, s, _ = sft.dynamic_quantize(x, scope="token")            # q int8 [M, K], s float32 [M]
    acc = torch._int_mm(q, wq.t())                               # int32 [M, N]
    return (acc.float() * s[:, None] * ws[None, :]).to(x.dtype)


def w8a8_linear_torch(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The same step in plain PyTorch ops (what skuforge's dynamic_quantize replaces)."""
    s = x.float().abs().amax(-1).clamp_min(1e-8) / 127
    q = torch.round(x.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
    return (torch._int_mm(q, wq.t()).float() * s[:, None] * ws[None, :]).to(x.dtype)


def main(device: str = "cuda", M: int = 256, K: int = 1024, N: int = 512) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(N, K, device=device, generator=g) / K ** 0.5).to(torch.bfloat16)
    wq, ws = quantize_weight(w)
    y = w8a8_linear(x, wq, ws)
    ref = x.double() @ w.double().t()
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < 2e-2, f"relative error {err:.3g} exceeds int8 quantization error"
    plain = float((w8a8_linear_torch(x, wq, ws).double() - ref).norm() / ref.norm())
    assert abs(err - plain) < 2e-3, (err, plain)                 # the plain PyTorch step: the same error
    print(f"w8a8_linear: M={M} K={K} N={N}, relative Frobenius error vs float {err:.2e}")
    return err


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("w8a8_linear.py needs a CUDA GPU: PyTorch sees none")
    main()
