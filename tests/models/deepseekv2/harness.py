"""Drives FlashCausalDeepseekV2 through the paged cache the way the engine will: sequences grow,
each forward appends tokens after what is cached, block tables are shuffled block ids."""
from __future__ import annotations

import numpy as np
import torch

from mindspec.modeling.forward_metadata import build_model_inputs, to_device


class PagedRunner:
    def __init__(self, model, num_blocks: int, block_size: int, max_tokens_per_seq: int, num_seqs: int, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.caches = model.allocate_caches(num_blocks, block_size)
        rng = np.random.default_rng(seed)
        per_seq = -(-max_tokens_per_seq // block_size)
        assert per_seq * num_seqs <= num_blocks
        ids = rng.permutation(num_blocks)[: per_seq * num_seqs]
        self.block_tables = [ids[i * per_seq : (i + 1) * per_seq].tolist() for i in range(num_seqs)]
        self.num_cached = [0] * num_seqs

    def inputs(self, new_tokens: list[list[int]], all_rows: bool = False):
        lm_head = np.arange(sum(len(t) for t in new_tokens)) if all_rows else None
        host = build_model_inputs(new_tokens, self.num_cached, self.block_tables, self.block_size, lm_head)
        return host, to_device(host, self.model.backend.device)

    def step(self, new_tokens: list[list[int]], all_rows: bool = False) -> torch.Tensor:
        """Main model over the new tokens -> logits [rows, vocab]; advances the cached lengths."""
        _, dev = self.inputs(new_tokens, all_rows)
        out = self.model.forward(dev.input_ids, dev.positions, self.caches, dev.meta, dev.lm_head_indices)
        self.num_cached = [c + len(t) for c, t in zip(self.num_cached, new_tokens)]
        return out
