"""Counts the device launches a captured cuda step holds, on CPU under Triton's interpreter.

A CUDA graph replays every kernel its step launched while captured, and each costs the device
~1-2 us however small (a decode step of a small model is mostly such kernels), so the number of
launches in a step's graph is what its device time follows at batch 1. Without a GPU the same
step runs eagerly on CPU tensors, and this counts what it launches: every Triton kernel (the
interpreter's launches), every ATen op but views and allocations (which launch nothing), and
every dtype or device conversion (``Tensor.to`` of an inference tensor reaches no dispatch mode:
StepAccounting's function mode sees it). ``layer_launches`` tells apart the launches inside the
decoder layers from the rest (embedding, norms and heads, MTP stage glue, acceptance).

Used by tests/backends/cuda/test_cuda_step_launches.py and scripts/step_launches.py.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from mindspec.modeling.step_accounting import StepAccounting

# ATen ops that allocate or describe but launch no kernel
NOT_LAUNCHES = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
                "aten.new_empty.default", "aten.promote_types.default", "aten._local_scalar_dense.default"}


@dataclass
class Launches:
    total: int = 0
    in_layers: int = 0  # inside a DecoderLayer.forward (main layers and MTP blocks)
    by_name: Counter = field(default_factory=Counter)

    @property
    def outside_layers(self) -> int:
        return self.total - self.in_layers


class _Counting(StepAccounting):
    """StepAccounting's view of ops and conversions, turned into launch counts."""

    def __init__(self, census: "LaunchCensus"):
        super().__init__()
        self.census = census

    def count_op(self, name: str) -> None:
        if name not in NOT_LAUNCHES:
            self.census.count(name)


class LaunchCensus:
    """Launch counts per graph replay, keyed by the graph runner's shape key; install with
    ``installed()`` before the LLM is built (its graph runner then sees a backend that captures)."""

    def __init__(self):
        self.replays: dict[tuple, list[Launches]] = {}
        self._current: Launches | None = None
        self._paused = 0
        self._layer_depth = 0

    def count(self, name: str) -> None:
        c = self._current
        if c is None or self._paused:
            return
        c.total += 1
        c.by_name[name] += 1
        if self._layer_depth:
            c.in_layers += 1

    def last(self, kind: str) -> Launches:
        """The latest replay of a step of this kind ("decode", "speculative")."""
        keys = [k for k in self.replays if k[0] == kind]
        assert keys, f"no {kind} step was replayed"
        return self.replays[keys[-1]][-1]

    def _replay(self, key: tuple, fn):
        launches = self._current = Launches()
        counting = _Counting(self)
        try:
            with counting:
                out = fn()
        finally:
            self._current = None
        self.replays.setdefault(key, []).append(launches)
        return out

    @contextmanager
    def installed(self, monkeypatch) -> Iterator["LaunchCensus"]:
        import triton.runtime.interpreter as interpreter

        from mindspec.backends.cuda.backend import CudaBackend
        from mindspec.modeling import graph_runner
        from mindspec.models.deepseekv2.decoder_layer import DecoderLayer

        census, run, layer_forward = self, interpreter.InterpretedFunction.run, DecoderLayer.forward

        def counted_run(kernel, *args, **kwargs):  # a kernel's own torch ops (argument copies) are not launches
            census.count("triton:" + kernel.fn.__name__)
            census._paused += 1
            try:
                return run(kernel, *args, **kwargs)
            finally:
                census._paused -= 1

        def counted_layer(layer, *args, **kwargs):
            census._layer_depth += 1
            try:
                return layer_forward(layer, *args, **kwargs)
            finally:
                census._layer_depth -= 1

        class CountedGraph:
            def __init__(self, key, fn):
                self.key, self.fn = key, fn
                self.outputs = fn()  # the capture's warm-up run

            def replay(self):
                self.outputs = census._replay(self.key, self.fn)

        def capture(lazy):
            lazy.runner.stats.captures += 1
            return CountedGraph(lazy.key, lazy.fn)

        monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
        monkeypatch.setattr(DecoderLayer, "forward", counted_layer)
        monkeypatch.setattr(CudaBackend, "supports_graph_capture", property(lambda backend: True))
        monkeypatch.setattr(graph_runner._LazyCapture, "capture", capture)
        yield self
