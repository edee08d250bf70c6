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
verifies, which is how far the step drafts), as the median of its recent steps. An arm is timed
in runs: the first SETTLE steps after a switch find the caches holding the other arm's weights
and are no samples (timed cold, an arm tried in short bursts looks slower than the arm chosen,
which runs warm, and would never be chosen). Each arm is timed in one run first, and the arms not
chosen are re-tried now and then (a run each, one arm at a time), so the estimate follows the
context length as it changes. The choice compares arms by their times relative to one another,
measured where two runs meet (a try's first steps against the chosen arm's last ones before it,
and the chosen arm's first steps after it): medians taken at different moments differ by the
context grown in between and the machine's load, by more than the arms differ at batch 16 on a
cpu. A try costs (the tried arm is usually the slower one), so the wait
between tries doubles after each try that moved nothing (its arm no faster than estimated by
DRIFT, the choice unchanged), up to REEXPLORE_MAX steps, and drops back to REEXPLORE_EVERY when
a try moves either (bandit exploration with backoff).

Tokens per step come from acceptance per draft position j, the share of drafts at j accepted when
every draft before it was: a step with k drafts yields 1 + sum_{j<=k} prod_{i<=j} alpha_i tokens.
Each sequence has its own alpha (sequence_acceptance.py: its decayed counts blended with a prior
from the last finished sequences) and verifies the drafts it reaches and keeps with probability
>= ROW_YIELD; the step's arm maximises the batch's tokens per second with each sequence verifying
the fewer of those and the arm's; a sequence whose own drafts do not pay retries one draft now
and then (one held back only by a plain bucket waits for the bucket's next try). Speculative
steps that catch up MTP cache entries skipped by plain steps inform acceptance but not their
arm's step time (counted there, they would make speculation look worse the longer it is off).
Plain steps defer no such work when the bucket chose them: there, as for any module the chosen
count does not use, the plugin keeps only the entries a steady step writes (mtp_plugin:
``_entries_kept``), so the step that drafts again has a steady step's shape and cost.

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

from .sequence_acceptance import AcceptancePrior, SequenceAcceptance, expected_tokens, reached_and_kept, sequence_alphas

MIN_SAMPLES = 3  # steps of each arm measured in a bucket before choosing by throughput
# Steps of an arm's run in a bucket that are no samples of its time: the first steps after a
# switch find the caches holding the other arm's weights (compiled, batch 1, one AMD EPYC core: a
# plain step 1.44, 1.24, 1.11, 1.07 ms, then 1.01). Timed cold, an arm tried in short bursts looks
# slower than the arm chosen, which runs warm, and is never chosen.
SETTLE = 4
WINDOW = 16  # recent steps per arm that the estimate uses
NEIGHBOURS = 8  # sampled steps of two neighbouring runs (of two arms) that compare them
REEXPLORE_EVERY = 64  # steps in a bucket between two tries of an arm not chosen, at first
REEXPLORE_MAX = 1024  # ... doubling after each try that moved nothing, up to this
REEXPLORE_BURST = 3  # timed steps per try (after SETTLE untimed ones)
DRIFT = 0.1  # a try whose steps' median is this much below its arm's estimate moved it
# Steps a decision that every sequence decodes plainly holds for the same batch (tries keep their
# schedule): plain steps move no acceptance estimate, only the plain arm's median, and deciding
# costs ~0.1 ms of a ~1 ms plain step at batch 1 (compiled, cpu); a sequence whose own drafts do
# not pay retries one after at most RETRY_MAX (32) steps anyway.
PLAIN_HOLD = 32
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
    sampled: dict[int, int] = field(default_factory=dict)  # arm -> step times recorded, ever
    wait: int = REEXPLORE_EVERY  # steps from one try of an arm not chosen to the next
    next_try: int = REEXPLORE_EVERY  # the step count at which the next try begins
    tries: int = 0
    last_try: Optional[_Try] = None
    run_arm: int = -1  # the arm of the bucket's last step
    run_steps: int = 0  # steps of that arm in a row there
    _medians: dict[int, tuple[int, float]] = field(default_factory=dict)  # arm -> (sampled then, median)
    plain_batch: tuple = ()  # the sequences of the last decision that drafted nothing ...
    plain_until: int = 0  # ... and the step count until which it holds
    timed: bool = False  # every arm has been timed MIN_SAMPLES times
    # Step times relative to one another, from runs next to each other in time (arm -> its time
    # against a common base; compared_seconds), and the runs they come from.
    ratio: dict[int, float] = field(default_factory=dict)
    run_samples: list = field(default_factory=list)  # the current run's sampled times
    last_run: Optional[tuple[int, list]] = None  # (arm, sampled times) of the run before it

    def ran(self, k: int) -> bool:
        """A step of arm k ran; whether its time is a sample (its run has settled)."""
        if k != self.run_arm:
            self._run_ended()
        self.run_steps = self.run_steps + 1 if k == self.run_arm else 1
        self.run_arm = k
        return self.run_steps > SETTLE

    def add_seconds(self, k: int, seconds: float) -> None:
        self.seconds[k].append(seconds)
        self.sampled[k] = self.sampled.get(k, 0) + 1
        self.timed_at[k] = self.steps
        self.run_samples.append(seconds)
        if len(self.run_samples) > 2 * NEIGHBOURS:  # a run's first and last samples are all it compares
            del self.run_samples[NEIGHBOURS]

    def _run_ended(self) -> None:
        """The run of ``run_arm`` ended: its first sampled steps against the last ones of the run
        right before it (another arm's) give its time relative to that arm's, both measured at the
        same context lengths on the same machine state."""
        if not self.run_samples:
            self.last_run = None  # a run too short to sample: no neighbour for the next one
            return
        run, before = (self.run_arm, self.run_samples), self.last_run
        if before is not None:  # another arm's: a run ends where the arm changes
            if not self.ratio:
                self.ratio[before[0]] = 1.0
            base = self.ratio.get(before[0])
            if base is not None:
                self.ratio[run[0]] = base * statistics.median(run[1][:NEIGHBOURS]) / statistics.median(before[1][-NEIGHBOURS:])
        self.last_run, self.run_samples = run, []

    def compared_seconds(self, arms: Sequence[int]) -> np.ndarray:
        """[A] the arms' step times in the units the choice compares them in: relative to one
        another as they last ran next to each other, once every arm has such a ratio; else
        their medians. Arms timed at different moments are not comparable: within a request
        the context grows (64 -> 192 tokens on the benchmarks' prompts) and a noisy neighbour
        comes and goes, and their medians drift by more than the arms differ at batch 16 on a
        cpu; the arm chosen runs for hundreds of steps, an arm tried for a few."""
        if all(k in self.ratio for k in arms):
            return np.array([self.ratio[k] for k in arms])
        return np.array([self.median_seconds(k) for k in arms])

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
        sampled = self.sampled.get(k, 0)
        cached = self._medians.get(k)
        if cached is None or cached[0] != sampled:  # a step asks for every arm's: recomputed once per sample
            s = self.seconds.get(k, ())
            cached = self._medians[k] = (sampled, statistics.median(s) if s else 0.0)
        return cached[1]


class AdaptiveSpeculation:
    """Decides, per step, how many drafts each sequence of a batch verifies.

    ``arms``: the allowed draft counts per step, the largest the plugin's K (0 = a plain step)."""

    def __init__(self, arms: Sequence[int], enabled: bool = True):
        if not arms or min(arms) < 0:
            raise ValueError(f"adaptive speculation needs draft counts >= 0, got {list(arms)}")
        self.arms = sorted(set(arms), reverse=True)  # the most speculative first: explored first
        self.max_k = self.arms[0]
        self.enabled = enabled
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
        with no useful draft retries one when due. A decision that drafts nothing holds for the
        same sequences PLAIN_HOLD steps."""
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
        if b.steps < b.plain_until and b.plain_batch == tuple(seq_ids):
            return np.zeros(n, dtype=np.int64)
        seconds = b.compared_seconds(self.arms)  # [A] all > 0 once timed
        seqs, alpha = self._alphas(seq_ids, kinds)  # [B, K]
        reach = np.cumprod(alpha, axis=1)  # [B, K] chance that draft j is reached and kept
        useful = (reach >= ROW_YIELD).sum(axis=1)  # [B] drafts worth a verification row
        tokens = expected_tokens(alpha, reach)  # [B, K + 1]
        # The step's arm: the most tokens per second over the batch, sequence b verifying
        # min(useful[b], k) of the k drafts.
        verified = np.minimum(useful[:, None], self._arm_counts[None, :])  # [B, A]
        per_arm = tokens[np.arange(n)[:, None], verified].sum(axis=0) / seconds  # [A]
        best, now = int(per_arm.argmax()), self.arms.index(b.choice)  # ties: the most speculative
        if best != now and per_arm[best] > per_arm[now] * (1 + MARGIN):
            b.choice = self.arms[best]
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
        if not counts.any():
            b.plain_batch, b.plain_until = tuple(seq_ids), b.steps + PLAIN_HOLD
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
        priors = {kind: self.prior(kind).alpha(fallback) for kind in {seq.kind for seq in seqs}}
        prior = next(iter(priors.values())) if len(priors) == 1 else np.stack([priors[s.kind] for s in seqs])
        return seqs, sequence_alphas(seqs, prior)

    @functools.cached_property
    def _arm_counts(self) -> np.ndarray:
        """[A] the arms as an array, in ``arms``' order."""
        return np.array(self.arms, dtype=np.int64)

    @functools.cached_property
    def _floor_arm(self) -> np.ndarray:
        """[K + 1] per count, the largest arm not above it (the counts themselves when the arms
        are 0..K, as the plugin's are)."""
        return np.array([max(a for a in self.arms if a <= c) if min(self.arms) <= c else 0
                         for c in range(self.max_k + 1)], dtype=np.int64)

    def _timing_arm(self, b: _Bucket) -> Optional[int]:
        """The arm every sequence gets this step while arms are being timed, or None."""
        if not b.timed:  # every arm has MIN_SAMPLES for good once (windows only grow)
            fewest = min(self.arms, key=lambda k: len(b.seconds[k]))  # ties: the most speculative
            if len(b.seconds[fewest]) < MIN_SAMPLES:  # explore: one run per arm, the most speculative first
                running = b.run_arm in b.seconds and len(b.seconds[b.run_arm]) < MIN_SAMPLES
                return b.run_arm if running else fewest
            b.timed = True
        t = b.last_try
        if t is not None and b.steps < t.start + SETTLE + REEXPLORE_BURST:
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

    def record(self, seq_ids: Sequence[int], counts: Sequence[int], accepted: Sequence[int]) -> None:
        """One finished step: the drafts each sequence verified and kept (its time comes later:
        ``time_step``). Disabled, it still keeps acceptance (``expected`` weighs MTP drafts
        against suffix drafts)."""
        counts, accepted = np.asarray(counts, dtype=np.int64), np.asarray(accepted, dtype=np.int64)
        if not counts.any():  # a plain step: no position reached
            for seq_id in seq_ids:
                self._sequence(seq_id).plain_step()
            return
        reached, kept = reached_and_kept(counts, accepted, self.max_k)  # [B, K] each, for the pool and each sequence
        self.acceptance.record_positions(reached, kept)
        for seq_id, r, a in zip(seq_ids, reached, kept):
            self._sequence(seq_id).record(r, a)

    def time_step(self, batch_size: int, k: int, seconds: Optional[float]) -> None:
        """A step of ``batch_size`` sequences drafting k took ``seconds`` (None: no sample of its
        arm). Once per step; the plugin reports a step's time when the next step
        begins (step_clock.py), after its acceptance."""
        if not self.enabled or k not in self.arms:
            return
        b = self._bucket(batch_size)
        if b.ran(k) and seconds is not None and seconds > 0:
            b.add_seconds(k, seconds)

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
