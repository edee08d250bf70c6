"""Records passed between the plugin manager, its plugins and the generator for one step.

Names follow seed 000's module-boundary table: ``model_inputs``, ``sub_model_inputs``, ``q_lens``,
``hidden_states``; back: ``logits``, ``hidden_states``, ``draft_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from mindspec.engine.sequence import Sequence
from mindspec.modeling.forward_metadata import ModelInputs
from mindspec.modeling.packed_transfer import packed_span

# Async scheduling: stands for a token the in-flight step has not produced yet. Negative, so that a
# placeholder left unpatched fails the embedding lookup instead of decoding a wrong token.
PLACEHOLDER_TOKEN = -1


@dataclass
class StepBatch:
    """The scheduled sequences of one step, host side (MindIE's InputMetadata)."""

    seqs: list[Sequence]
    is_prefill: bool
    block_size: int
    # SplitFuse (a mixed step): per sequence the prompt tokens it computes, 0 for one decode row
    chunks: Optional[list[int]] = None

    @property
    def is_mixed(self) -> bool:
        return self.chunks is not None

    def chunk_rows(self) -> np.ndarray:
        """[B] bool: the sequences of a mixed step that compute a prefill chunk."""
        return np.asarray(self.chunks, dtype=np.int64) > 0

    def prefill_ends(self) -> np.ndarray:
        """[B] bool: the chunks that end their sequence's prefill (they yield a token)."""
        return np.array([s.prefill_ends_with(c) for s, c in zip(self.seqs, self.chunks)], dtype=bool)

    @property
    def seq_ids(self) -> list[int]:
        return [s.seq_id for s in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class StepInputs:
    model_inputs: ModelInputs
    q_lens: np.ndarray  # [B] int32 tokens per sequence in model_inputs
    # Which sequence each logits row belongs to, and how many draft tokens precede it: rows of one
    # sequence sit at consecutive output positions (sampling seeds and penalties depend on it).
    row_seq: np.ndarray  # [N] int64
    row_offset: np.ndarray  # [N] int64
    sub_model_inputs: Optional[ModelInputs] = None  # the drafter's inputs (MTP decode)
    hidden_states: Optional[torch.Tensor] = None  # [rows, hidden] cached hidden states for the drafter
    extra: dict = field(default_factory=dict)


@dataclass
class StepOutputs:
    logits: torch.Tensor  # [N, vocab] float32
    hidden_states: torch.Tensor  # [T, hidden]
    draft_tokens: Optional[torch.Tensor] = None  # [B, K]
    # [N] argmax of logits where a captured graph computed it; a step's sampled targets where it sampled them
    greedy_tokens: Optional[torch.Tensor] = None
    # [B] drafts the step accepted itself (modeling/hidden_cache.py: read with greedy_host; -1: it could not)
    accepted_drafts: Optional[torch.Tensor] = None
    sampled: Optional[np.ndarray] = None  # [N] int64 sampled target token per row
    logprobs: Optional[np.ndarray] = None  # [N] float32
    top_logprobs: Optional[tuple[np.ndarray, np.ndarray]] = None  # ([N, n] ids, [N, n] values)
    # Per sequence: the tokens accepted this step (1..K+1) and, with drafts, how many were accepted.
    accepted: list[list[int]] = field(default_factory=list)
    num_draft_accepted: Optional[list[int]] = None
    num_drafts: Optional[list[int]] = None  # per sequence, where sequences verify different numbers of drafts
    accepted_rows: list[list[int]] = field(default_factory=list)  # logits rows of the accepted tokens
    # Prefill: prompt logprobs of the sequences that asked, by seq_id (prompt_logprobs.py)
    prompt_logprobs: dict = field(default_factory=dict)
    # Sequences that verified drafts made on the host instead of draft_tokens' row: {b: drafts}
    host_drafts: Optional[dict[int, list[int]]] = None
    _drafts_host: Optional[np.ndarray] = field(default=None, repr=False)
    _read_drafts: Optional[np.ndarray] = field(default=None, repr=False)  # came with greedy_host's copy
    _read_accepted: Optional[np.ndarray] = field(default=None, repr=False)  # so did these
    _all_decided: Optional[bool] = field(default=None, repr=False)  # accepted_in_step's reading of them

    def greedy_host(self) -> np.ndarray:
        """[N] the argmax of each logits row on the host (``greedy_tokens`` where the step computed
        them, else computed here). Where a captured step packed its drafts (and accepted counts)
        after them in one buffer (graph_runner._with_greedy) they come along in the same copy."""
        greedy = self.greedy_tokens if self.greedy_tokens is not None else self.logits.argmax(dim=-1)
        tail = [t for t in (self.draft_tokens, self.accepted_drafts) if t is not None]
        span = packed_span(greedy, *tail) if self._drafts_host is None and tail else None
        if span is None:
            return greedy.cpu().numpy()
        host = span.cpu().numpy()
        read = [host[t.storage_offset() - greedy.storage_offset():][: t.numel()].reshape(t.shape) for t in tail]
        if self.draft_tokens is not None:
            self._read_drafts = read.pop(0)
        if read:
            self._read_accepted = read[0]
        return host[: greedy.numel()]

    def accepted_host(self) -> np.ndarray:
        """[B] ``accepted_drafts`` on the host (after ``greedy_host``: usually read with it)."""
        if self._read_accepted is None:
            self._read_accepted = self.accepted_drafts.cpu().numpy()
        return self._read_accepted

    def drafts_host(self) -> Optional[np.ndarray]:
        """The drafts each sequence verified on the host [B, W]: draft_tokens read back from the
        device once per step, with ``host_drafts``' rows in place (W: the most drafts of any;
        token 0 past a sequence's own, which acceptance never reaches: it is capped at each
        sequence's count)."""
        if self._drafts_host is None and self.draft_tokens is not None:
            drafts = self._read_drafts if self._read_drafts is not None else self.draft_tokens.cpu().numpy()
            if self.host_drafts:
                width = max(drafts.shape[1], *(len(d) for d in self.host_drafts.values()))
                drafts = np.pad(drafts, ((0, 0), (0, width - drafts.shape[1])))
                for b, d in self.host_drafts.items():
                    drafts[b] = 0
                    drafts[b, : len(d)] = d
            self._drafts_host = drafts
        return self._drafts_host


def accepted_in_step(inputs: StepInputs, outputs: StepOutputs) -> bool:
    """The step accepted the drafts and kept the hidden states itself (modeling/hidden_cache.py):
    it had rows to keep and decided every target (accepted -1: a sampled step whose top-p sets
    it could not decide; the host samples and accepts it instead)."""
    cache = inputs.extra.get("hidden_cache")
    if cache is None or not cache.accepts_in_step or outputs.accepted_drafts is None:
        return False
    if outputs._all_decided is None:  # asked by sampling, verification and the cache update
        outputs._all_decided = bool((outputs.accepted_host() >= 0).all())
    return outputs._all_decided


def draft_grid(drafts: list[list[int]]) -> np.ndarray:
    """[B, W] the drafts each sequence verifies, made on the host (W: the most of any; token 0
    past a sequence's own, which acceptance and penalty histories never read)."""
    grid = np.zeros((len(drafts), max((len(d) for d in drafts), default=0)), dtype=np.int64)
    for b, d in enumerate(drafts):
        grid[b, : len(d)] = d
    return grid
