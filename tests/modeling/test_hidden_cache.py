"""Greedy acceptance and the hidden cache's write inside a step (modeling/hidden_cache.py), against
the host's: decoding_policy.strict_accept and HiddenHistory.write, greedy and sampled (targets
sampled inside, sampling/step_targets.py)."""
import numpy as np
import pytest
import torch

from mindspec.backend import IndexedRows
from mindspec.modeling.hidden_cache import DeviceHiddenCache, HiddenCacheRows, accept_and_keep, device_rows, \
    speculative_step
from mindspec.modeling.forward_metadata import token_positions
from mindspec.plugins.mtp.decoding_policy import strict_accept
from mindspec.plugins.mtp.decode_inputs import verify_grid
from mindspec.plugins.mtp.hidden_history import HiddenHistory
from mindspec.text_generator.sampling import Sampler, SamplingMetadata, SamplingParams
from mindspec.text_generator.sampling.step_targets import TargetRows, sample_targets

HIDDEN, VOCAB, K = 6, 5, 3


def _case(seed: int, counts: list[int]):
    """Logits whose argmax often equals the drafts (so every accepted count occurs), per sequence
    its own number of verification rows (counts[b] + 1, ragged)."""
    rng = np.random.default_rng(seed)
    counts = np.array(counts, dtype=np.int64)
    rows = int((counts + 1).sum())
    drafts = rng.integers(0, VOCAB, (len(counts), K))
    logits = torch.from_numpy(rng.normal(size=(rows, VOCAB)).astype(np.float32))
    starts = np.cumsum(counts + 1) - (counts + 1)
    for b, (s, c) in enumerate(zip(starts, counts)):
        for j in range(c):
            if rng.random() < 0.7:  # the target agrees with draft j + 1
                logits[s + j, drafts[b, j]] += 10
    hidden = torch.from_numpy(rng.normal(size=(rows, HIDDEN)).astype(np.float32))
    return counts, starts, torch.from_numpy(drafts), logits, hidden


@pytest.mark.parametrize("seed", range(6))
def test_accepts_and_keeps_what_the_host_would(seed):
    counts, starts, drafts, logits, hidden = _case(seed, [3, 0, 2, 1, 3])
    keep = 4 + K
    host, step = HiddenHistory(keep), HiddenHistory(keep)
    slots = np.array([host.add(b, hidden) for b in range(len(counts))], dtype=np.int64)
    [step.add(b, hidden) for b in range(len(counts))]
    ends = np.array([5, 0, 9, 2, 13], dtype=np.int64)  # hidden_end: the position of each first row
    before = torch.randn_like(host.buf)
    before[0] = 0
    host.buf.copy_(before)
    step.buf.copy_(before)

    # the host: argmax, strict acceptance over the verify grid, the history's write
    targets = logits.argmax(dim=-1).numpy()
    want = np.minimum(strict_accept(drafts.numpy(), targets[verify_grid(counts, K)]), counts)
    host.write(slots, ends, want + 1, hidden, starts)

    keep_rows = step.rows(slots[:, None], ends[:, None] + np.arange(K + 1))
    got_targets, _, got = accept_and_keep(step.buf, logits, hidden, drafts, torch.from_numpy(starts),
                                       torch.from_numpy(counts), torch.from_numpy(keep_rows))
    np.testing.assert_array_equal(got_targets.numpy(), targets)
    np.testing.assert_array_equal(got.numpy(), want)
    assert torch.equal(step.buf, host.buf)  # the kept rows, nothing else; row 0 still zero
    assert not step.buf[0].any()


def test_no_keep_rows_keep_nothing():
    counts, starts, drafts, logits, hidden = _case(1, [2, 3])
    buf = torch.randn(9, HIDDEN)
    buf[0] = 0
    before = buf.clone()
    _, _, accepted = accept_and_keep(buf, logits, hidden, drafts, torch.from_numpy(starts), torch.from_numpy(counts),
                                  torch.zeros(2, K + 1, dtype=torch.int64))
    assert torch.equal(buf, before) and (accepted <= torch.from_numpy(counts)).all()


def test_padding_sequences_keep_nothing_and_accept_nothing():
    """A bucket's padding sequences verify 0 drafts and have no keep rows: row 0 stays zero
    whatever their hidden states hold."""
    counts, starts, drafts, logits, hidden = _case(2, [3, 0, 0])
    buf = torch.zeros(20, HIDDEN)
    keep = torch.tensor([[4, 5, 6, 7], [0, 0, 0, 0], [0, 0, 0, 0]])
    _, _, accepted = accept_and_keep(buf, logits, hidden * 0 + 7, drafts, torch.from_numpy(starts),
                                  torch.from_numpy(counts), keep)
    assert accepted[1:].tolist() == [0, 0] and not buf[0].any()
    assert (buf[4 : 5 + int(accepted[0])] == 7).all() and not buf[5 + int(accepted[0]) :].any()


def test_a_step_reads_its_first_hidden_states_from_the_cache():
    buf = torch.arange(6.0 * HIDDEN).view(6, HIDDEN)
    buf[0] = 0
    counts, starts, drafts, logits, hidden = _case(3, [1, 2])
    rows = HiddenCacheRows(buf, np.array([3, 0, 5]), counts, np.zeros((2, K + 1), dtype=np.int64))
    cache = DeviceHiddenCache.of(buf, [torch.from_numpy(a) for a in device_rows(rows, starts)])
    seen = []

    class _Out:
        def __init__(self):
            self.logits, self.hidden_states, self.draft_tokens = logits, hidden, drafts
            self.greedy_tokens = self.accepted_drafts = None

    out = speculative_step(lambda h: seen.append(h) or _Out(), cache)
    assert isinstance(seen[0], IndexedRows)  # gathered where the first draft stage reads them
    assert torch.equal(seen[0].materialize(), buf[[3, 0, 5]]) and torch.equal(rows.gathered(), buf[[3, 0, 5]])
    assert torch.equal(out.greedy_tokens, logits.argmax(dim=-1)) and out.accepted_drafts.shape == (2,)


def test_compiled_acceptance_equals_eager():
    counts, starts, drafts, logits, hidden = _case(4, [3, 1, 2, 0])
    keep_rows = torch.arange(1, 1 + len(counts) * (K + 1)).view(len(counts), K + 1)
    args = (logits, hidden, drafts, torch.from_numpy(starts), torch.from_numpy(counts), keep_rows)
    eager_buf, compiled_buf = torch.zeros(32, HIDDEN), torch.zeros(32, HIDDEN)
    want = accept_and_keep(eager_buf, *args)
    got = torch.compile(accept_and_keep, fullgraph=True)(compiled_buf, *args)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(compiled_buf, eager_buf)


def _sampled_case(seed: int, counts: list[int], scale: float):
    """A step's verification rows where every sequence samples (seeded, or not), each row at its
    sequence's next output positions, and drafts that often equal the sampled targets."""
    rng = np.random.default_rng(seed)
    counts = np.array(counts, dtype=np.int64)
    rows = int((counts + 1).sum())
    vocab = 300
    logits = torch.from_numpy(rng.normal(size=(rows, vocab)).astype(np.float32)) * scale
    seqs = [SamplingParams(temperature=0.8, top_p=0.9, seed=None if b % 3 == 2 else 10 + b) for b in range(len(counts))]
    row_seq, row_offset = token_positions(np.zeros_like(counts), counts + 1)
    params = [seqs[b] for b in row_seq]
    positions = (5 + row_offset).tolist()
    targets = TargetRows.build(params, positions, vocab, lambda: 99)
    md = SamplingMetadata.build(params, None, None, positions, vocab, "cpu")
    sampler = Sampler()
    sampler.step_key = lambda: 99
    host_targets = sampler(logits, md).token_ids.numpy()
    drafts = rng.integers(0, vocab, (len(counts), K))
    starts = np.cumsum(counts + 1) - (counts + 1)
    for b, (s, c) in enumerate(zip(starts, counts)):
        for j in range(c):
            if rng.random() < 0.7:
                drafts[b, j] = host_targets[s + j]
    hidden = torch.from_numpy(rng.normal(size=(rows, HIDDEN)).astype(np.float32))
    return counts, starts, torch.from_numpy(drafts), logits, hidden, targets, host_targets


@pytest.mark.parametrize("seed, scale, whole_rows", [(0, 6.0, False), (1, 6.0, False), (2, 6.0, False), (3, 6.0, False),
                                                      (4, 0.05, True), (5, 6.0, True)])
def test_sampled_acceptance_keeps_what_the_host_would(seed, scale, whole_rows):
    """Every sequence samples: the step's targets are the host sampler's, and so are the
    accepted counts and the kept rows; flat rows (top-p sets past the 256 largest logits) too
    where the step may do their whole rows."""
    counts, starts, drafts, logits, hidden, targets, host_targets = _sampled_case(seed, [3, 0, 2, 1, 3], scale)
    host, step = HiddenHistory(4 + K), HiddenHistory(4 + K)
    slots = np.array([host.add(b, hidden) for b in range(len(counts))], dtype=np.int64)
    [step.add(b, hidden) for b in range(len(counts))]
    ends = np.array([5, 0, 9, 2, 13], dtype=np.int64)
    want = np.minimum(strict_accept(drafts.numpy(), host_targets[verify_grid(counts, K)]), counts)
    host.write(slots, ends, want + 1, hidden, starts)

    keep_rows = step.rows(slots[:, None], ends[:, None] + np.arange(K + 1))
    sampling = [torch.from_numpy(a) for a in targets.arrays()]
    assert bool(sample_targets(logits, *sampling)[1]) == (scale > 1)  # flat: past the head
    got_targets, _, got = accept_and_keep(step.buf, logits, hidden, drafts, torch.from_numpy(starts),
                                       torch.from_numpy(counts), torch.from_numpy(keep_rows), sampling, whole_rows)
    np.testing.assert_array_equal(got_targets.numpy(), host_targets)
    np.testing.assert_array_equal(got.numpy(), want)
    assert torch.equal(step.buf, host.buf) and want.any()


def test_a_sampled_step_that_cannot_decide_keeps_nothing():
    """Flat rows whose top-p set passes the 256 largest logits, in a step that may not branch (a
    captured graph): accepted -1 for every sequence, nothing written (the host samples, accepts
    and keeps that step)."""
    counts, starts, drafts, logits, hidden, targets, _ = _sampled_case(5, [2, 1], scale=0.05)
    buf = torch.randn(12, HIDDEN)
    buf[0] = 0
    before = buf.clone()
    keep = torch.arange(1, 1 + len(counts) * (K + 1)).view(len(counts), K + 1)
    _, _, accepted = accept_and_keep(buf, logits, hidden, drafts, torch.from_numpy(starts), torch.from_numpy(counts),
                                  keep, [torch.from_numpy(a) for a in targets.arrays()])
    assert accepted.tolist() == [-1, -1] and torch.equal(buf, before)


def test_target_rows_travel_with_the_cache_rows():
    counts, starts, drafts, logits, hidden, targets, _ = _sampled_case(6, [1, 2], scale=6.0)
    buf = torch.zeros(9, HIDDEN)
    rows = HiddenCacheRows(buf, np.array([1, 2, 0]), counts, np.zeros((2, K + 1), dtype=np.int64), targets)
    arrays = device_rows(rows, starts)
    assert [a.dtype for a in arrays[4:]] == [np.float32, np.int64, np.float32, np.int64]
    cache = DeviceHiddenCache.of(buf, [torch.from_numpy(a) for a in arrays])
    assert len(cache.tensors()) == 9 and torch.equal(cache.targets[3], torch.from_numpy(targets.keys))
