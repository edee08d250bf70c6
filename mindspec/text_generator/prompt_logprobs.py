"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's echo + logprobs): log p(prompt[i] |
prompt[:i]) under the raw model distribution (log_softmax of the logits, no temperature, no
penalties, no logit_bias), and optionally the top-k of each position.

They come from the prefill's hidden states, which the model returns for every fed row (after the
final norm): the lm_head is applied here to the prompt rows of the sequences that asked, in
chunks, so the step's logits rows (one per sequence, what the sampler and the plugins read) stay
as they are and no generated token can change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from mindspec.modeling.forward_metadata import ModelInputs

CHUNK_ROWS = 512  # lm_head rows per matmul: bounds the [rows, vocab] fp32 temporaries


@dataclass
class PromptLogprobs:
    """Entries first .. first + len(chosen) - 1 of a prompt's logprobs (entry i: prompt token i)."""

    first: int  # 1 after a full prefill (entry 0 has no context); later when the start was cached
    chosen: np.ndarray  # [M] float32 logprob of each prompt token
    top_ids: Optional[np.ndarray]  # [M, k] int64 (None when k = 0)
    top_values: Optional[np.ndarray]  # [M, k] float32

    def top_dicts(self, prompt_token_ids: list[int]) -> list[dict[int, float]]:
        """Per entry the top-k tokens and the prompt token itself (listed even when it is not among
        the top-k, as vLLM and OpenAI do; with k = 0 it is the only one)."""
        dicts = []
        for j, value in enumerate(self.chosen.tolist()):
            d = {} if self.top_ids is None else dict(zip(self.top_ids[j].tolist(), self.top_values[j].tolist()))
            d.setdefault(int(prompt_token_ids[self.first + j]), value)
            dicts.append(d)
        return dicts


def wanted(seq) -> bool:
    """The sequence asked for prompt logprobs and this prefill feeds prompt rows that predict
    prompt tokens (a recompute after preemption that starts past the prompt feeds none)."""
    params = seq.sampling_params
    return getattr(params, "prompt_logprobs", None) is not None and seq.num_cached_tokens < seq.num_prompt_tokens - 1


def compute(
    seqs: list,
    inputs: ModelInputs,
    hidden_states: torch.Tensor,  # [T, hidden] every fed row of the prefill
    lm_head: Callable[[torch.Tensor], torch.Tensor],  # [R, hidden] -> [R, vocab] logits
) -> dict[int, PromptLogprobs]:
    """Prompt logprobs of the sequences of a prefill batch that want them, by seq_id. Sequence b
    was fed tokens num_cached .. num_cached + q_lens[b] - 1; the row at position p scores prompt
    token p + 1."""
    out: dict[int, PromptLogprobs] = {}
    starts = inputs.q_start_loc
    for b, seq in enumerate(seqs):
        if not wanted(seq):
            continue
        cached = seq.num_cached_tokens
        last = seq.num_prompt_tokens - 2  # the last position whose next token is a prompt token
        rows = np.arange(int(starts[b]), int(starts[b]) + last - cached + 1)
        targets = np.asarray(seq.prompt_token_ids[cached + 1:], dtype=np.int64)
        out[seq.seq_id] = _score(hidden_states, rows, targets, seq.sampling_params.prompt_logprobs, lm_head, cached + 1)
    return out


def _score(hidden, rows: np.ndarray, targets: np.ndarray, k: int, lm_head, first: int) -> PromptLogprobs:
    chosen, top_ids, top_values = [], [], []
    for lo in range(0, len(rows), CHUNK_ROWS):
        idx = torch.from_numpy(rows[lo:lo + CHUNK_ROWS]).to(hidden.device)
        tgt = torch.from_numpy(targets[lo:lo + CHUNK_ROWS]).to(hidden.device)
        lp = lm_head(hidden.index_select(0, idx)).float().log_softmax(dim=-1)
        chosen.append(lp.gather(1, tgt.unsqueeze(1)).squeeze(1).cpu())
        if k:
            values, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
            top_ids.append(ids.cpu())
            top_values.append(values.cpu())
    return PromptLogprobs(
        first=first,
        chosen=torch.cat(chosen).numpy(),
        top_ids=torch.cat(top_ids).numpy() if k else None,
        top_values=torch.cat(top_values).numpy() if k else None,
    )
