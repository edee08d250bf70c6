"""Per-request output state in the engine: detokenizer, stop strings, logprobs, statistics."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from mindspec.text_generator.detokenizer import IncrementalDetokenizer
from mindspec.text_generator.stop_strings import StopStringMatcher

from .outputs import RequestMetrics, RequestOutput, SpecDecodeStats
from .sequence import Sequence


@dataclass
class RequestState:
    request_id: str
    seq: Sequence
    prompt: Optional[str]
    detokenizer: Optional[IncrementalDetokenizer]
    stop_matcher: Optional[StopStringMatcher]
    text: str = ""
    stop_reason: Optional[int | str] = None
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[dict[int, float]]] = None
    spec_decode: Optional[SpecDecodeStats] = None
    prompt_logprobs: Optional[list[Optional[float]]] = None  # set once, after the prefill
    prompt_top_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    prompt_logprobs_done: bool = False
    prefix_parent: Optional["RequestState"] = field(default=None, repr=False)  # share_prefix_with's request
    pending_text: str = field(default="")  # text produced since the last output was built
    export_kv: bool = False  # PD prefill node: capture the prompt KV after prefill
    handoff: Optional[object] = None  # the PrefillHandoff once captured
    metrics: RequestMetrics = field(init=False)
    # the prompt ids every output carries: copied once (not at every step: long prompts)
    _prompt_ids: tuple = field(default=(None, None), init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.seq.arrival_time)

    def add_token_text(self, token_id: int) -> bool:
        """Detokenize one token; returns True when a stop string completed."""
        if self.detokenizer is None:
            return False
        piece = self.detokenizer.add([token_id])
        if self.stop_matcher is None:
            self._emit(piece)
            return False
        emitted, matched = self.stop_matcher.feed(piece)
        self._emit(emitted)
        if matched:
            self.stop_reason = self.stop_matcher.matched_stop
        return matched

    def set_prompt_logprobs(self, scored) -> None:
        """Fill the prompt logprobs from a prefill's PromptLogprobs (prompt_logprobs.py; None for
        a one-token prompt, which has nothing to score); entries before ``scored.first`` (entry 0,
        or those of a prefix whose KV was shared) must be filled in already."""
        n = self.seq.num_prompt_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_top_logprobs = [None] * n, [None] * n
        if scored is None:
            return
        end = scored.first + len(scored.chosen)
        self.prompt_logprobs[scored.first:end] = scored.chosen.tolist()
        self.prompt_top_logprobs[scored.first:end] = scored.top_dicts(self.seq.prompt_token_ids)

    def copy_prompt_logprobs(self, parent: "RequestState", end: int) -> None:
        """Entries 1 .. end - 1 from ``parent`` (same prompt, same prompt_logprobs), whose prefill
        computed the positions this sequence shared instead of computing."""
        n = self.seq.num_prompt_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_top_logprobs = [None] * n, [None] * n
        self.prompt_logprobs[1:end] = parent.prompt_logprobs[1:end]
        self.prompt_top_logprobs[1:end] = [dict(d) for d in parent.prompt_top_logprobs[1:end]]

    def finish_text(self) -> None:
        if self.detokenizer is None or isinstance(self.stop_reason, str):  # a stop string ended it
            return
        tail = self.detokenizer.flush()
        if self.stop_matcher is not None:
            emitted, matched = self.stop_matcher.feed(tail)
            tail = emitted + ("" if matched else self.stop_matcher.flush())
        self._emit(tail)

    def _emit(self, text: str) -> None:
        self.text += text
        self.pending_text += text

    def output(self, new_token_ids: list[int]) -> RequestOutput:
        seq = self.seq
        source, prompt_ids = self._prompt_ids
        if source is not seq.prompt_token_ids:  # (admission may truncate the prompt: a new list)
            self._prompt_ids = source, prompt_ids = seq.prompt_token_ids, list(seq.prompt_token_ids)
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=prompt_ids,
            token_ids=list(seq.output_token_ids),
            text=self.text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=self.stop_reason,
            new_token_ids=new_token_ids,
            new_text=self.pending_text,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            spec_decode=self.spec_decode,
            num_preemptions=seq.num_preemptions,
            prompt_logprobs=self.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs,
            num_shared_prompt_tokens=seq.shared_prefix_tokens,
            num_cached_tokens=seq.prefix_cached_tokens,
            metrics=replace(self.metrics, first_scheduled_time=seq.first_scheduled_time),
        )
        self.pending_text = ""
        return out
