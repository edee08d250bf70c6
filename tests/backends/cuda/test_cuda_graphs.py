"""CUDA graph capture itself (GPU only: the interpreter has no graphs)."""
import gc

import pytest
import torch

from cuda_support import ON_GPU

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")


def _capture_add(x):
    from mindspec.backends.cuda.graphs import capture_cuda_graph

    out = torch.empty_like(x)
    return capture_cuda_graph(lambda: torch.add(x, 1, out=out), x.device), out


def test_capture_after_every_earlier_graph_is_gone():
    """The caching allocator frees a pool with its last graph; capturing into that pool's handle
    again used to fail an internal assertion (seen in `mindspec bench --backend cuda`)."""
    x = torch.arange(8.0, device="cuda")
    first, _ = _capture_add(x)
    del first
    gc.collect()
    second, out = _capture_add(x)
    x.copy_(torch.full_like(x, 5.0))
    second.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [6.0] * 8


def test_graphs_share_one_pool_while_alive():
    from mindspec.backends.cuda import graphs

    x = torch.arange(4.0, device="cuda")
    a, _ = _capture_add(x)
    pool = graphs._POOLS[x.device]
    b, out_b = _capture_add(x)
    assert graphs._POOLS[x.device] is pool and len(pool.graphs) == 2
    b.replay()
    torch.cuda.synchronize()
    assert out_b.tolist() == [1.0, 2.0, 3.0, 4.0]
