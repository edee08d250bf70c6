"""A Sequence: one request's tokens, counters and block table. Host-side only, no tensors."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_tokens, maxIterTimes or maxSeqLen
    ABORT = "abort"


@dataclass(eq=False)  # identity semantics: the scheduler looks sequences up in its queues
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    sampling_params: Any = None  # read by the sampler, never by the scheduler
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens whose KV is in the cache
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: Optional[float] = None  # its first admission (time.monotonic)
    finish_reason: Optional[FinishReason] = None
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)  # plugin state keyed by plugin name
    # n > 1 completions: a sequence with the same prompt whose prompt blocks this one takes at its
    # prefill (BlockManager.share) instead of computing them; the scheduler drops the link once
    # it has decided. shared_prefix_tokens: the prompt tokens it took that way.
    share_parent: Optional["Sequence"] = field(default=None, repr=False)
    shared_prefix_tokens: int = 0
    # Prefix caching: keys of its whole blocks (prefix_cache.py; content only, so they survive a
    # preemption), how many leading blocks were offered to the cache, and the prompt tokens its
    # first admission found cached (usage.prompt_tokens_details.cached_tokens).
    block_keys: list = field(default_factory=list, repr=False)
    published_blocks: int = 0
    prefix_cached_tokens: int = 0
    prompt_only: bool = False  # max_tokens 0 allowed: the prefill scores the prompt, nothing is generated

    def start_running(self) -> None:
        """Admitted by the scheduler (again after a preemption: the first admission's time stays)."""
        self.status = SequenceStatus.RUNNING
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_from(self, start: int) -> list[int]:
        """``token_ids[start:]`` (start >= 0) without copying the prompt before ``start``: a
        decode step reads each sequence's last few tokens, and ``token_ids`` is a new list of
        all of them."""
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def prefill_ends_with(self, chunk: int) -> bool:
        """A prefill chunk of ``chunk`` uncached tokens computes the last of them (the sequence
        then gets its next token)."""
        return chunk > 0 and self.num_cached_tokens + chunk >= self.num_tokens

    @staticmethod
    def num_blocks_needed(num_tokens: int, block_size: int) -> int:
        """Blocks that hold ``num_tokens`` token positions (ceil division); 0 for 0 tokens."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return -(-max(0, num_tokens) // block_size)
