"""The PyTorch baselines of a workload: its composite eager and under ``torch.compile`` (fullgraph,
static shapes), the agreement of the results, and the one-line text of a baseline's failure."""
from __future__ import annotations


class TorchBaselines:
    """Eager and ``torch.compile`` (fullgraph, static shapes) of a workload's composite."""

    def __init__(self, compile_: bool):
        import torch
        self.torch = torch
        self.compile = compile_
        self.compiled, self.failures, self.skipped = {}, {}, {}
        if compile_:
            import torch._dynamo as dynamo
            cfg = dynamo.config
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(cfg, name):
                    setattr(cfg, name, 4096)          # one graph per dtype/shape: never fall back to eager
            for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
                if hasattr(cfg, name):
                    setattr(cfg, name, 1 << 16)
            if hasattr(cfg, "fail_on_recompile_limit_hit"):
                cfg.fail_on_recompile_limit_hit = True

    def agreement(self, ours, theirs):
        """Elements where the skuforge result and the eager composite differ (NaN == NaN); None if
        they cannot be compared (not both torch tensors of one shape and dtype)."""
        torch = self.torch
        if isinstance(ours, (tuple, list)) and isinstance(theirs, (tuple, list)) and len(ours) == len(theirs):
            parts = [self.agreement(a, b) for a, b in zip(ours, theirs) if a is not None or b is not None]
            return None if not parts or None in parts else sum(parts)
        if not (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)) \
                or ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            return None
        diff = ours != theirs
        if ours.is_floating_point():
            diff &= ~(torch.isnan(ours) & torch.isnan(theirs))
        return int(diff.sum().item())

    def eager_calls(self, sets):
        calls = []
        for w in sets:
            if w.get("torch_fn") is not None:
                calls.append(lambda f=w["torch_fn"], a=tuple(w.get("torch_args", ())): f(*a))
            elif w.get("torch_eager") is not None:
                calls.append(w["torch_eager"])
            else:
                return None
        return calls

    def graphs(self) -> int:
        try:
            from torch._dynamo.utils import counters
            return int(counters["stats"]["unique_graphs"])
        except Exception:  # noqa: BLE001 - an internal counter; without it, assume no recompiles
            return 0

    def recompiles(self, calls) -> bool:
        """True when the second input set makes Dynamo compile again (a composite that takes
        per-set Python numbers is specialised on them); both calls also serve as warm-up."""
        calls[0]()
        before = self.graphs()
        calls[1]()
        return self.graphs() > before

    def compile_failed(self, fn, error: str):
        """After 2 failed compiles of one composite (e.g. an op Dynamo cannot trace, or no C compiler
        for Triton), later results of that composite record why instead of failing again."""
        n = self.failures.get(fn, 0) + 1
        self.failures[fn] = n
        if n >= 2:
            self.skipped[fn] = f"skipped: torch.compile of this composite failed twice; last: {error}"

    def compiled_calls(self, sets):
        if not self.compile:
            return None
        calls = []
        for w in sets:
            fn = w.get("torch_fn") or w.get("torch_eager")
            if fn is None:
                return None
            if fn in self.skipped:
                raise RuntimeError(self.skipped[fn])
            cfn = self.compiled.get(fn)
            if cfn is None:
                cfn = self.compiled[fn] = self.torch.compile(fn, fullgraph=True, dynamic=False)
            args = tuple(w.get("torch_args", ())) if w.get("torch_fn") is not None else ()
            calls.append(lambda f=cfn, a=args: f(*a))
        return calls


def error_text(e: BaseException, limit: int = 600) -> str:
    """One line: the exception type and the last lines of its message (where the cause usually is)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = " | ".join(lines[:1] + lines[-4:] if len(lines) > 5 else lines)
    return f"{type(e).__name__}: {text}"[:limit]
