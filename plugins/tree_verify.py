"""Verification of draft trees, shared by the drafters that make them (MTP trees, Medusa heads).

Each sequence verifies [fed token, nodes...] in one forward; the tree reaches the host as
``inputs.extra["tree"]`` ([3, B, N + 1]: tokens, parent rows, depths; the root's parent -1).

- strict: a node passes when its token equals the target sampled at its parent's row. Each
  row samples at the output position of its depth, with its path as penalty history, so a
  sequence emits exactly the tokens plain decoding samples (greedy: the argmax path; seeded:
  the same draws). For top-k candidates this is multi-candidate rejection sampling (SpecInfer,
  EAGLE) with deterministic drafts: child c is accepted with probability p(c) and a rejection
  removes c from the residual, which is sampling p once and taking the child that matches.
- typical and relaxed: a node passes by the rule at its parent's row (or by matching its target).

The path kept is the longest of passing nodes (decoding_policy.tree_paths), then the target at
its last row. Afterwards the path's main-model KV moves from its tree rows to the sequence's next
slots (n .. n-1+a).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from mindspec.modeling.draft_tree import TreeShape
from mindspec.modeling.forward_metadata import ModelInputs, slots_for
from mindspec.text_generator.sampling.sampler import penalised_logits, processed_probs
from mindspec.text_generator.step import StepBatch, StepInputs, StepOutputs

from mindspec.plugins.mtp import decode_inputs as di
from mindspec.plugins.mtp import decoding_policy as policy


def verification_inputs(last_tokens: np.ndarray, num_tokens: np.ndarray, tables: np.ndarray, block_size: int,
                         num_nodes: int) -> ModelInputs:
    """A chain's verification rows for N drafts (decode_inputs.main_inputs: [t(n-1), nodes...] at
    cache indices n-1 .. n-1+N, every row with logits), every row at position n-1: the drafter adds
    each node's depth; node tokens are the drafter's to fill."""
    inputs = di.main_inputs(last_tokens, num_tokens, tables, block_size, num_nodes)
    return inputs.with_(positions=np.repeat(num_tokens - 1, num_nodes + 1))


class TreeVerifier:
    def __init__(self, shape: TreeShape, block_size: int):
        self.shape = shape
        self.block_size = block_size
        self.rows = shape.num_nodes + 1  # verification rows per sequence

    def keep_layout(self, inputs: StepInputs, num_tokens: np.ndarray, tables: np.ndarray) -> None:
        """What compaction needs of the step's inputs."""
        inputs.extra["tree_num_tokens"] = num_tokens
        inputs.extra["tree_tables"] = tables

    def sample_rows(self, inputs: StepInputs, batch: StepBatch, wants_history: bool) -> StepInputs:
        """One sampling row per tree row, at the output position of its depth; with
        ``wants_history`` (penalties, sampling metadata) each row's path as its history."""
        tokens, parents, depths = inputs.extra["tree"]
        num_seqs = len(batch)
        inputs.row_seq = np.repeat(np.arange(num_seqs, dtype=np.int64), self.rows)
        inputs.row_offset = depths.reshape(-1).astype(np.int64)
        if wants_history:
            inputs.extra["row_prefix"] = [_path_tokens(tokens[b], parents[b], r) for b in range(num_seqs)
                                          for r in range(self.rows)]
        return inputs

    def verify(self, inputs: StepInputs, outputs: StepOutputs, params, in_think: Optional[np.ndarray]) -> StepOutputs:
        tokens, parents, _ = inputs.extra["tree"]
        num_seqs = tokens.shape[0]
        sampled = np.asarray(outputs.sampled).reshape(num_seqs, self.rows)
        drafts = tokens[:, 1:]
        targets = np.take_along_axis(sampled, parents[:, 1:], axis=1)  # [B, N] the target where each node stands
        ok = self._ok(inputs, outputs, params, drafts, targets, parents, in_think)
        paths = policy.tree_paths(parents, ok)
        outputs.accepted = [[int(tokens[b, r]) for r in path] + [int(sampled[b, path[-1] if path else 0])]
                            for b, path in enumerate(paths)]
        outputs.accepted_rows = [[b * self.rows + r for r in [0, *path]] for b, path in enumerate(paths)]
        outputs.num_draft_accepted = [len(p) for p in paths]
        outputs.num_drafts = [self.shape.depth] * num_seqs
        inputs.extra["tree_paths"] = paths
        return outputs

    def _ok(self, inputs, outputs, params, drafts, targets, parents, in_think) -> np.ndarray:
        if params.decoding_policy == "strict":
            return drafts == targets
        num_seqs = drafts.shape[0]
        md = inputs.extra["sampling_metadata"]
        rows = torch.from_numpy((np.arange(num_seqs)[:, None] * self.rows + parents[:, 1:]).reshape(-1))
        if params.decoding_policy == "relaxed":
            probs = torch.softmax(penalised_logits(outputs.logits, md), dim=-1)
            probs = probs.index_select(0, rows.to(probs.device)).view(num_seqs, -1, probs.shape[-1]).cpu()
            delta = np.where(in_think, params.relaxed_delta, 0.0)
            return policy.relaxed_ok(drafts, targets, probs, params.relaxed_topk, delta)
        probs = processed_probs(outputs.logits, md)
        probs = probs.index_select(0, rows.to(probs.device)).view(num_seqs, -1, probs.shape[-1]).cpu()
        return policy.typical_ok(drafts, targets, probs, params.posterior_threshold, params.posterior_alpha)

    def compact(self, inputs: StepInputs, model_wrapper) -> None:
        """The accepted path's main-model KV into the sequence's next slots."""
        num_tokens, tables = inputs.extra["tree_num_tokens"], inputs.extra["tree_tables"]
        seq_idx, src, dst = [], [], []
        for b, path in enumerate(inputs.extra["tree_paths"]):
            for j, r in enumerate(path, start=1):
                if r != j:
                    seq_idx.append(b)
                    src.append(num_tokens[b] - 1 + r)
                    dst.append(num_tokens[b] - 1 + j)
        if not src:
            return
        seq_idx = np.array(seq_idx)
        model_wrapper.copy_cache_entries(slots_for(tables, seq_idx, np.array(src), self.block_size),
                                         slots_for(tables, seq_idx, np.array(dst), self.block_size),
                                         model_wrapper.config.num_hidden_layers)


def _path_tokens(tokens: np.ndarray, parents: np.ndarray, row: int) -> list[int]:
    """The drafts from the root to ``row`` (the root's token excluded: it is already output)."""
    path = []
    while row > 0:
        path.append(int(tokens[row]))
        row = int(parents[row])
    return path[::-1]
