"""Decode-step capture in an NPU (ACL) graph, with the per-replay update of attention arguments.

A captured graph replays its kernels with the arguments they were captured with. Most inputs of a
decode step are device tensors, refreshed by copying new values into the graph's static buffers.
FIA's sequence lengths are host lists baked into its captured task, so (vllm-ascend's pattern,
shared/reference/npu_ops.md section 5) every decode FIA call is captured in its own task group and,
before each replay, re-issued with the new lengths inside graph_task_update_begin/end on a side
stream; an ExternalEvent recorded there is what the captured call waits on.

The step callable takes a list of DeviceInputs (the main model's, plus one per MTP draft step when
the whole speculative step is captured) and returns tensors that stay the graph's outputs. Replay
inputs must have the captured shape: same sequences count and query tokens per sequence (a serving
loop pads its batch to a captured size with dummy sequences whose slots are -1).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from mindspec.backend import AttentionMetadata
from mindspec.modeling.forward_metadata import DeviceInputs

from .backend import NpuBackend

Step = Callable[[list[DeviceInputs]], object]


class GraphShapeError(ValueError):
    """Replay inputs do not have the shape the graph was captured with."""


def _static_copy(x: DeviceInputs, max_blocks: int) -> DeviceInputs:
    m = x.meta
    if m.tree_mask is not None:
        raise GraphShapeError("tree masks run on the composed path, which cannot be captured")
    tables = torch.zeros(m.block_tables.shape[0], max_blocks, dtype=torch.int32, device=m.block_tables.device)
    tables[:, : m.block_tables.shape[1]] = m.block_tables
    meta = AttentionMetadata(
        slots=m.slots.clone(), block_tables=tables, seq_lens=m.seq_lens.clone(), q_lens=m.q_lens.clone(),
        q_start_loc=m.q_start_loc.clone(), seq_lens_host=list(m.seq_lens_host), q_lens_host=list(m.q_lens_host),
        is_prefill=False,
    )
    return DeviceInputs(x.input_ids.clone(), x.positions.clone(), meta, x.lm_head_indices.clone())


def _refresh(static: DeviceInputs, new: DeviceInputs) -> None:
    """Copy new values into the static buffers (host lists go through the attention update)."""
    s, n = static.meta, new.meta
    if list(n.q_lens_host) != list(s.q_lens_host) or new.lm_head_indices.shape != static.lm_head_indices.shape:
        raise GraphShapeError(
            f"graph captured {len(s.q_lens_host)} sequences with query lengths {s.q_lens_host} and "
            f"{static.lm_head_indices.numel()} lm_head rows; replay gives {list(n.q_lens_host)} and "
            f"{new.lm_head_indices.numel()}"
        )
    width = n.block_tables.shape[1]
    if width > s.block_tables.shape[1]:
        raise GraphShapeError(f"block tables of width {width} exceed the captured {s.block_tables.shape[1]}")
    static.input_ids.copy_(new.input_ids)
    static.positions.copy_(new.positions)
    static.lm_head_indices.copy_(new.lm_head_indices)
    s.slots.copy_(n.slots)
    s.seq_lens.copy_(n.seq_lens)
    s.block_tables.zero_()
    s.block_tables[:, :width] = n.block_tables


class NpuDecodeGraph:
    def __init__(self, backend: NpuBackend, step: Step, max_blocks: int):
        self.backend = backend
        self.step = step
        self.max_blocks = max_blocks  # block-table width the graph is captured with
        self.static: list[DeviceInputs] = []
        self.outputs = None
        self.graph = None
        self.capture_state = None
        self.update_stream = None

    def capture(self, example: Sequence[DeviceInputs]):
        """Warm up once eagerly (one-time weight re-layouts, masks), then capture; returns the
        outputs, which every replay overwrites. The warm-up really runs the step on ``example``."""
        npu_api = torch.npu
        self.static = [_static_copy(x, self.max_blocks) for x in example]
        for x in self.static:
            self.backend.prepare(x.meta)
        self.step(self.static)
        self.backend.synchronize()
        self.graph = npu_api.NPUGraph()
        with self.backend.capturing_attention() as capture, npu_api.graph(self.graph):
            self.outputs = self.step(self.static)
        self.capture_state = capture
        self.update_stream = self.backend.new_stream()
        return self.outputs

    def replay(self, inputs: Sequence[DeviceInputs]):
        if self.graph is None:
            raise RuntimeError("capture() the decode step before replaying it")
        if len(inputs) != len(self.static):
            raise GraphShapeError(f"graph captured {len(self.static)} forward inputs, replay gives {len(inputs)}")
        for static, new in zip(self.static, inputs):
            _refresh(static, new)
        metas = {id(s.meta): replace(n.meta, scratch={}) for s, n in zip(self.static, inputs)}
        self.backend.update_captured_attention(self.capture_state, metas, self.update_stream)
        self.graph.replay()
        return self.outputs

    @property
    def num_captured_attention(self) -> int:
        return len(self.capture_state.attention) if self.capture_state else 0
