"""What the bench workload modules share (the workload dict and section attributes: ``codegen.harness.bench``)."""
from __future__ import annotations


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def nbytes(*arrays) -> int:
    """Bytes of the given arrays (CuPy, NumPy, torch; ``None`` and Python numbers count 0)."""
    total = 0
    for a in arrays:
        if a is None or isinstance(a, (int, float)):
            continue
        n = getattr(a, "nbytes", None)
        if n is None and hasattr(a, "element_size"):
            n = a.numel() * a.element_size()
        total += int(n)
    return total


def random_input(element: str, shape):
    """x ~ 3·N(0, 1) in ``element`` on the current device: a torch tensor when torch is present
    (so the torch baselines run on the same data), else a CuPy array. Never all zeros."""
    torch = _torch()
    if torch is not None:
        from runtime.arrays import torch_dtype
        dev = torch.device("cuda", torch.cuda.current_device())
        mdt = torch.float64 if element == "f64" else torch.float32
        return (torch.randn(shape, device=dev, dtype=mdt) * 3).to(torch_dtype(element))
    import cupy as cp

    from runtime.arrays import numpy_dtype
    return (cp.random.standard_normal(shape, dtype=cp.float32) * 3).astype(numpy_dtype(element))


KEPT_RESULTS = 4


def kept_results(call, d):
    """``call(d)`` whose results stay alive for the next ``KEPT_RESULTS`` calls, as a caller that
    uses them later keeps them: each call's outputs are at new addresses, so a replay re-sets its
    graph nodes' parameters (runtime/graphs.py), where a call whose result is dropped gets the
    freed block back and sets nothing. Costs the timed loop one list store a call."""
    ring, turn = [None] * KEPT_RESULTS, [0]

    def run():
        i = turn[0] = (turn[0] + 1) % KEPT_RESULTS
        ring[i] = call(d)
    return run
