"""A sequence's tokens as a suffix automaton, built one token at a time, for drafting: the
longest suffix of the tokens so far that also occurs earlier, and what followed that earlier
occurrence.

A suffix automaton (Blumer et al.; the online construction in Crochemore & Hancart's "Automata
for matching patterns") has at most 2n states for n tokens and is extended in amortised O(1) per
token. Each state is a set of substrings with the same end positions; ``length`` is the longest,
``link`` the state of its longest suffix with more end positions. The state of the whole string
is ``last``; ``link[last]`` is then the longest suffix that also ends somewhere earlier, and
``first_end`` (the end of its first occurrence, fixed when a state is made and copied to clones)
says where. That is prompt-lookup / n-gram drafting (vLLM's n-gram proposer, SuffixDecoding's
per-request tree) without rescanning the sequence each step.
"""
from __future__ import annotations


class SuffixAutomaton:
    def __init__(self):
        self.length = [0]  # [state] longest substring in the state
        self.link = [-1]  # [state] suffix link
        self.first_end = [-1]  # [state] end index (inclusive) of the first occurrence
        self.next: list[dict[int, int]] = [{}]  # [state] transitions by token
        self.last = 0  # the state of the whole string
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self._add(int(t))

    def _new_state(self, length: int, link: int, first_end: int, transitions: dict[int, int]) -> int:
        self.length.append(length)
        self.link.append(link)
        self.first_end.append(first_end)
        self.next.append(transitions)
        return len(self.length) - 1

    def _add(self, t: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(t)
        cur = self._new_state(self.length[self.last] + 1, -1, pos, {})
        p = self.last
        while p != -1 and t not in self.next[p]:
            self.next[p][t] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][t]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:  # split q: a clone keeps the shorter strings, which now also end at pos
                clone = self._new_state(self.length[p] + 1, self.link[q], self.first_end[q], dict(self.next[q]))
                while p != -1 and self.next[p].get(t) == q:
                    self.next[p][t] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def match(self) -> tuple[int, int]:
        """(length, first_end): the longest suffix that also occurs ending before the last token,
        and where its first occurrence ends; (0, -1) when no token repeats."""
        state = self.link[self.last] if self.tokens else -1
        if state <= 0:
            return 0, -1
        return self.length[state], self.first_end[state]

    def draft(self, max_tokens: int, min_match: int) -> list[int]:
        """``max_tokens`` tokens that followed the first earlier occurrence of the longest
        repeated suffix, if that suffix has at least ``min_match`` tokens. Where that
        continuation reaches the end of the sequence, it goes on with the drafted tokens
        themselves: the match says the text repeats with period p = n - 1 - first_end, so
        draft j is the token p before it (a loop such as ``#\n#\n`` drafts in full)."""
        length, end = self.match()
        if length < min_match:
            return []
        period = self.tokens[end + 1 :]
        return [period[j % len(period)] for j in range(max_tokens)]
