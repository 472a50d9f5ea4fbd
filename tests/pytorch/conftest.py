import pytest


@pytest.fixture(autouse=True)
def _torch_with_cuda(request):
    """The GPU tests of the torch front need a torch build with CUDA (CI's CPU build has none)."""
    if request.node.get_closest_marker("gpu") is None:
        return
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
