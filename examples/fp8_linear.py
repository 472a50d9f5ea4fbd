"""FP8 linear on Hopper: e4m3 activations quantized by skuforge, ``torch._scaled_mm``.

* row-wise: one scale per token (``dynamic_quantize(scope="token")``) and per output channel;
* DeepSeek-style 1x128 groups: one scale per token and 128 features
  (``dynamic_quantize(scope="group", group_size=128)``), one ``_scaled_mm`` per 128-wide K block,
  checked against the dequantized product ``dequantize(q, s) @ dequantize(wq, ws).T``.

    python examples/fp8_linear.py           # needs PyTorch and a GPU of compute capability 8.9+
"""
try:
    import torch
except ImportError:
    raise SystemExit("fp8_linear.py needs PyTorch (pip install torch) and a CUDA GPU") from None

import runtime.torch as sft

FP8 = "fp8_e4m3"


def quantize_weight(w: torch.Tensor):
    """fp8 weights [N, K] with one scale per output channel (a row of w)."""
    wq, ws, _ = sft.dynamic_quantize(w, scope="token", out_dtype=FP8)
    return wq, ws


def fp8_rowwise(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    q, s, _ = sft.dynamic_quantize(x, scope="token", out_dtype=FP8)          # q e4m3 [M, K], s [M]
    return torch._scaled_mm(q, wq.t(), scale_a=s[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16)


def fp8_rowwise_torch(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The row-wise step in plain PyTorch ops (what skuforge's dynamic_quantize replaces)."""
    s = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-8) / torch.finfo(torch.float8_e4m3fn).max
    q = (x.float() / s).to(torch.float8_e4m3fn)
    return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws[None, :], out_dtype=torch.bfloat16)


def fp8_group128(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, block: int = 128) -> torch.Tensor:
    """1x128 activation groups: sum over K blocks of row-wise scaled products (float32 sum)."""
    q, s, _ = sft.dynamic_quantize(x, scope="group", group_size=block, out_dtype=FP8)   # s [M, K/128]
    y = None
    for j in range(x.shape[-1] // block):
        part = torch._scaled_mm(q[:, j * block:(j + 1) * block].contiguous(),
                                wq[:, j * block:(j + 1) * block].contiguous().t(),
                                scale_a=s[:, j:j + 1].contiguous(), scale_b=ws[None, :], out_dtype=torch.bfloat16)
        y = part.float() if y is None else y + part.float()
    return y.to(x.dtype)


def main(device: str = "cuda", M: int = 128, K: int = 1024, N: int = 512) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
    x[:, :128] *= 8                                     # an outlier block: where group scales pay off
    w = (torch.randn(N, K, device=device, generator=g) / K ** 0.5).to(torch.bfloat16)
    wq, ws = quantize_weight(w)
    ref = x.double() @ w.double().t()

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    errs = {"rowwise": rel(fp8_rowwise(x, wq, ws), ref),
            "rowwise_plain_pytorch": rel(fp8_rowwise_torch(x, wq, ws), ref)}
    yg = fp8_group128(x, wq, ws)
    q, s, _ = sft.dynamic_quantize(x, scope="group", group_size=128, out_dtype=FP8)
    xd = sft.dequantize(q, s, scope="group", group_size=128, out_dtype="float32")
    wd = sft.dequantize(wq, ws, scope="token", out_dtype="float32")
    errs["group128_vs_dequantized"] = rel(yg, xd.double() @ wd.double().t())
    errs["group128"] = rel(yg, ref)
    assert errs["rowwise"] < 8e-2 and errs["group128"] < 8e-2, errs
    assert abs(errs["rowwise"] - errs["rowwise_plain_pytorch"]) < 1e-2, errs
    assert errs["group128_vs_dequantized"] < 1e-2, errs       # bf16 partial products, float32 sum
    print("fp8_linear: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return errs


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("fp8_linear.py needs a CUDA GPU: PyTorch sees none")
    if torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("fp8_linear.py needs a GPU of compute capability 8.9 or newer (torch._scaled_mm on fp8)")
    main()
