"""Adaptive speculation: per decode step, how many drafts each sequence verifies (0: none),
from measured step time and each sequence's own acceptance.

Speculation pays when a step that verifies k+1 tokens per sequence costs less than the tokens it
yields. At batch 1 that holds easily (a step is dispatch- or bandwidth-bound, so k+1 tokens cost
little more than one); at large batches the step becomes compute-bound, every extra token costs
nearly as much as a real one, and rejected drafts are pure loss (users of vLLM and SGLang report
speculation turning into a slowdown there), while fewer drafts, whose acceptance is highest, may
still pay. And what pays for one request's text may not for another's. So the choice is
measured, per sequence, not assumed.

Step time (step_clock.py: a whole engine step, not just its forward) is measured per batch-size
bucket and per the step's draft count (the "arms": the most drafts any of its sequences
verifies, which is how far the step drafts), as the median of its recent steps; each arm is
timed a few times first, and the arms not chosen are re-tried now and then (a few steps in a
row, one arm at a time), so the estimate follows the context length as it changes. A try costs:
the tried arm is usually the slower one, its first steps find the caches holding the other arm's
weights, and a deeper arm first catches up the MTP entries its modules skipped. So the wait
between tries doubles after each try that moved nothing (its arm no faster than estimated by
DRIFT, the choice unchanged), up to REEXPLORE_MAX steps, and drops back to REEXPLORE_EVERY when
a try moves either (bandit exploration with backoff). Tokens per
step come from acceptance per draft position j, the share of drafts at j accepted when every
draft before it was: a step with k drafts yields
1 + sum_{j<=k} prod_{i<=j} alpha_i tokens. Each sequence has its own alpha (sequence_acceptance.py:
its decayed counts blended with a prior from the last finished sequences) and verifies the drafts
it reaches and keeps with probability >= ROW_YIELD; the step's arm maximises the batch's tokens
per second with each sequence verifying the fewer of those and the arm's; a sequence whose own
drafts do not pay retries one draft now and then (one held back only by a plain bucket waits for
the bucket's next try: a retry would catch its MTP caches up for nothing). Speculative steps that
catch up MTP cache entries skipped by plain steps inform acceptance but not their arm's step
time (counted there, they would make speculation look worse the longer it is off): what they
cost over a steady step of their arm is the plain steps' deferred work, so it is charged to the
plain arm, per entry caught up (a plain step skips one entry per sequence). Where a row costs
what its arithmetic does (compiled steps on a cpu: a catch-up of 32 entries costs ~7 plain
steps), a sequence that goes plain and retries pays that later, and plain steps only look
cheaper than drafting. In a plain bucket, though, the plugin catches up at most ``catch_up_cap``
entries when drafting resumes (the older ones are given up), so a run of plain steps until the
next try defers that many at most: the charge per plain step shrinks as tries grow rarer.

Every choice is lossless: a sequence verifying no drafts decodes plainly, and the MTP caches it
skipped are caught up by its next speculative step (decode_inputs: ``last_accepted`` counts the
entries still to write).
"""
from __future__ import annotations

import functools
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from .sequence_acceptance import AcceptancePrior, SequenceAcceptance, expected_tokens, reached_and_kept

MIN_SAMPLES = 3  # steps of each arm measured in a bucket before choosing by throughput
WINDOW = 16  # recent steps per arm that the estimate uses
REEXPLORE_EVERY = 64  # steps in a bucket between two tries of an arm not chosen, at first
REEXPLORE_MAX = 1024  # ... doubling after each try that moved nothing, up to this
REEXPLORE_BURST = 3  # steps per try: the first speculative one after plain steps catches up, unmeasured
DRIFT = 0.1  # a try whose steps' median is this much below its arm's estimate moved it
MARGIN = 0.03  # switch only when another arm is this much faster (no flip-flopping on noise)
DECAY = 0.98  # weight kept by past acceptance counts per speculative step (~50 steps remembered)
# A verification row is worth it when its draft is reached and kept with at least this probability.
# Once a step drafts, a row costs only its share of the verification: at batch 32 on 2 cores
# ~0.11 ms against 1.7 ms per sequence for a K=3 step that yields ~3 tokens (benchmarks/README.md,
# "Per-sequence speculation control"), so a row pays from ~0.2 tokens. At batch 1 the draft
# stages dominate, and the step's arm choice weighs them.
ROW_YIELD = 0.2


def batch_bucket(batch_size: int) -> int:
    """Smallest power of two >= batch_size."""
    return 1 << max(0, batch_size - 1).bit_length()


class Acceptance:
    """Per draft position, decayed counts of drafts verified and accepted when every draft
    before them was accepted: alpha_j = accepted_j / verified_j."""

    def __init__(self, max_k: int):
        self.verified = np.zeros(max_k)
        self.accepted = np.zeros(max_k)

    def record(self, counts: Union[int, Sequence[int]], accepted: Sequence[int]) -> None:
        """One step: counts[b] (or one k for all) drafts verified by sequence b, accepted[b] kept."""
        counts = np.broadcast_to(np.asarray(counts), (len(accepted),))
        self.record_positions(*reached_and_kept(counts, np.asarray(accepted), len(self.verified)))

    def record_positions(self, reached: np.ndarray, kept: np.ndarray) -> None:
        """One step from reached_and_kept's [B, K] masks."""
        self.verified = DECAY * self.verified + reached.sum(axis=0)
        self.accepted = DECAY * self.accepted + kept.sum(axis=0)

    def alpha(self, unknown: float = 0.0) -> np.ndarray:
        """[max_k] rates; ``unknown`` at positions never verified."""
        return np.divide(self.accepted, self.verified, out=np.full_like(self.verified, unknown),
                         where=self.verified > 0)

    def expected_tokens(self) -> np.ndarray:
        """[max_k + 1]: expected tokens per sequence from a step with k = 0..max_k drafts."""
        return expected_tokens(self.alpha())

    def tokens(self, k: int) -> float:
        return float(self.expected_tokens()[k])


@dataclass
class _Try:
    """A re-exploration burst: what it is judged against once over."""

    arm: int
    start: int  # the bucket's step count at its first step
    choice: int  # the bucket's choice when it began
    before: float  # the arm's median step time then
    sampled: int  # the arm's step times recorded then


@dataclass
class _Bucket:
    choice: int  # drafts per step now chosen
    seconds: dict[int, deque] = field(default_factory=dict)  # arm -> recent step times
    steps: int = 0
    timed_at: dict[int, int] = field(default_factory=dict)  # arm -> the step count when last timed
    # recent catch-ups' seconds over a steady step of their arm, per MTP entry caught up
    deferred: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    sampled: dict[int, int] = field(default_factory=dict)  # arm -> step times recorded, ever
    wait: int = REEXPLORE_EVERY  # steps from one try of an arm not chosen to the next
    next_try: int = REEXPLORE_EVERY  # the step count at which the next try begins
    tries: int = 0
    last_try: Optional[_Try] = None

    def add_seconds(self, k: int, seconds: float) -> None:
        self.seconds[k].append(seconds)
        self.sampled[k] = self.sampled.get(k, 0) + 1
        self.timed_at[k] = self.steps

    def judge_last_try(self) -> None:
        """The wait before the next try: doubled when the last one moved nothing, else reset."""
        t = self.last_try
        if t is None:
            return
        new = min(self.sampled.get(t.arm, 0) - t.sampled, len(self.seconds[t.arm]))
        moved = self.choice != t.choice
        if new > 0 and t.before > 0:  # an arm found slower than estimated will not be chosen either
            tried = statistics.median(list(self.seconds[t.arm])[-new:])
            moved = moved or tried < (1 - DRIFT) * t.before
        self.wait = REEXPLORE_EVERY if moved else min(2 * self.wait, REEXPLORE_MAX)

    def median_seconds(self, k: int) -> float:
        """A step slowed by something else on the machine (a noisy neighbour, a page fault, GC)
        moves a median little and a mean a lot."""
        s = self.seconds.get(k, ())
        return statistics.median(s) if s else 0.0

    def arm_seconds(self, k: int, batch_size: int, cap: Optional[int] = None) -> float:
        """A step's cost with k drafts: its median time, and for a plain step the catch-up it
        defers: one MTP entry per sequence, or, where plain steps catch up at most ``cap`` entries
        when drafting resumes (the older ones are given up), a share cap / wait of one, a run of
        plain steps lasting until the next try."""
        deferred = statistics.median(self.deferred) if k == 0 and self.deferred else 0.0
        share = 1.0 if cap is None else min(1.0, cap / self.wait)
        return self.median_seconds(k) + batch_size * deferred * share

    def caught_up(self, k: int, seconds: float, entries: int) -> None:
        """A step of arm k wrote ``entries`` MTP entries plain steps skipped: its time over the
        arm's steady step is what they deferred. An entry (a row of the draft stages) costs less
        than a whole step: a step that took longer (it waited for its shape's compile, the
        machine paused) counts as that."""
        steady = self.median_seconds(k)
        if entries > 0 and steady > 0:
            self.deferred.append(min(max(0.0, seconds - steady) / entries, steady))


class AdaptiveSpeculation:
    """Decides, per step, how many drafts each sequence of a batch verifies.

    ``arms``: the allowed draft counts per step, the largest the plugin's K (0 = a plain step)."""

    def __init__(self, arms: Sequence[int], enabled: bool = True, catch_up_cap: Optional[int] = None):
        """``catch_up_cap``: where steps of a plain bucket give up MTP entries older than this many
        (the plugin's CATCH_UP), what plain steps defer is bounded (``_Bucket.arm_seconds``)."""
        if not arms or min(arms) < 0:
            raise ValueError(f"adaptive speculation needs draft counts >= 0, got {list(arms)}")
        self.arms = sorted(set(arms), reverse=True)  # the most speculative first: explored first
        self.max_k = self.arms[0]
        self.enabled = enabled
        self.catch_up_cap = catch_up_cap
        self.buckets: dict[int, _Bucket] = {}
        self.acceptance = Acceptance(self.max_k)
        self.sequences: dict[int, SequenceAcceptance] = {}
        self.priors: dict[Optional[str], AcceptancePrior] = {}  # per kind of sequence (greedy, sampled)

    def reset(self) -> None:
        """Forget every measurement (warm-up steps on dummy prompts are no sample of serving)."""
        self.buckets.clear()
        self.acceptance = Acceptance(self.max_k)
        self.sequences.clear()
        self.priors.clear()

    def _bucket(self, batch_size: int) -> _Bucket:
        key = batch_bucket(batch_size)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(choice=self.max_k, seconds={k: deque(maxlen=WINDOW) for k in self.arms})
        return b

    def _sequence(self, seq_id: int, kind: Optional[str] = None) -> SequenceAcceptance:
        seq = self.sequences.get(seq_id)
        if seq is None:
            seq = self.sequences[seq_id] = SequenceAcceptance(self.max_k, kind)
        return seq

    def prior(self, kind: Optional[str] = None) -> AcceptancePrior:
        """The prior of sequences of this kind: greedy and sampled requests accept drafts at very
        different rates (this model: ~0.85 and ~0.35 at the first draft), so neither starts from
        the other's."""
        if kind not in self.priors:
            self.priors[kind] = AcceptancePrior(self.max_k)
        return self.priors[kind]

    def draft_counts(self, seq_ids: Sequence[int], kinds: Optional[Sequence[str]] = None) -> np.ndarray:
        """[B] drafts each sequence verifies this step; the step drafts as far as the most of them.

        Until each arm of the batch-size bucket is timed, and in the re-exploration bursts, every
        sequence gets the arm being timed. Otherwise sequence b would verify its first useful[b]
        drafts, those it reaches and keeps with probability >= ROW_YIELD by its own estimate (a
        row below that costs more than it yields), and the step drafts the arm k with the most
        tokens per second over the batch, sequence b verifying min(useful[b], k). A sequence
        with no useful draft retries one when due."""
        n = len(seq_ids)
        for seq_id, kind in zip(seq_ids, kinds or [None] * n):  # a new sequence starts from its kind's prior
            self._sequence(seq_id, kind)
        if not self.enabled or len(self.arms) == 1:
            return np.full(n, self.max_k, dtype=np.int64)
        b = self._bucket(n)
        b.steps += 1
        timing = self._timing_arm(b)
        if timing is not None:
            return np.full(n, timing, dtype=np.int64)
        seconds = np.array([b.arm_seconds(k, n, self.catch_up_cap) for k in self.arms])  # all > 0 once timed
        seqs, alpha = self._alphas(seq_ids, kinds)  # [B, K]
        tokens = expected_tokens(alpha)  # [B, K + 1]
        useful = (np.cumprod(alpha, axis=1) >= ROW_YIELD).sum(axis=1)  # [B] drafts worth a verification row
        rows = np.arange(len(seqs))
        # The step's arm: the most tokens per second over the batch, sequence b verifying
        # min(useful[b], k) of the k drafts.
        per_arm = {k: float(tokens[rows, np.minimum(useful, k)].sum()) / t for k, t in zip(self.arms, seconds)}
        best = max(self.arms, key=per_arm.get)
        if best != b.choice and per_arm[best] > per_arm[b.choice] * (1 + MARGIN):
            b.choice = best
        counts = self._floor_arm[np.minimum(useful, b.choice)]
        for seq, u in zip(seqs, useful.tolist()):
            seq.prefers_drafts = u > 0
        # Only a sequence whose own drafts do not pay retries: one held back by the step's arm
        # (a plain bucket) waits for the bucket's next try.
        retry = (useful == 0) & np.array([s.retry_due() for s in seqs])
        # Retries ride along in a step that drafts anyway (one row each); a step that would draft
        # nothing drafts for them only when half the batch is due (at a batch size where no drafts
        # pay, staggered retries would otherwise make every step draft).
        if retry.any() and (counts.max() > 0 or 2 * retry.sum() >= n):
            counts[retry] = min(a for a in self.arms if a)
        return counts

    def step_seconds(self, batch_size: int, k: int) -> float:
        """Median time of a step with k drafts at this batch size; 0.0 until measured."""
        b = self.buckets.get(batch_bucket(batch_size))
        return b.median_seconds(k) if b is not None and len(b.seconds.get(k, ())) >= MIN_SAMPLES else 0.0

    def expected(self, seq_ids: Sequence[int], kinds: Optional[Sequence[str]], counts: np.ndarray) -> np.ndarray:
        """[B] tokens a step yields for sequence b verifying counts[b] drafts, by its estimate."""
        _, alpha = self._alphas(seq_ids, kinds)
        return expected_tokens(alpha)[np.arange(len(seq_ids)), np.asarray(counts, dtype=np.int64)]

    def _alphas(self, seq_ids: Sequence[int], kinds: Optional[Sequence[str]]) -> tuple[list[SequenceAcceptance], np.ndarray]:
        """The sequences' states and their per-position acceptance estimates [B, K]."""
        fallback = self.acceptance.alpha(unknown=1.0)  # nothing measured: drafts pay until shown not to
        seqs = [self._sequence(s, k) for s, k in zip(seq_ids, kinds or [None] * len(seq_ids))]
        priors = {seq.kind: self.prior(seq.kind).alpha(fallback) for seq in seqs}
        return seqs, np.stack([s.alpha(priors[s.kind]) for s in seqs])

    @functools.cached_property
    def _floor_arm(self) -> np.ndarray:
        """[K + 1] per count, the largest arm not above it (the counts themselves when the arms
        are 0..K, as the plugin's are)."""
        return np.array([max(a for a in self.arms if a <= c) if min(self.arms) <= c else 0
                         for c in range(self.max_k + 1)], dtype=np.int64)

    def _timing_arm(self, b: _Bucket) -> Optional[int]:
        """The arm every sequence gets this step while arms are being timed, or None."""
        fewest = min(self.arms, key=lambda k: len(b.seconds[k]))  # ties: the most speculative
        if len(b.seconds[fewest]) < MIN_SAMPLES:
            return fewest  # explore, round robin over the arms
        t = b.last_try
        if t is not None and b.steps < t.start + REEXPLORE_BURST:
            return t.arm
        if b.steps < b.next_try:
            return None
        b.judge_last_try()
        b.next_try = b.steps + b.wait
        others = [k for k in self.arms if k != b.choice]
        arm = others[b.tries % len(others)]
        b.tries += 1
        # an arm the sequences' own counts timed lately needs no burst (at batch 1 they do,
        # requests whose drafts pay alternating with requests whose drafts do not)
        if b.steps - b.timed_at.get(arm, -REEXPLORE_EVERY) < REEXPLORE_EVERY:
            b.last_try = None
            return None
        b.last_try = _Try(arm, b.steps, b.choice, b.median_seconds(arm), b.sampled.get(arm, 0))
        return arm

    def planned(self, batch_size: int) -> int:
        """The draft count steps of this batch size currently get at most (K until measured; no
        side effects: a prefill asks this to decide which MTP caches its prompts need)."""
        b = self.buckets.get(batch_bucket(batch_size))
        return b.choice if self.enabled and b is not None else self.max_k

    def record(self, seq_ids: Sequence[int], counts: Sequence[int], accepted: Sequence[int],
               seconds: Optional[float], catch_up: Optional[tuple[float, int]] = None) -> None:
        """One finished step: the drafts each sequence verified and kept, and its wall time
        (None: a step that is no sample of its arm's cost). ``catch_up``: (its wall time, MTP
        entries written beyond a steady step's) for a step that caught MTP caches up. Disabled,
        it still keeps acceptance (``expected`` weighs MTP drafts against suffix drafts)."""
        counts, accepted = np.asarray(counts, dtype=np.int64), np.asarray(accepted, dtype=np.int64)
        k = int(counts.max()) if len(counts) else 0
        self.time_step(len(counts), k, seconds, catch_up)
        reached, kept = reached_and_kept(counts, accepted, self.max_k)  # [B, K] each, for the pool and each sequence
        if k > 0:
            self.acceptance.record_positions(reached, kept)
        for seq_id, r, a in zip(seq_ids, reached, kept):
            self._sequence(seq_id).record(r, a)

    def time_step(self, batch_size: int, k: int, seconds: Optional[float],
                  catch_up: Optional[tuple[float, int]] = None) -> None:
        """A step of ``batch_size`` sequences drafting k took ``seconds`` (None: no sample of its
        arm); ``catch_up`` as in ``record``. The plugin reports a step's time when the next step
        begins (step_clock.py), after its acceptance."""
        if not self.enabled or k not in self.arms:
            return
        b = self._bucket(batch_size)
        if seconds is not None and seconds > 0:
            b.add_seconds(k, seconds)
        if catch_up is not None:
            b.caught_up(k, *catch_up)

    def finish(self, seq_ids: Sequence[int]) -> None:
        """Sequences that ended: their acceptance joins the prior of the sequences to come."""
        for seq_id in seq_ids:
            seq = self.sequences.pop(seq_id, None)
            if seq is not None:
                self.prior(seq.kind).add(seq)

    def throughput(self, batch_size: int, k: int) -> float:
        """Expected tokens per sequence per second of a step with k drafts at this batch size
        (pooled acceptance)."""
        return self._rate(self.buckets[batch_bucket(batch_size)], k, self.acceptance.expected_tokens())

    @staticmethod
    def _rate(b: _Bucket, k: int, tokens: np.ndarray) -> float:
        seconds = b.median_seconds(k)
        return float(tokens[k]) / seconds if seconds > 0 else 0.0

    def summary(self) -> dict:
        """Per bucket: the step's draft count now chosen and each arm's tokens per sequence per
        second at the pooled acceptance."""
        tokens = self.acceptance.expected_tokens()
        return {
            bucket: {"k": b.choice, "tokens_per_s": {k: round(self._rate(b, k, tokens), 2) for k in self.arms}}
            for bucket, b in sorted(self.buckets.items())
        }
