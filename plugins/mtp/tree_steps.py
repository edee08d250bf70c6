"""MTP decode steps that verify a draft tree per sequence (``tree_choices`` or ``"tree": "dynamic"``).

Every decode step drafts and verifies the whole tree (no adaptive choice of drafts): the MTP
steps build each sequence's tree on the device (modeling/tree_speculation.py), the main model
verifies [t(n-1), nodes...] with the ancestor mask, and the decoding policy keeps the longest
path of nodes that pass it, then the target at its last row (the bonus token).

- strict: a node passes when its token equals the target sampled at its parent's row. Each
  row samples at the output position of its depth, with its path as penalty history, so a
  sequence emits exactly the tokens plain decoding samples (greedy: the argmax path; seeded:
  the same draws). For top-k candidates this is multi-candidate rejection sampling (SpecInfer,
  EAGLE) with deterministic drafts: child c is accepted with probability p(c) and a rejection
  removes c from the residual, which is sampling p once and taking the child that matches.
- typical and relaxed: a node passes by the rule at its parent's row (or by matching its target).

After verification the accepted path's main-model KV moves from its tree rows to the sequence's
next slots (n .. n-1+a); the MTP caches need no move: the next step's window writes those
entries again from verified tokens and hidden states (decode_inputs: history and lag).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from mindspec.modeling.draft_tree import TreeShape
from mindspec.modeling.forward_metadata import slots_for
from mindspec.text_generator.sampling.sampler import penalised_logits, processed_probs
from mindspec.text_generator.step import StepBatch, StepInputs, StepOutputs

from . import decode_inputs as di
from . import decoding_policy as policy
from . import tree_inputs as ti


class TreeSteps:
    def __init__(self, shape: TreeShape, eagle: bool, block_size: int, dummy_block_id: int):
        self.shape = shape
        self.eagle = eagle
        self.block_size = block_size
        self.dummy_block_id = dummy_block_id
        self.rows = shape.num_nodes + 1  # verification rows per sequence

    def inputs(self, batch: StepBatch, inputs: StepInputs, last_accepted: np.ndarray,
               hidden_from: np.ndarray) -> tuple[StepInputs, di.DecodeLayout]:
        seqs = batch.seqs
        num_tokens = np.array([s.num_tokens for s in seqs], dtype=np.int64)
        tables = di.block_tables([s.block_table for s in seqs])
        layout = di.decode_layout(num_tokens, last_accepted, self.shape.depth, "eagle" if self.eagle else "vanilla",
                                  hidden_from)
        inputs.model_inputs = ti.main_inputs(np.array([s.last_token_id for s in seqs]), num_tokens, tables,
                                             self.block_size, self.shape.num_nodes)
        inputs.q_lens = inputs.model_inputs.q_lens
        inputs.extra["tree_steps"] = ti.draft_steps([s.token_ids for s in seqs], layout, tables, self.block_size,
                                                    self.shape, self.eagle, hidden_from, self.dummy_block_id)
        inputs.extra["tree_num_tokens"] = num_tokens
        inputs.extra["tree_tables"] = tables
        return inputs, layout

    def forward(self, inputs: StepInputs, generator, hidden: torch.Tensor):
        out = generator.forward_tree(inputs.model_inputs, inputs.extra["tree_steps"], hidden, self.shape, self.eagle)
        tree = out.tree  # one copy to the host: every sequence's tree
        packed = torch.stack([tree.tokens, tree.parents, tree.depths]).cpu().numpy()
        inputs.extra["tree"] = packed  # [3, B, N + 1]: tokens, parent rows, depths
        return out

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
