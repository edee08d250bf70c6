"""CUDA graph capture of one decode step (GPU only: the interpreter has no graphs).

The graph runner (mindspec/modeling/graph_runner.py) owns the static input buffers and calls
``capture_cuda_graph`` once per batch-size bucket with a callable that runs the step over them.
Every bucket's graph allocates from one memory pool per device, so buckets share memory. A pool
lives only while a graph captured into it does (the caching allocator frees it with its last
graph, and a capture into a freed pool's handle trips an internal assertion), so a device's pool
is reused only while one of its graphs is alive.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class _Pool:
    handle: object
    graphs: "weakref.WeakSet[torch.cuda.CUDAGraph]"


_POOLS: dict[torch.device, _Pool] = {}


def _pool(device: torch.device) -> _Pool:
    pool = _POOLS.get(device)
    if pool is None or not len(pool.graphs):
        pool = _POOLS[device] = _Pool(torch.cuda.graph_pool_handle(), weakref.WeakSet())
    return pool


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
    pool = _pool(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool.handle):
            outputs = fn()
    except Exception:
        _POOLS.pop(device, None)  # a failed capture may have released the pool: start a fresh one
        raise
    pool.graphs.add(graph)
    return CudaGraph(graph, outputs)
