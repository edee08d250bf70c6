"""Continuous batching with MindIE's limits; host-side only (no tensors).

Each step is either a prefill batch (new or recomputed sequences, FCFS) or a decode batch of every
running sequence, as in nano-vllm. Sequences join between steps and leave as soon as they finish;
while others decode, a small prefill may wait a few steps to be batched (waiting_served_ratio).
When blocks run out during decode the most recently arrived running sequence is preempted (its
blocks freed, recomputed later from its tokens): waiting is possible, crashing or corrupting a
running sequence is not.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

from .block_manager import BlockManager
from .errors import CapacityExceeded, EngineError, RequestRejected
from .sequence import FinishReason, Sequence, SequenceStatus

StopCheck = Callable[[Sequence, int], Optional[FinishReason]]


# MindIE's truncation codes (ModelDeployConfig.truncation): 0/false reject, 1 cut from the left
# (keep the last tokens), -1/true cut from the right (keep the first tokens); same table as
# mindspec.config.mindie_config.
_TRUNCATION_CODES = {0: "reject", 1: "left", -1: "right"}
TRUNCATION_MODES = ("reject", "left", "right")


@dataclass
class SchedulerConfig:
    max_batch_size: int = 200  # maxBatchSize: running sequences
    max_prefill_batch_size: int = 50  # maxPrefillBatchSize
    max_prefill_tokens: int = 8192  # maxPrefillTokens (a longer single prompt still runs alone)
    max_seq_len: int = 2560  # maxSeqLen: prompt + output
    max_input_token_len: int = 2048  # maxInputTokenLen (effective: min(it, maxSeqLen - 1))
    max_iter_times: int = 512  # maxIterTimes: output tokens
    # "reject" | "left" (keep the last tokens) | "right" (keep the first); MindIE's codes
    # 0/1/-1 and booleans are accepted and normalised.
    truncation: Union[str, int, bool] = "reject"
    # cacheBlockSize; None takes the block manager's. Informational: the block manager's value rules.
    block_size: Optional[int] = None
    # KV positions a decode step writes beyond the real tokens (drafts); set from the plugins.
    num_lookahead_tokens: int = 0
    # Build step N+1 on the host while step N runs (engine/async_scheduling.py); MindIE's
    # MINDIE_ASYNC_SCHEDULING_ENABLE, here ScheduleConfig.asyncScheduling.
    async_scheduling: bool = False
    # Prefill batching, TGI's waiting_served_ratio / max_waiting_tokens: while sequences run, new
    # ones are prefilled only in groups of at least floor(ratio x running), or once
    # max_waiting_steps decode steps have passed since the last prefill. Each prefill is one more
    # forward over the whole model; with speculation, sequences finish at different steps and
    # would otherwise be refilled one or two at a time. 0 turns it off (prefill first, always).
    # TGI defaults to 1.2 but bounds a batch by tokens; here the group is bounded by free seats.
    waiting_served_ratio: float = 0.3
    max_waiting_steps: int = 20
    # SplitFuse (MindIE's "splitfuse" plugin, templateType "Mix"): while sequences decode, prompts
    # are prefilled in chunks inside the decode steps, at most split_chunk_tokens rows per step
    # (decode rows first). Mixing starts once split_start_batch_size sequences run (0: always).
    split_fuse: bool = False
    split_chunk_tokens: int = 512
    split_start_batch_size: int = 0

    def __post_init__(self) -> None:
        t = self.truncation
        if isinstance(t, bool):
            t = -1 if t else 0
        if isinstance(t, int):
            if t not in _TRUNCATION_CODES:
                raise EngineError(f"truncation must be 0 (reject), 1 (cut left) or -1 (cut right), got {t}")
            t = _TRUNCATION_CODES[t]
        if t not in TRUNCATION_MODES:
            raise EngineError(f"truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}")
        self.truncation = t
        for name in ("max_batch_size", "max_prefill_batch_size", "max_prefill_tokens", "max_input_token_len",
                     "max_iter_times"):
            if getattr(self, name) < 1:
                raise EngineError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise EngineError(f"max_seq_len must be >= 2 (one prompt and one output token), got {self.max_seq_len}")
        if self.num_lookahead_tokens < 0:
            raise EngineError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")
        if not self.waiting_served_ratio >= 0:  # also NaN
            raise EngineError(f"waiting_served_ratio must be >= 0, got {self.waiting_served_ratio}")
        if self.max_waiting_steps < 0:
            raise EngineError(f"max_waiting_steps must be >= 0, got {self.max_waiting_steps}")
        if self.split_chunk_tokens < 1 or self.split_start_batch_size < 0:
            raise EngineError(f"split_chunk_tokens must be >= 1 and split_start_batch_size >= 0, got "
                              f"{self.split_chunk_tokens} and {self.split_start_batch_size}")

    @property
    def effective_max_input_len(self) -> int:
        return min(self.max_input_token_len, self.max_seq_len - 1)


def chunk_tokens(remaining: int, budget: int, lookahead: int, whole: bool = False) -> int:
    """Rows of a sequence's next prefill chunk, ``remaining`` tokens still to compute: all of
    them if they fit ``budget``; else as many as fit while the final chunk keeps lookahead + 1
    rows, so that a chunk's last MTP entries pair positions with prompt tokens only (the final
    chunk's pair with generated ones and are rewritten by the first decode); 0: none this step.
    ``whole``: all or nothing."""
    if remaining <= budget:
        return remaining
    if whole:
        return 0
    return max(0, min(budget, remaining - lookahead - 1))


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    return getattr(seq.sampling_params, "prompt_logprobs", None) is not None


@dataclass
class _Admission:
    """A waiting sequence the next prefill batch takes, with the KV it does not compute."""

    seq: Sequence
    shared: int  # blocks of its n > 1 parent
    cached_keys: list[bytes]
    cached_blocks: list[int]  # blocks of the prefix cache

    @property
    def reused(self) -> int:
        return self.shared + len(self.cached_blocks)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool
    # SplitFuse: per sequence the prompt tokens it computes this step, 0 for one decode row (a
    # mixed step: decoding sequences first, then prefill chunks); None: not a mixed step.
    chunks: Optional[list[int]] = None

    @property
    def is_mixed(self) -> bool:
        return self.chunks is not None

    def completes_prefill(self, b: int) -> bool:
        """Sequence b's prefill ends with this step (it gets its first token)."""
        if self.chunks is None:
            return self.is_prefill
        return self.seqs[b].prefill_ends_with(self.chunks[b])


class SeqUpdate(NamedTuple):
    """One sequence's result of a step; unpacks as (seq, new_token_ids, finished)."""

    seq: Sequence
    new_token_ids: list[int]  # appended this step (stops early at a finishing token)
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        if config.block_size is None:
            config.block_size = block_manager.block_size
        elif config.block_size != block_manager.block_size:
            raise EngineError(
                f"SchedulerConfig.block_size={config.block_size} but the block manager uses "
                f"{block_manager.block_size}-token blocks"
            )
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # SplitFuse: admitted sequences (blocks held) whose prefill is not done yet, oldest first
        self.prefilling: list[Sequence] = []
        self.decode_steps_since_prefill = 0
        # Prefix caching: the positions of a sequence whose KV is final in every cache (the main
        # model's: the cached tokens; the engine adds its plugins' caches). Read after each step.
        self.final_kv_tokens: Callable[[Sequence, bool], int] = lambda seq, finished: seq.num_cached_tokens

    # ---- admission ---------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """Longest sequence (tokens, drafts excluded) the whole cache can hold in one decode step."""
        bm = self.block_manager
        return bm.num_usable_blocks * bm.block_size - self.config.num_lookahead_tokens

    def add(self, seq: Sequence) -> None:
        """Validate limits (may truncate the prompt or clip max_tokens) and queue the sequence.

        Raises RequestRejected for a request that could never run; the sequence is then not queued.
        """
        self._validate(seq, allow_truncation=True)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _validate(self, seq: Sequence, allow_truncation: bool) -> None:
        cfg = self.config
        if not seq.prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        limit = cfg.effective_max_input_len
        n = len(seq.prompt_token_ids)
        if n > limit:
            if cfg.truncation == "reject" or not allow_truncation:
                raise RequestRejected(
                    f"the prompt has {n} tokens, more than maxInputTokenLen={limit} "
                    f"(min of maxInputTokenLen={cfg.max_input_token_len} and maxSeqLen-1={cfg.max_seq_len - 1})"
                )
            keep = seq.prompt_token_ids[-limit:] if cfg.truncation == "left" else seq.prompt_token_ids[:limit]
            seq.prompt_token_ids = list(keep)
            n = limit
        capacity = self.kv_capacity_tokens
        if n > capacity:
            bm = self.block_manager
            raise RequestRejected(
                f"the prompt has {n} tokens but the whole KV cache holds {capacity} "
                f"({bm.num_usable_blocks} usable blocks x {bm.block_size} tokens"
                + (f", minus {cfg.num_lookahead_tokens} draft positions" if cfg.num_lookahead_tokens else "")
                + ")"
            )
        # Output limit: min(maxIterTimes, max_tokens), prompt + output <= maxSeqLen, and the last
        # decode step (num_tokens = n + max_tokens - 1, plus drafts) must fit the whole cache: a
        # sequence that could outgrow it would preempt itself forever.
        # max_tokens 0 stays 0 only for a sequence that scores its prompt (prompt_logprobs): it
        # finishes after its prefill without a token. Otherwise at least one token, as always.
        floor = 0 if seq.prompt_only else 1
        seq.max_tokens = max(
            floor, min(seq.max_tokens, cfg.max_iter_times, cfg.max_seq_len - n, capacity - n + 1)
        )

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence whose prompt KV was computed elsewhere (PD disaggregation): it skips prefill
        and runs from the next decode step. Its blocks are allocated now, since the caller writes
        the handed-off KV into them at once; so it cannot wait: when the batch is full
        (maxBatchSize) or blocks are short it raises CapacityExceeded and nothing changes. The
        prompt is never truncated here: the KV handed off is that of the whole prompt. With prefix
        caching its first blocks may be cached ones (``prefix_cached_tokens``), not to be written."""
        self._validate(seq, allow_truncation=False)
        cfg, bm = self.config, self.block_manager
        if len(self.running) >= cfg.max_batch_size:
            raise CapacityExceeded(
                f"cannot adopt a prefilled request: {len(self.running)} sequences already run "
                f"(maxBatchSize={cfg.max_batch_size})"
            )
        # With prefix caching, cached blocks of its prompt are taken instead of written again.
        keys, cached = self._cached_prefix(seq)
        # Its tokens only: the drafts' positions are added by the first decode (which may preempt).
        need = bm.blocks_missing(seq, seq.num_tokens) - len(cached) + sum(map(bm.is_idle, cached))
        if need > bm.num_free_blocks:
            raise CapacityExceeded(
                f"cannot adopt a prefilled request of {seq.num_tokens} tokens: it needs "
                f"{need} more KV blocks, {bm.num_free_blocks} free"
            )
        if cached:
            bm.take_cached(seq, keys, cached)
        if bm.prefix_cache is not None:
            bm.prefix_cache.record_query(seq.num_prompt_tokens, len(keys), len(cached))
        bm.allocate(seq)
        seq.prefix_cached_tokens = len(cached) * bm.block_size  # the caller writes the KV after them
        seq.num_cached_tokens = seq.num_prompt_tokens
        seq.start_running()
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._finish(seq, reason)

    def abort(self, seq_id: int) -> Optional[Sequence]:
        """Finish a waiting or running sequence with reason "abort" and free its blocks."""
        for seq in list(self.waiting) + self.prefilling + self.running:
            if seq.seq_id == seq_id:
                self._finish(seq, FinishReason.ABORT)
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    # ---- scheduling --------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledBatch]:
        """A prefill batch if waiting sequences can start (and are not held back to be batched),
        else a decode batch of the running ones; None when there is nothing to run. SplitFuse:
        prefill chunks ride in decode steps instead (``_schedule_mixed``)."""
        if self._mixing():
            return self._schedule_mixed()
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        # Never None while sequences run: the oldest always fits (max_tokens is clipped to the
        # cache), so a held prefill cannot stall the engine.
        return self._schedule_decode()

    def _schedule_prefill(self) -> Optional[ScheduledBatch]:
        admitted = self._admissible()
        if not admitted or self._holds_prefill(len(admitted)):
            return None
        seqs = self._take_admitted(admitted)
        self.running.extend(seqs)
        self.decode_steps_since_prefill = 0
        return ScheduledBatch(seqs, is_prefill=True)

    def _take_admitted(self, admitted: list[_Admission]) -> list[Sequence]:
        """Shared, cached and new blocks for the admitted head of the queue; they leave it."""
        bm, bs = self.block_manager, self.block_manager.block_size
        # Every sequence takes its shared and cached blocks before any allocates new ones, so no
        # allocation evicts an idle cached block another admitted sequence is about to take.
        for a in admitted:
            seq = a.seq
            if a.shared:  # the parent's final prompt blocks: only the rest of the prompt is computed
                bm.share(seq, seq.share_parent, a.shared)
                seq.num_cached_tokens = seq.shared_prefix_tokens = a.shared * bs
            elif a.cached_blocks:
                bm.take_cached(seq, a.cached_keys, a.cached_blocks)
                seq.num_cached_tokens = len(a.cached_blocks) * bs
            if not seq.num_preemptions:  # a first admission: what usage and the hit rate report
                seq.prefix_cached_tokens = seq.num_cached_tokens
                if bm.prefix_cache is not None and not a.shared:  # an n > 1 sibling did not look it up
                    bm.prefix_cache.record_query(seq.num_prompt_tokens, len(a.cached_keys), len(a.cached_blocks))
            seq.share_parent = None  # decided: shared now or never (a recompute runs in full)
        seqs = []
        for a in admitted:
            # Room for the first decode's drafts too, so a fresh sequence is not preempted at once.
            bm.allocate(a.seq, self.config.num_lookahead_tokens)
            self.waiting.popleft()
            a.seq.start_running()
            seqs.append(a.seq)
        return seqs

    def _admissible(self, chunk_budget: Optional[int] = None) -> list[_Admission]:
        """The head of the queue that can start now, each with the parent blocks it will share
        or the cached blocks it will take (FCFS: the head blocks the rest, so a long prompt is
        never starved; a child whose parent's prefill has not run yet waits, and its parent is
        ahead of it); nothing is allocated. ``chunk_budget`` (SplitFuse): as many as start
        within that many prefill tokens this step, whatever their prompt lengths."""
        cfg, bm = self.config, self.block_manager
        free_seats = min(cfg.max_prefill_batch_size, cfg.max_batch_size - self.num_running)
        free_blocks = bm.num_free_blocks
        admitted: list[_Admission] = []
        taken: set[int] = set()  # idle cached blocks this batch takes
        tokens = 0
        for seq in self.waiting:
            if len(admitted) >= free_seats:
                break
            shared = self._shareable_blocks(seq)
            if shared is None:
                break
            keys, cached = ([], []) if shared else self._cached_prefix(seq)
            reused = shared + len(cached)
            # Tails after a shared or cached prefix attend cached KV, which makes the whole
            # forward a non-prefill one; fresh prompts keep the prefill kernels by going in
            # another batch.
            if chunk_budget is None and admitted and bool(reused) != bool(admitted[0].reused):
                break
            fed = seq.num_tokens - reused * bm.block_size
            if chunk_budget is not None:
                if tokens >= chunk_budget:
                    break
            # A prompt longer than maxPrefillTokens still runs, alone.
            elif admitted and tokens + fed > cfg.max_prefill_tokens:
                break
            revived = {b for b in cached if b not in taken and bm.is_idle(b)}
            need = bm.blocks_missing(seq, seq.num_tokens + cfg.num_lookahead_tokens) - reused + len(revived)
            if need > free_blocks:
                break
            free_blocks -= need
            taken |= revived
            admitted.append(_Admission(seq, shared, keys, cached))
            tokens += fed
        return admitted

    def _cached_prefix(self, seq: Sequence) -> tuple[list[bytes], list[int]]:
        """The prefix cache's blocks for ``seq``: whole blocks before its last token (fed for the
        next token's logits), none for a prompt whose prompt logprobs are asked for (every
        position must be computed). Block keys include the lookahead tokens after a block
        (prefix_cache.py), which keeps the MTP entries of positions paired with generated tokens
        out, as ``_shareable_blocks`` does."""
        if self.block_manager.prefix_cache is None or _wants_prompt_logprobs(seq):
            return [], []
        return self.block_manager.cached_prefix(seq, seq.num_tokens - 1)

    def _shareable_blocks(self, seq: Sequence) -> Optional[int]:
        """Blocks of ``seq.share_parent`` (same prompt) that ``seq`` can take instead of computing
        them; None: wait, the parent's prefill has not run yet. 0 (and the link dropped) when the
        parent is gone, or was preempted before sharing (its blocks were freed): a full prefill.

        Shared are the whole blocks before position n - 1 - lookahead (n prompt tokens): the last
        prompt token must be fed to get the first token's logits, and the MTP caches' entries of
        the last positions pair prompt positions with generated tokens (entry i of MTP module s
        holds token i + 1 + s, s < lookahead), which each sequence writes for itself. Every
        earlier entry, main and MTP, is a function of the prompt alone: the main model never
        writes it again, and an MTP catch-up that does writes what was there (drafts only)."""
        parent = seq.share_parent
        if parent is None:
            return 0
        if parent.status is SequenceStatus.WAITING and parent.num_preemptions == 0:
            return None  # not prefilled yet (it is ahead in the queue)
        bs = self.block_manager.block_size
        blocks = max(0, seq.num_prompt_tokens - 1 - self.config.num_lookahead_tokens) // bs
        if parent.status is SequenceStatus.RUNNING and parent.num_cached_tokens < blocks * bs:
            return None  # its prefill step is still in flight (async scheduling)
        if parent.status is not SequenceStatus.RUNNING or seq.num_output_tokens or blocks == 0:
            seq.share_parent = None
            return 0
        return blocks

    def _holds_prefill(self, num_admissible: int) -> bool:
        """Hold a small prefill back while others decode (see SchedulerConfig.waiting_served_ratio);
        never when nothing runs, and never longer than max_waiting_steps decode steps."""
        cfg = self.config
        return (bool(self.running) and self.decode_steps_since_prefill < cfg.max_waiting_steps
                and num_admissible < int(cfg.waiting_served_ratio * len(self.running)))

    # ---- SplitFuse -------------------------------------------------------------------------------
    def _mixing(self) -> bool:
        cfg = self.config
        return cfg.split_fuse and (bool(self.prefilling) or len(self.running) >= cfg.split_start_batch_size)

    def _schedule_mixed(self) -> Optional[ScheduledBatch]:
        """A decode step that also computes prefill chunks: every running sequence one row (no
        drafts this step), then chunks of the sequences being prefilled and of newly admitted
        ones, oldest first, within split_chunk_tokens rows. Without chunks to run, or while new
        prompts are held to be batched: a decode step as usual (with drafts)."""
        if not self.prefilling:
            admissible = self._admissible(self.config.split_chunk_tokens)
            # New prompts wait to be batched as whole prefills do (waiting_served_ratio): a mixed
            # step drafts nothing, so mixing one short prompt in at a time would cost speculation.
            if not admissible or self._holds_prefill(len(admissible)):
                return self._schedule_decode()
        decoding = self._grow_running(0)
        budget = self._chunk_budget(len(decoding))
        chunked = sum(c for _, c in self._plan_chunks(budget))
        self.prefilling.extend(self._take_admitted(self._admissible(budget - chunked)))
        plan = self._plan_chunks(budget)
        self.decode_steps_since_prefill = 0
        seqs = decoding + [seq for seq, _ in plan]
        if not seqs:
            return None
        return ScheduledBatch(seqs, is_prefill=False, chunks=[0] * len(decoding) + [c for _, c in plan])

    def _chunk_budget(self, num_decoding: int) -> int:
        """Prefill rows this step: what the decode rows leave of split_chunk_tokens, and never so
        few that a final chunk (lookahead + 1 rows) cannot run."""
        return max(self.config.split_chunk_tokens - num_decoding, self.config.num_lookahead_tokens + 2)

    def _plan_chunks(self, budget: int) -> list[tuple[Sequence, int]]:
        """This step's chunk of each sequence being prefilled, oldest first, within ``budget``
        rows. A sequence whose prompt logprobs are asked for is prefilled in one chunk (they are
        scored from one forward's hidden states); when nothing else runs it goes over budget."""
        plan, left = [], budget
        for seq in self.prefilling:
            whole = _wants_prompt_logprobs(seq)
            chunk = chunk_tokens(seq.num_tokens - seq.num_cached_tokens, left, self.config.num_lookahead_tokens, whole)
            if not chunk and whole and not plan:
                chunk = seq.num_tokens - seq.num_cached_tokens
            if chunk:
                plan.append((seq, chunk))
                left -= chunk
        return plan

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        """Every running sequence needs its table to cover num_tokens + num_lookahead_tokens
        positions: the newest token (not yet cached) plus the drafts. When blocks run out the most
        recently arrived sequence is preempted (recompute), possibly the one being served."""
        scheduled = self._grow_running(self.config.num_lookahead_tokens)
        if not scheduled:
            return None
        self.decode_steps_since_prefill += 1
        # A copy: finishing sequences leave self.running while the batch is still being read.
        return ScheduledBatch(list(scheduled), is_prefill=False)

    def _grow_running(self, lookahead: int) -> list[Sequence]:
        """Every running sequence's table covering its tokens plus ``lookahead``, preempting the
        newest arrivals when blocks run out; the sequences that stay, oldest first."""
        bm = self.block_manager
        # Oldest first, so the victims (popped from the end) are the newest arrivals, and a
        # re-admitted old sequence is not the first to go again.
        queue = self._by_arrival()
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
        return scheduled

    def schedule_ahead(self, pending: dict[int, int]) -> Optional[ScheduledBatch]:
        """Async scheduling: the next batch while a step is still running. ``pending`` maps each
        sequence in that step to the most tokens it can gain there. A prefill batch is scheduled
        as usual (it does not depend on the running step); a decode batch only when every running
        sequence can grow its table by its pending tokens plus the drafts without preempting
        anyone. Sequences that will surely finish in the running step (max_tokens) are left
        out. None means: wait for the running step, then schedule as usual (always, while
        SplitFuse has prompts to chunk: a mixed step is built after the step before it)."""
        if self.config.split_fuse and (self.prefilling or self.waiting):
            return None
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        bm, lookahead = self.block_manager, self.config.num_lookahead_tokens
        seqs = [s for s in self._by_arrival()
                if not (s.seq_id in pending and s.num_output_tokens + 1 >= s.max_tokens)]
        need = {s.seq_id: s.num_tokens + pending.get(s.seq_id, 0) + lookahead for s in seqs}
        if not seqs or sum(bm.blocks_missing(s, need[s.seq_id]) for s in seqs) > bm.num_free_blocks:
            return None
        for seq in seqs:
            bm.ensure(seq, need[seq.seq_id])
        self.decode_steps_since_prefill += 1
        return ScheduledBatch(seqs, is_prefill=False)

    def _by_arrival(self) -> list[Sequence]:
        return sorted(self.running, key=lambda q: (q.arrival_time, q.seq_id))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)  # also sets num_cached_tokens = 0: recomputed from its tokens
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- results -----------------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, new_tokens: list[list[int]], is_stop: StopCheck) -> list[SeqUpdate]:
        """Append each sequence's accepted tokens one by one, stopping at a finishing token
        (``is_stop`` returns a FinishReason, or max_tokens is reached: "length"). Finished
        sequences leave the running list and their blocks are freed at once."""
        if len(new_tokens) != len(batch.seqs):
            raise EngineError(f"{len(new_tokens)} token lists for a batch of {len(batch.seqs)} sequences")
        updates = []
        for b, (seq, tokens) in enumerate(zip(batch.seqs, new_tokens)):
            if seq.is_finished:  # aborted between schedule() and now: its tokens are dropped
                updates.append(SeqUpdate(seq, [], True))
                continue
            chunk = batch.chunks[b] if batch.is_mixed else 0
            prefill_done = batch.completes_prefill(b)
            if (batch.is_prefill or chunk) and len(tokens) > 1:
                # Only the last token is cached next step: more than one here would leave a hole.
                raise EngineError(f"sequence {seq.seq_id}: a prefill step yields one token, got {len(tokens)}")
            if chunk and not prefill_done:  # a chunk before the last: its KV, no token
                if tokens:
                    raise EngineError(f"sequence {seq.seq_id}: a prefill chunk before the last yields no token")
                seq.num_cached_tokens += chunk
                self._publish(seq)
                updates.append(SeqUpdate(seq, [], False))
                continue
            if chunk:  # its last chunk: it decodes from now on
                self.prefilling.remove(seq)
                self.running.append(seq)
            # KV now covers every token fed this step that was accepted (the last token and the
            # accepted drafts); the newest token is fed, and cached, next step.
            seq.num_cached_tokens = seq.num_tokens if prefill_done else seq.num_cached_tokens + len(tokens)
            if seq.max_tokens == 0:  # scored the prompt only: the prefill's token is dropped
                self._publish(seq, finished=True)
                self._finish(seq, FinishReason.LENGTH, leave_queues=False)
                updates.append(SeqUpdate(seq, [], True))
                continue
            appended = []
            for token in tokens:
                seq.append_token(token)
                appended.append(int(token))
                reason = is_stop(seq, token)
                if reason is None and seq.num_output_tokens >= seq.max_tokens:
                    reason = FinishReason.LENGTH
                if reason is not None:
                    self._publish(seq, finished=True)
                    self._finish(seq, FinishReason(reason), leave_queues=False)
                    break
            if not seq.is_finished:
                self._publish(seq)
            updates.append(SeqUpdate(seq, appended, seq.is_finished))
        self._drop_finished()
        return updates

    def _publish(self, seq: Sequence, finished: bool = False) -> None:
        if self.block_manager.prefix_cache is not None:
            self.block_manager.publish(seq, self.final_kv_tokens(seq, finished))

    def _finish(self, seq: Sequence, reason: FinishReason, leave_queues: bool = True) -> None:
        """``leave_queues=False``: the caller drops finished sequences from the running and
        prefilling lists itself, once for a whole batch (``_drop_finished``)."""
        queued = seq.status is SequenceStatus.WAITING  # only waiting sequences are in the queue
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if queued:
            self.waiting.remove(seq)
        elif leave_queues:
            self._drop_finished()
        self.block_manager.free(seq)

    def _drop_finished(self) -> None:
        """One pass over the running and prefilling lists: removing each finished sequence on its
        own scans the lists once per sequence, quadratic in the batch when a batch finishes."""
        self.running = [s for s in self.running if s.status is not SequenceStatus.FINISHED]
        self.prefilling = [s for s in self.prefilling if s.status is not SequenceStatus.FINISHED]
