"""Expert parallelism over ``torch.distributed``: an MoE layer whose experts are spread over the ranks
of a process group. Tokens travel to the rank that owns their experts by ``all_to_all_single`` (NCCL
on GPUs, gloo on CPUs), the experts run there as two grouped matmuls (``torch.ops.skuforge``, with
autograd), and the results travel back. No communication of skuforge's own.

    import torch.distributed as dist
    from runtime.torch import ep
    dist.init_process_group("nccl")                  # torchrun --nproc-per-node 2 ...
    p = ep.init_weights(dim, hidden, experts)        # every expert's weights, the same on every rank
    layer = ep.MoE(p["router"], p["w1"], p["w2"], top_k=2, group=dist.group.WORLD).to("cuda")
    y = layer(x)                                     # x [T, dim]: this rank's tokens; y [T, dim]
    y.backward(dy)                                   # layer.w1.grad: this rank's experts

Rank ``r`` of ``W`` owns experts ``[r·E/W, (r+1)·E/W)`` (``E % W == 0``) and keeps only their
weights; the router is replicated (its gradient covers this rank's tokens: sum it over the ranks, as
data parallelism does). ``group=None`` is the same layer in one process: every expert local, no
communication. One step on each rank:

1. **router**: ``softmax(x @ routerᵀ)`` in float32, the top-k experts of each token and their
   probabilities renormalised to sum to 1 (the gates);
2. **permutation**: the T·k (token, expert) assignments sorted by expert, stably; since the ranks own
   contiguous blocks of experts, that is also sorted by destination rank;
3. **counts**: rows per expert, exchanged by one ``all_to_all_single`` of E integers; the split sizes
   of the two token exchanges are copied to the host once (the step's only host synchronization:
   ``all_to_all_single`` takes them as Python lists);
4. **dispatch**: ``all_to_all_single`` of the permuted rows; this rank receives its experts' rows
   grouped by source rank, then by expert;
5. **experts**: ``grouped_matmul(x, w1, row_experts=ids)`` → activation →
   ``grouped_matmul(h, w2, row_experts=ids)``; ``row_experts`` takes the received order as it is (no
   sort), and its stable routing keeps the rows of an expert in received order, so dw sums them in a
   fixed order: the same inputs give the same dw bits on every run;
6. **combine**: ``all_to_all_single`` back, un-permute, and the gate-weighted sum over the k experts
   of each token (a fixed-order sum, no atomics).

Autograd runs through all of it: the exchange's backward is the reverse exchange (:func:`all_to_all`),
the grouped matmuls' backward is ``grouped_matmul_backward`` (dx, and dw accumulated in float32).
The experts step is pluggable (``experts=``): ``"skuforge"`` (default), ``"torch_grouped_mm"``
(``torch._grouped_mm``: rows sorted by expert first, a comparison), ``"loop"`` (a per-expert
``torch.matmul`` loop: a reference that runs anywhere, CPUs included) and ``"identity"`` (no
experts: what the communication alone costs). ``examples/ep_moe.py`` runs it on several GPUs, checks
it against the one-process layer and times it; docs/moe.md ("Expert parallelism").
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from runtime.errors import InvalidProblemError


# -- the exchange, differentiable -----------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits; its gradient is the reverse exchange.
    (``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated and warns
    on every call; the functional collectives return asynchronous tensors. This is the plain,
    synchronous-per-stream form.)"""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list, in_splits: list, group) -> Tensor:
        ctx.splits = (in_splits, out_splits, group)
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        in_splits, out_splits, group = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, group), None, None, None


def all_to_all(x: Tensor, out_splits: list, in_splits: list, group=None) -> Tensor:
    """Rows ``x[sum(in_splits[:r]) : sum(in_splits[:r+1])]`` go to rank r; the result holds
    ``out_splits[s]`` rows from each rank s, in rank order. Differentiable (the backward exchanges
    the gradient the other way)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


# -- the experts step ------------------------------------------------------------------------------
# experts(x [R, dim], ids int32 [R] (local expert of each row), counts int64 [E_local] (rows per local
# expert, on the device), w1 [E_local, hidden, dim], w2 [E_local, dim, hidden], activation) -> [R, dim]
def skuforge_experts(x, ids, counts, w1, w2, activation):
    """Two skuforge grouped matmuls (``torch.ops.skuforge.grouped_matmul``, autograd through
    ``grouped_matmul_backward``), rows routed by ``row_experts`` in the order they arrived."""
    from .moe import grouped_matmul
    h = activation(grouped_matmul(x, w1, row_experts=ids))
    return grouped_matmul(h, w2, row_experts=ids)


class _TorchGroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` forward and its two backward products (rows sorted by expert; ``ends``:
    int32 cumulative row counts)."""

    @staticmethod
    def forward(ctx, x, w, ends):
        ctx.save_for_backward(x, w, ends)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, dy):
        x, w, ends = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, w, offs=ends) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(dy.t(), x, offs=ends) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def torch_grouped_mm_experts(x, ids, counts, w1, w2, activation):
    """The same two products with ``torch._grouped_mm`` (bf16), which needs rows sorted by expert:
    a stable sort of the received rows first, the inverse permutation after."""
    perm = torch.argsort(ids, stable=True)
    ends = counts.cumsum(0).to(torch.int32)
    xs = x.index_select(0, perm)
    h = activation(_TorchGroupedMM.apply(xs, w1, ends))
    ys = _TorchGroupedMM.apply(h, w2, ends)
    return torch.empty_like(ys).index_copy(0, perm, ys)


def loop_experts(x, ids, counts, w1, w2, activation):
    """A per-expert ``torch.matmul`` loop (one host copy per expert): a reference on any device."""
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for e in range(w1.shape[0]):
        rows = (ids == e).nonzero().squeeze(1)
        out = out.index_copy(0, rows, activation(x.index_select(0, rows) @ w1[e].t()) @ w2[e].t())
    return out


def identity_experts(x, ids, counts, w1, w2, activation):
    """No experts (rows come back as they went): what the exchanges alone cost."""
    return x * 1


EXPERTS = {"skuforge": skuforge_experts, "torch_grouped_mm": torch_grouped_mm_experts, "loop": loop_experts,
           "identity": identity_experts}


# -- the layer ---------------------------------------------------------------------------------------
def init_weights(dim: int, hidden: int, experts: int, seed: int = 0, dtype=torch.bfloat16) -> dict:
    """Every expert's weights, made on the CPU from ``seed`` (so every rank makes the same ones):
    ``router`` float32 ``[E, dim]``, ``w1`` ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]`` in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(experts, dim, generator=g) / dim ** 0.5,
            "w1": (torch.randn(experts, hidden, dim, generator=g) / dim ** 0.5).to(dtype),
            "w2": (torch.randn(experts, dim, hidden, generator=g) / hidden ** 0.5).to(dtype)}


@dataclass
class Routing:
    """Where this rank's token assignments go and what it receives (one step)."""

    order: Tensor        # [T·k] assignment indices (token·k + slot) sorted by expert
    gates: Tensor        # [T, k] float32 gate of each assignment
    send: list           # rows sent to each rank
    recv: list           # rows received from each rank
    ids: Tensor          # [R] int32: the local expert of each received row
    counts: Tensor       # [E_local] int64: received rows per local expert


class MoE(torch.nn.Module):
    """A top-k MoE layer with its experts spread over ``group`` (module docstring).

    ``router`` ``[E, dim]``, ``w1`` ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``: every expert's
    weights, the same on every rank; the layer keeps its rank's ``E / W`` experts (``w1``, ``w2``
    parameters of ``E / W`` experts, ``experts_owned`` their global ids) and the whole router (a
    float32 parameter). ``group``: a process group (``dist.group.WORLD``), or None for one process
    without communication. ``experts``: a name in :data:`EXPERTS` or a callable of that signature."""

    def __init__(self, router: Tensor, w1: Tensor, w2: Tensor, *, top_k: int = 2, group=None,
                 experts="skuforge", activation: Callable = F.gelu):
        super().__init__()
        E, dim = router.shape
        if w1.ndim != 3 or w2.ndim != 3 or w1.shape[0] != E or w2.shape[0] != E or w1.shape[2] != dim \
                or w2.shape[1] != dim or w2.shape[2] != w1.shape[1]:
            raise InvalidProblemError(f"router {tuple(router.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}: "
                                      "expected [E, dim], [E, hidden, dim], [E, dim, hidden]")
        self.group = group
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if E % self.world:
            raise InvalidProblemError(f"{E} experts over {self.world} ranks: the experts must divide evenly")
        if not 1 <= top_k <= E:
            raise InvalidProblemError(f"top_k={top_k}; 1 to E = {E}")
        self.top_k, self.num_experts, self.local = top_k, E, E // self.world
        lo = self.rank * self.local
        self.experts_owned = range(lo, lo + self.local)
        self.router = torch.nn.Parameter(router.detach().float().clone())
        self.w1 = torch.nn.Parameter(w1.detach()[lo:lo + self.local].clone())
        self.w2 = torch.nn.Parameter(w2.detach()[lo:lo + self.local].clone())
        self.expert_fn = EXPERTS[experts] if isinstance(experts, str) else experts
        self.activation = activation

    def route(self, x: Tensor) -> Routing:
        """Steps 1 to 3: gates, the permutation, the counts exchange and the split sizes (one host copy)."""
        k, W, El = self.top_k, self.world, self.local
        probs = torch.softmax(x.float() @ self.router.t(), dim=-1)
        gates, experts = probs.topk(k, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))                        # rows per expert, a static shape
        if self.group is None:
            got = counts
        else:
            got = torch.empty_like(counts)                         # [source rank, local expert]
            dist.all_to_all_single(got, counts, group=self.group)
        sizes = torch.cat([counts.view(W, El).sum(1), got.view(W, El).sum(1)]).tolist()
        send, recv = sizes[:W], sizes[W:]
        ids = torch.repeat_interleave(torch.arange(El, device=x.device, dtype=torch.int32).repeat(W), got,
                                      output_size=sum(recv))
        return Routing(order, gates, send, recv, ids, got.view(W, El).sum(0))

    def exchange(self, rows: Tensor, out_splits: list, in_splits: list) -> Tensor:
        return rows if self.group is None else all_to_all(rows, out_splits, in_splits, self.group)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 2 or x.shape[1] != self.router.shape[1]:
            raise InvalidProblemError(f"x has shape {tuple(x.shape)}; expected [tokens, {self.router.shape[1]}]")
        T, D, k = x.shape[0], x.shape[1], self.top_k
        r = self.route(x)
        xs = x.unsqueeze(1).expand(T, k, D).reshape(T * k, D).index_select(0, r.order)
        xr = self.exchange(xs, r.recv, r.send)                      # to the owners of the experts
        yr = self.expert_fn(xr, r.ids, r.counts, self.w1, self.w2, self.activation)
        ys = self.exchange(yr, r.send, r.recv)                      # back, in the permuted order
        y = torch.empty_like(ys).index_copy(0, r.order, ys).view(T, k, D)
        return (y.float() * r.gates.unsqueeze(-1)).sum(1).to(x.dtype)


def rank_slice(n: int, group=None) -> slice:
    """This rank's share of ``n`` rows split evenly over ``group`` (``n % W == 0``)."""
    w = 1 if group is None else dist.get_world_size(group)
    r = 0 if group is None else dist.get_rank(group)
    return slice(r * n // w, (r + 1) * n // w)


def owned(t: Optional[Tensor], layer: MoE) -> Optional[Tensor]:
    """The rows of a full ``[E, ...]`` tensor (a one-process layer's weight or gradient) that ``layer``'s
    rank owns."""
    if t is None:
        return None
    return t[layer.experts_owned.start:layer.experts_owned.stop]
