"""CPU: the expert-parallel MoE layer (runtime/torch/ep.py) over the gloo backend, with the reference
experts (a per-expert torch.matmul loop) in place of the GPU kernels: routing, the exchanges and
their autograd, the combine. One process (world size 1) and two processes (world size 2, spawned):
each rank's outputs, input gradients, expert weight gradients and the summed router gradient equal
the one-process layer's on all the tokens. The same layer with the skuforge kernels and NCCL:
tests/core/test_gpu_multi.py and examples/ep_moe.py."""
import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from runtime.errors import InvalidProblemError  # noqa: E402
from runtime.torch import ep  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not in this torch")

DIM, HIDDEN, EXPERTS, TOKENS = 24, 40, 4, 30


def _data(world: int, dtype=torch.float64):
    p = ep.init_weights(DIM, HIDDEN, EXPERTS, seed=1, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(world * TOKENS, DIM, generator=g, dtype=dtype)
    dy = torch.randn(world * TOKENS, DIM, generator=g, dtype=dtype)
    return p, x, dy


def _step(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.w1.grad, layer.w2.grad, layer.router.grad


def _compare_with_one_process(group, top_k=2, dtype=torch.float64):
    """This rank's step against the one-process layer on every rank's tokens."""
    world = dist.get_world_size(group)
    p, x, dy = _data(world, dtype)
    rows = ep.rank_slice(x.shape[0], group)
    layer = ep.MoE(p["router"], p["w1"], p["w2"], top_k=top_k, group=group, experts="loop")
    whole = ep.MoE(p["router"], p["w1"], p["w2"], top_k=top_k, group=None, experts="loop")
    y, dx, dw1, dw2, drouter = _step(layer, x[rows], dy[rows])
    Y, DX, DW1, DW2, DROUTER = _step(whole, x, dy)
    dist.all_reduce(drouter, group=group)                        # the router's gradient, summed over ranks
    pairs = {"y": (y, Y[rows]), "dx": (dx, DX[rows]), "dw1": (dw1, ep.owned(DW1, layer)),
             "dw2": (dw2, ep.owned(DW2, layer)), "drouter": (drouter, DROUTER)}
    for name, (a, b) in pairs.items():
        assert a.shape == b.shape, name
        err = float((a - b).norm() / b.norm())
        # the router is float32 (its sums over tokens run in another order), the rest float64
        assert err < (1e-6 if name == "drouter" else 1e-12), (name, err)
    return layer


@pytest.fixture
def world1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_world_size_1_equals_the_one_process_layer_bit_for_bit(world1):
    p, x, dy = _data(1, torch.float32)
    a = _step(ep.MoE(p["router"], p["w1"], p["w2"], group=world1, experts="loop"), x, dy)
    b = _step(ep.MoE(p["router"], p["w1"], p["w2"], group=None, experts="loop"), x, dy)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    _compare_with_one_process(world1, top_k=3)


def test_routing_of_one_process():
    p, x, _ = _data(1)
    layer = ep.MoE(p["router"], p["w1"], p["w2"], top_k=2)
    r = layer.route(x)
    assert r.send == r.recv == [2 * TOKENS]
    assert r.ids.dtype == torch.int32 and r.ids.shape == (2 * TOKENS,)
    assert torch.equal(r.ids.long(), torch.sort(torch.topk(x.float() @ p["router"].t(), 2).indices.reshape(-1)).values)
    assert int(r.counts.sum()) == 2 * TOKENS and r.counts.shape == (EXPERTS,)
    assert torch.allclose(r.gates.sum(-1), torch.ones(TOKENS, dtype=torch.float32))


def test_identity_experts_give_the_tokens_back():
    p, x, _ = _data(1, torch.float32)
    layer = ep.MoE(p["router"], p["w1"], p["w2"], top_k=2, experts="identity")
    assert torch.allclose(layer(x), x, atol=1e-6)


def test_layer_errors():
    p, x, _ = _data(1)
    with pytest.raises(InvalidProblemError, match="top_k"):
        ep.MoE(p["router"], p["w1"], p["w2"], top_k=EXPERTS + 1)
    with pytest.raises(InvalidProblemError, match="expected"):
        ep.MoE(p["router"], p["w1"], p["w1"])
    with pytest.raises(InvalidProblemError, match="tokens"):
        ep.MoE(p["router"], p["w1"], p["w2"])(x[:, :5])


# -- two processes -------------------------------------------------------------------------------------
def _two_ranks(rank: int, store_path: str, failures: str):
    try:
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        try:
            group = dist.group.WORLD
            layer = _compare_with_one_process(group)
            assert list(layer.experts_owned) == [2 * rank, 2 * rank + 1]
            _compare_with_one_process(group, top_k=1)
            # the exchange's gradient is the reverse exchange
            splits = [[1, 3], [2, 2]][rank]                 # rows sent to rank 0, 1
            got = [[1, 2], [3, 2]][rank]                    # rows received from rank 0, 1
            x = (torch.arange(4.0).unsqueeze(1) + 10 * rank).requires_grad_(True)
            y = ep.all_to_all(x, got, splits, group)
            assert y.squeeze(1).tolist() == [[0.0, 10.0, 11.0], [1.0, 2.0, 3.0, 12.0, 13.0]][rank]
            (y * torch.arange(1.0, 1.0 + y.shape[0]).unsqueeze(1)).sum().backward()
            assert x.grad.squeeze(1).tolist() == [[1.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]][rank]
            dist.barrier()      # both ranks are done with the group before either tears its gloo pairs down
        finally:
            dist.destroy_process_group()
    except BaseException as e:      # noqa: BLE001 - reported to the parent
        with open(f"{failures}.{rank}", "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise


def test_two_ranks_equal_the_one_process_layer(tmp_path):
    """Two gloo processes: each rank's share of outputs, dx, its experts' dw and the summed router
    gradient equal the one-process layer's on all tokens; the exchange's autograd."""
    import torch.multiprocessing as mp
    failures = str(tmp_path / "failed")
    try:
        mp.start_processes(_two_ranks, args=(str(tmp_path / "store"), failures), nprocs=2, start_method="spawn")
    except Exception:
        got = [open(f"{failures}.{r}").read() for r in (0, 1) if os.path.exists(f"{failures}.{r}")]
        pytest.fail("; ".join(got) or "a rank failed")
