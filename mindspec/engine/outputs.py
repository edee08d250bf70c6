"""What the engine returns per request and step (host records, no tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters of one request: drafts proposed and accepted per position.
    Steps may verify fewer than K drafts (adaptive speculation), so each position counts the steps
    that drafted it."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [K] drafts accepted at position k
    drafted_per_position: list[int] = field(default_factory=list)  # [K] steps that drafted position k

    @classmethod
    def for_drafts(cls, k: int) -> "SpecDecodeStats":
        return cls(accepted_per_position=[0] * k, drafted_per_position=[0] * k)

    def add_step(self, num_drafts: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_drafts):
            self.drafted_per_position[pos] += 1
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per decode step (accepted drafts + the bonus token)."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


@dataclass
class RequestMetrics:
    """When a request reached each milestone, in ``time.monotonic()`` seconds of the process that
    ran it (vLLM's RequestMetrics; differences are what carry over). Tokens count when the engine
    post-processes them, which is when a caller can see them (under async scheduling, a step after
    the device made them)."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def time_in_queue(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> Optional[float]:
        """Mean seconds per token after the first (TPOT): the decode speed a request saw."""
        if self.first_token_time is None or self.last_token_time is None or num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (num_output_tokens - 1)

    def note_tokens(self, now: float, new_tokens: int, finished: bool) -> None:
        if new_tokens:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        if finished and self.finished_time is None:
            self.finished_time = now


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Optional[int | str] = None  # the stop token id or stop string that ended it
    new_token_ids: list[int] = field(default_factory=list)  # this step's delta, for streaming
    new_text: str = ""
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[dict[int, float]]] = None
    spec_decode: Optional[SpecDecodeStats] = None
    num_preemptions: int = 0
    # With SamplingParams.prompt_logprobs, from the output after the prefill on: one entry per
    # prompt token, None for the first (no context); log_softmax of the raw logits.
    prompt_logprobs: Optional[list[Optional[float]]] = None
    prompt_top_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    # share_prefix_with: prompt tokens whose KV came from the other request instead of a prefill
    num_shared_prompt_tokens: int = 0
    # prompt tokens not computed at the first admission: found in the prefix cache or shared with
    # the request named by share_prefix_with (OpenAI's usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None  # a snapshot as of this output


@dataclass
class PrefillHandoff:
    """What a prefill node hands a decode node (PD disaggregation): the prompt, the first token
    and the prompt's latent KV for every cache layer (main layers, then MTP modules)."""

    prompt_token_ids: list[int]
    first_token_id: int
    kv: list  # per cache layer: torch.Tensor [num_prompt_tokens, kv_lora_rank + qk_rope_head_dim]
