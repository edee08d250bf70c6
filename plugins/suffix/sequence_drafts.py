"""Suffix drafts per sequence: one suffix automaton each, brought up to the sequence's tokens
before every draft, and (for choosing between drafters) the share of its suffix drafts kept.

Used by the suffix plugin alone and by the MTP plugin's ``suffix_drafting``, which verifies a
sequence's suffix drafts instead of its MTP drafts when they promise more tokens
(``SuffixDrafts.expected``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .suffix_automaton import SuffixAutomaton

# A sequence's suffix acceptance starts at PRIOR_RATE with PRIOR_WEIGHT pseudo-drafts and follows
# its own drafts (verified, or scored against the tokens a step emitted), each step's counts
# decayed by DECAY. A repeated suffix of >= min_match tokens usually continues as before in text
# that copies its prompt (code edits, quotes), and rarely in free text; a few steps tell which.
PRIOR_RATE = 0.7
PRIOR_WEIGHT = 2.0
DECAY = 0.9


def matched_prefix(drafts, tokens) -> int:
    """How many leading drafts equal the tokens at their positions."""
    n, limit = 0, min(len(drafts), len(tokens))
    while n < limit and drafts[n] == tokens[n]:
        n += 1
    return n


@dataclass
class _Sequence:
    automaton: SuffixAutomaton = field(default_factory=SuffixAutomaton)
    reached: float = 0.0  # decayed suffix drafts verified with every draft before them kept
    kept: float = 0.0  # ... and kept

    def rate(self) -> float:
        """P(a suffix draft is kept | every draft before it was): geometric per position."""
        return (self.kept + PRIOR_RATE * PRIOR_WEIGHT) / (self.reached + PRIOR_WEIGHT)


class SuffixDrafts:
    def __init__(self, max_drafts: int, min_match: int):
        self.max_drafts = max_drafts
        self.min_match = min_match
        self.sequences: dict[int, _Sequence] = {}

    def draft(self, seq) -> list[int]:
        """Up to max_drafts tokens: what followed the first earlier occurrence of the longest
        suffix of the sequence that repeats, when that suffix has >= min_match tokens."""
        automaton = self._sequence(seq.seq_id).automaton
        prompt = seq.prompt_token_ids  # the new tokens only, not seq.token_ids' copy of the whole sequence
        if len(automaton) < len(prompt):
            automaton.extend(prompt[len(automaton):])
        automaton.extend(seq.output_token_ids[len(automaton) - len(prompt):])
        return automaton.draft(self.max_drafts, self.min_match)

    def useful(self, seq_id: int, drafts: list[int], row_yield: float) -> int:
        """How many of ``drafts`` are worth a verification row: those reached and kept with
        probability >= row_yield."""
        rate = self._sequence(seq_id).rate()
        n = 0
        while n < len(drafts) and rate ** (n + 1) >= row_yield:
            n += 1
        return n

    def expected(self, seq_id: int, count: int) -> float:
        """Tokens a step yields when the sequence verifies ``count`` suffix drafts (the bonus
        token included)."""
        rate = self._sequence(seq_id).rate()
        return 1.0 + sum(rate ** j for j in range(1, count + 1))

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        """A step in which the sequence verified ``verified`` suffix drafts and kept ``accepted``."""
        seq = self._sequence(seq_id)
        reached = min(verified, accepted + 1)
        seq.reached = DECAY * seq.reached + reached
        seq.kept = DECAY * seq.kept + accepted

    def clear(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.sequences.pop(seq_id, None)

    def _sequence(self, seq_id: int) -> _Sequence:
        seq = self.sequences.get(seq_id)
        if seq is None:
            seq = self.sequences[seq_id] = _Sequence()
        return seq
