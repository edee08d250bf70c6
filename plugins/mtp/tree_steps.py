"""MTP decode steps that verify a draft tree per sequence (``tree_choices`` or ``"tree": "dynamic"``).

Every decode step drafts and verifies the whole tree (no adaptive choice of drafts): the MTP
steps build each sequence's tree on the device (modeling/tree_speculation.py), the main model
verifies [t(n-1), nodes...] with the ancestor mask, and plugins/tree_verify.py keeps the longest
accepted path. The MTP caches need no compaction: the next step's window writes the entries
past the verified tokens again from verified tokens and hidden states (decode_inputs: history
and lag).
"""
from __future__ import annotations

import numpy as np
import torch

from mindspec.modeling.draft_tree import TreeShape
from mindspec.plugins.tree_verify import TreeVerifier, verification_inputs
from mindspec.text_generator.step import StepBatch, StepInputs

from . import decode_inputs as di
from . import tree_inputs as ti


class TreeSteps(TreeVerifier):
    def __init__(self, shape: TreeShape, eagle: bool, block_size: int, dummy_block_id: int):
        super().__init__(shape, block_size)
        self.eagle = eagle
        self.dummy_block_id = dummy_block_id

    def inputs(self, batch: StepBatch, inputs: StepInputs, last_accepted: np.ndarray,
               hidden_from: np.ndarray) -> tuple[StepInputs, di.DecodeLayout]:
        seqs = batch.seqs
        num_tokens = np.array([s.num_tokens for s in seqs], dtype=np.int64)
        tables = di.block_tables([s.block_table for s in seqs])
        layout = di.decode_layout(num_tokens, last_accepted, self.shape.depth, "eagle" if self.eagle else "vanilla",
                                  hidden_from)
        inputs.model_inputs = verification_inputs(np.array([s.last_token_id for s in seqs]), num_tokens, tables,
                                                  self.block_size, self.shape.num_nodes)
        inputs.q_lens = inputs.model_inputs.q_lens
        inputs.extra["tree_steps"] = ti.draft_steps(di.window_tokens(seqs, layout), layout, tables, self.block_size,
                                                    self.shape, self.eagle, hidden_from, self.dummy_block_id)
        self.keep_layout(inputs, num_tokens, tables)
        return inputs, layout

    def forward(self, inputs: StepInputs, generator, hidden: torch.Tensor):
        out = generator.forward_tree(inputs.model_inputs, inputs.extra["tree_steps"], hidden, self.shape, self.eagle)
        tree = out.tree  # one copy to the host: every sequence's tree
        packed = torch.stack([tree.tokens, tree.parents, tree.depths]).cpu().numpy()
        inputs.extra["tree"] = packed  # [3, B, N + 1]: tokens, parent rows, depths
        return out
