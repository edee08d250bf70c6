"""Verification rules on hand-built drafts, targets and probabilities."""
import numpy as np
import torch

from mindspec.plugins.mtp import decoding_policy as policy


def _probs(rows):
    """rows: per (seq, position) a dict token -> prob over a vocab of 6."""
    out = torch.zeros(len(rows), len(rows[0]), 6, dtype=torch.float64)
    for b, seq in enumerate(rows):
        for j, dist in enumerate(seq):
            for tok, p in dist.items():
                out[b, j, tok] = p
    return out


def test_strict_accepts_longest_matching_prefix_per_sequence():
    drafts = np.array([[1, 2, 3], [1, 9, 3], [7, 2, 3], [1, 2, 3]])
    targets = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 4]])
    accepted = policy.strict_accept(drafts, targets)
    assert accepted.tolist() == [3, 1, 0, 2]
    assert policy.emitted_tokens(drafts, targets, accepted) == [[1, 2, 3, 4], [1, 2], [1], [1, 2, 5]]


# Two sequences, K = 2. Position 0: top-1 is 0 (0.5), then 1 (0.3), then 2 (0.2).
PROBS = _probs([
    [{0: 0.5, 1: 0.3, 2: 0.2}, {3: 0.6, 4: 0.4}, {5: 1.0}],
    [{0: 0.5, 1: 0.3, 2: 0.2}, {3: 0.6, 4: 0.4}, {5: 1.0}],
])
TARGETS = np.array([[0, 3, 5], [0, 3, 5]])


def test_relaxed_accepts_near_top_candidates_inside_the_think_span():
    drafts = np.array([[1, 4], [1, 4]])
    # delta 0.25: threshold 0.25 at position 0 admits token 1 (0.3) but not 2 (0.2); position 1
    # threshold 0.35 admits 4 (0.4). Sequence 1 is outside the thinking span: strict.
    accepted = policy.relaxed_accept(drafts, TARGETS, PROBS, top_n=3, delta=np.array([0.25, 0.0]))
    assert accepted.tolist() == [2, 0]
    # top_n limits the candidates: with N = 1 only the top-1 is eligible.
    assert policy.relaxed_accept(drafts, TARGETS, PROBS, top_n=1, delta=np.array([0.25, 0.25])).tolist() == [0, 0]
    # the bonus token is the target at the first rejected row
    assert policy.emitted_tokens(drafts, TARGETS, accepted) == [[1, 4, 5], [0]]


def test_relaxed_with_delta_zero_is_strict():
    rng = np.random.default_rng(0)
    probs = torch.softmax(torch.randn(64, 4, 6, dtype=torch.float64), -1)
    targets = probs.argmax(-1).numpy()
    drafts = np.where(rng.random((64, 3)) < 0.6, targets[:, :3], rng.integers(0, 6, (64, 3)))
    relaxed = policy.relaxed_accept(drafts, targets, probs, top_n=4, delta=np.zeros(64))
    assert (relaxed == policy.strict_accept(drafts, targets)).all()


def test_relaxed_rejects_below_threshold_candidates():
    drafts = np.array([[2, 3], [2, 3]])  # token 2 has 0.2 < 0.5 - 0.25
    assert policy.relaxed_accept(drafts, TARGETS, PROBS, 3, np.array([0.25, 0.25])).tolist() == [0, 0]


def test_typical_acceptance_threshold():
    # Position 0 entropy of (0.5, 0.3, 0.2) = 1.0297; alpha * exp(-H) = 0.3 * 0.357 = 0.107 < eps 0.25
    # so any draft with p > 0.107 passes: token 2 (0.2) is accepted, token 5 (0) is not.
    drafts = np.array([[2, 4], [5, 3]])
    accepted = policy.typical_accept(drafts, TARGETS, PROBS, posterior_threshold=0.25, posterior_alpha=0.3)
    assert accepted.tolist() == [2, 0]
    # A strict threshold (epsilon tiny, alpha large) keeps only high-probability drafts.
    assert policy.typical_accept(drafts, TARGETS, PROBS, 0.25, 10.0).tolist() == [0, 0]


def test_think_span_follows_the_last_marker():
    state = policy.update_think_state(np.array([False, True, False]), [[5, 100, 7], [101, 8], [9]], 100, 101)
    assert state.tolist() == [True, False, False]
    state = policy.update_think_state(np.array([True]), [[100, 3, 101, 4, 100]], 100, 101)
    assert state.tolist() == [True]


def test_simulated_acceptance_accepts_each_position_at_its_rate():
    rates = np.array([0.88, 0.77, 0.71])
    counts = policy.simulated_accept(rates, np.random.default_rng(7), 200_000)
    assert counts.min() >= 0 and counts.max() <= 3
    share = np.array([(counts >= j).mean() for j in (1, 2, 3)])
    np.testing.assert_allclose(share, rates, atol=0.005)  # draft j accepted in rates[j-1] of the steps
    assert policy.simulated_accept(np.array([1.0, 1.0]), np.random.default_rng(0), 5).tolist() == [2] * 5
    assert policy.simulated_accept(np.array([0.0]), np.random.default_rng(0), 5).tolist() == [0] * 5


def test_tree_paths_longest_passing_path_first_in_row_order():
    from mindspec.plugins.mtp.decoding_policy import tree_paths

    #            root
    #        1         2
    #      3   4       5
    #      6           7
    #                  8
    parents = np.array([[-1, 0, 0, 1, 1, 2, 3, 5, 7]] * 4)
    ok = np.array([
        [1, 1, 1, 0, 1, 1, 1, 1],  # 2-5-7-8 is the longest passing path
        [1, 0, 1, 1, 1, 1, 0, 0],  # 1-3-6 and 1-4: the longer (5 passes, its parent 2 does not)
        [0, 0, 1, 1, 1, 1, 1, 1],  # nothing at depth 1 passes: no path
        [1, 1, 1, 1, 0, 0, 0, 0],  # 1-3 and 1-4 tie: the first in row order
    ], dtype=bool)
    assert tree_paths(parents, ok) == [[2, 5, 7, 8], [1, 3, 6], [], [1, 3]]
