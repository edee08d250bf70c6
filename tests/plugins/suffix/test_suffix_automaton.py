"""The suffix automaton against a brute-force search: after every appended token, the longest
suffix that also occurs ending earlier, and where its first occurrence ends."""
import numpy as np
import pytest

from mindspec.plugins.suffix.suffix_automaton import SuffixAutomaton


def brute_match(s: list[int]) -> tuple[int, int]:
    n = len(s)
    for length in range(n - 1, 0, -1):
        suffix = s[n - length:]
        for end in range(length - 1, n - 1):  # occurrences ending before the last token
            if s[end - length + 1 : end + 1] == suffix:
                return length, end
    return 0, -1


@pytest.mark.parametrize("alphabet,n,seed", [(2, 60, 0), (3, 80, 1), (5, 120, 2), (50, 150, 3)])
def test_matches_equal_a_brute_force_search_after_every_token(alphabet, n, seed):
    tokens = np.random.default_rng(seed).integers(0, alphabet, n).tolist()
    automaton = SuffixAutomaton()
    for i, t in enumerate(tokens):
        automaton.extend([t])
        assert automaton.match() == brute_match(tokens[: i + 1]), f"after {i + 1} tokens"
    assert len(automaton.length) <= 2 * n  # at most 2n states


def test_draft_is_what_followed_the_first_occurrence():
    automaton = SuffixAutomaton()
    automaton.extend([7, 1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert automaton.match() == (3, 3)  # "1 2 3" first ends at index 3
    assert automaton.draft(4, min_match=3) == [4, 5, 9, 1]
    assert automaton.draft(2, min_match=3) == [4, 5]
    assert automaton.draft(8, min_match=3) == [4, 5, 9, 1, 2, 3, 4, 5]  # past the end: the drafts repeat
    assert automaton.draft(4, min_match=4) == []  # the repeat is shorter than asked
    automaton.extend([8])
    assert automaton.match() == (0, -1) and automaton.draft(4, 1) == []
    assert SuffixAutomaton().draft(4, 1) == []


def test_a_loop_drafts_in_full():
    automaton = SuffixAutomaton()
    automaton.extend([9, 1, 2, 1, 2, 1, 2])
    assert automaton.match() == (4, 4)  # "1 2 1 2" first ends at index 4: the text repeats with period 2
    assert automaton.draft(5, min_match=2) == [1, 2, 1, 2, 1]
