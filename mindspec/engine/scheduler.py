"""Continuous batching with MindIE's limits; host-side only (no tensors).

Each step is either a prefill batch (new or recomputed sequences, FCFS) or a decode batch of every
running sequence, as in nano-vllm. Sequences join between steps and leave as soon as they finish.
When blocks run out during decode the most recently arrived running sequence is preempted (its
blocks freed, recomputed later from its tokens): waiting is possible, crashing or corrupting a
running sequence is not.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from .block_manager import BlockManager
from .errors import RequestRejected
from .sequence import FinishReason, Sequence, SequenceStatus

StopCheck = Callable[[Sequence, int], Optional[FinishReason]]


@dataclass
class SchedulerConfig:
    max_batch_size: int = 200
    max_prefill_batch_size: int = 50
    max_prefill_tokens: int = 8192
    max_seq_len: int = 2560
    max_input_token_len: int = 2048
    max_iter_times: int = 512
    truncation: str = "reject"  # MindIE truncation: "reject" | "left" (keep the last tokens) | "right"
    # KV positions a decode step writes beyond the real tokens (drafts); set from the plugins.
    num_lookahead_tokens: int = 0

    @property
    def effective_max_input_len(self) -> int:
        return min(self.max_input_token_len, self.max_seq_len - 1)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool


@dataclass
class SeqUpdate:
    seq: Sequence
    new_token_ids: list[int]  # appended this step (stops early at a finishing token)
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ---- admission ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Validate limits (may truncate the prompt or clip max_tokens) and queue the sequence."""
        cfg = self.config
        if not seq.prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        limit = cfg.effective_max_input_len
        n = len(seq.prompt_token_ids)
        if n > limit:
            if cfg.truncation == "reject":
                raise RequestRejected(
                    f"the prompt has {n} tokens, more than maxInputTokenLen={limit} "
                    f"(min of maxInputTokenLen and maxSeqLen-1)"
                )
            keep = seq.prompt_token_ids[-limit:] if cfg.truncation == "left" else seq.prompt_token_ids[:limit]
            seq.prompt_token_ids = list(keep)
            n = limit
        capacity = self.block_manager.num_usable_blocks * self.block_manager.block_size - cfg.num_lookahead_tokens
        if n >= capacity:
            raise RequestRejected(f"the prompt has {n} tokens but the whole KV cache holds {capacity}")
        # A sequence that could outgrow the whole cache would preempt itself forever: clip instead.
        seq.max_tokens = max(1, min(seq.max_tokens, cfg.max_iter_times, cfg.max_seq_len - n, capacity - n))
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence whose prompt KV was computed elsewhere (PD disaggregation): it skips prefill
        and runs from the next decode step. Its blocks are allocated now."""
        self.add(seq)
        self.waiting.remove(seq)
        if not self.block_manager.can_allocate(seq):
            raise RequestRejected(
                f"no free KV blocks for a prefilled request of {seq.num_tokens} tokens "
                f"({self.block_manager.num_free_blocks} free)"
            )
        self.block_manager.allocate(seq)
        seq.num_cached_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._finish(seq, reason)

    def abort(self, seq_id: int) -> Optional[Sequence]:
        for seq in list(self.waiting) + self.running:
            if seq.seq_id == seq_id:
                self._finish(seq, FinishReason.ABORT)
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling --------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledBatch]:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> Optional[ScheduledBatch]:
        cfg, bm = self.config, self.block_manager
        seqs: list[Sequence] = []
        tokens = 0
        while self.waiting and len(seqs) < cfg.max_prefill_batch_size:
            if len(self.running) + len(seqs) >= cfg.max_batch_size:
                break
            seq = self.waiting[0]
            # A prompt longer than maxPrefillTokens still runs, alone.
            if seqs and tokens + seq.num_tokens > cfg.max_prefill_tokens:
                break
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seqs.append(seq)
            tokens += seq.num_tokens
        if not seqs:
            return None
        self.running.extend(seqs)
        return ScheduledBatch(seqs, is_prefill=True)

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        bm, lookahead = self.block_manager, self.config.num_lookahead_tokens
        queue = list(self.running)
        scheduled: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            while not bm.can_append(seq, lookahead):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                bm.append_slots(seq, lookahead)
                scheduled.append(seq)
        self.running = scheduled
        # A copy: finishing sequences leave self.running while the batch is still being read.
        return ScheduledBatch(list(scheduled), is_prefill=False) if scheduled else None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- results -----------------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, new_tokens: list[list[int]], is_stop: StopCheck) -> list[SeqUpdate]:
        """Append each sequence's accepted tokens one by one, stopping at a finishing token."""
        updates = []
        for seq, tokens in zip(batch.seqs, new_tokens):
            # KV now covers every token fed this step that was accepted (the last token and the
            # accepted drafts); the newest token is fed, and cached, next step.
            seq.num_cached_tokens = seq.num_tokens if batch.is_prefill else seq.num_cached_tokens + len(tokens)
            appended = []
            for token in tokens:
                seq.append_token(token)
                appended.append(int(token))
                reason = is_stop(seq, token)
                if reason is None and seq.num_output_tokens >= seq.max_tokens:
                    reason = FinishReason.LENGTH
                if reason is not None:
                    self._finish(seq, reason)
                    break
            updates.append(SeqUpdate(seq, appended, seq.is_finished))
        return updates

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
