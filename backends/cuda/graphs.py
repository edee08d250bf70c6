"""CUDA graph capture of one decode step (GPU only: the interpreter has no graphs).

The graph runner (mindspec/modeling/graph_runner.py) owns the static input buffers and calls
``capture_cuda_graph`` once per batch-size bucket with a callable that runs the step over them.
Every bucket's graph allocates from one memory pool per device, so buckets share memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

_POOLS: dict[torch.device, object] = {}


@dataclass
class CudaGraph:
    graph: "torch.cuda.CUDAGraph"
    outputs: object  # what fn returned during capture: static tensors that every replay rewrites

    def replay(self) -> None:
        self.graph.replay()


def capture_cuda_graph(fn: Callable[[], object], device: torch.device) -> CudaGraph:
    """Run ``fn`` once on a side stream (Triton compiles, lazy allocations happen outside the
    capture, as torch's documentation asks), then record it. ``fn`` must be idempotent over its
    static inputs: the decode step is (it rewrites the same cache slots with the same values)."""
    pool = _POOLS.get(device)
    if pool is None:
        pool = _POOLS[device] = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return CudaGraph(graph, outputs)
