"""The acceptance kernel equals the tensor ops it replaces (mindspec.backend.accept_drafts): the
accepted counts and every row of the hidden cache, greedy and sampled (exact or not); packed
(accept_and_pack), the targets, drafts and counts as consecutive views of one buffer."""
import numpy as np
import pytest
import torch

from mindspec.backend import accept_drafts as reference
from mindspec.backends.cuda.acceptance import accept_and_pack, accept_drafts
from mindspec.modeling.packed_transfer import packed_span

HIDDEN, VOCAB = 24, 7


def _case(seed: int, counts: list[int], k: int, dtype: torch.dtype):
    rng = np.random.default_rng(seed)
    counts_np = np.array(counts, dtype=np.int64)
    starts = np.cumsum(counts_np + 1) - (counts_np + 1)
    rows = int((counts_np + 1).sum())
    drafts = rng.integers(0, VOCAB, (len(counts), k))
    targets = rng.integers(0, VOCAB, rows)
    for b, (s, c) in enumerate(zip(starts, counts)):
        for j in range(c):
            if rng.random() < 0.75:  # every accepted count occurs across seeds
                targets[s + j] = drafts[b, j]
    hidden = torch.from_numpy(rng.normal(size=(rows, HIDDEN)).astype(np.float32))
    keep = rng.permutation(np.arange(1, 40))[: len(counts) * (k + 1)].reshape(len(counts), k + 1)  # distinct rows
    keep[rng.random(keep.shape) < 0.2] = 0  # rows with nowhere to go
    keep[np.array(counts) == 0] = 0  # padding sequences keep nothing
    buffer = torch.randn(40, HIDDEN).to(dtype)
    buffer[0] = 0
    return (buffer, torch.from_numpy(targets), torch.from_numpy(drafts), torch.from_numpy(starts),
            torch.from_numpy(counts_np), torch.from_numpy(keep), hidden)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k,counts", [(1, [1, 0, 1]), (3, [3, 0, 2, 1, 3]), (4, [4, 4, 2])])
@pytest.mark.parametrize("exact", [None, True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_the_tensor_ops(device, seed, k, counts, exact, dtype):
    buffer, targets, drafts, starts, counts_t, keep, hidden = _case(seed, counts, k, dtype)
    flag = None if exact is None else torch.tensor(exact)
    want_buffer = buffer.clone()
    want = reference(want_buffer, targets, flag, hidden, drafts, starts, counts_t, keep)
    got_buffer = buffer.to(device)
    got = accept_drafts(got_buffer, targets.to(device), None if flag is None else flag.to(device), hidden.to(device),
                        drafts.to(device), starts.to(device), counts_t.to(device), keep.to(device))
    assert got.cpu().tolist() == want.tolist()
    assert torch.equal(got_buffer.cpu(), want_buffer)
    assert not got_buffer[0].any()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k,counts,extra_rows", [(1, [1, 0, 1], 0), (3, [3, 0, 2, 1, 3], 2), (2, [2], 5)])
def test_packed_outputs_are_the_inputs_and_counts_in_one_buffer(device, seed, k, counts, extra_rows):
    """Targets beyond the sequences' rows (padding rows) are packed too; the drafts may be a view
    of the verification rows [B, K + 1] (the model's layout)."""
    buffer, targets, drafts, starts, counts_t, keep, hidden = _case(seed, counts, k, torch.float32)
    targets = torch.cat([targets, torch.arange(extra_rows)])
    hidden = torch.cat([hidden, torch.zeros(extra_rows, HIDDEN)])
    rows = torch.cat([torch.zeros(len(counts), 1, dtype=torch.int64), drafts], dim=1)  # [B, K + 1]
    want_buffer = buffer.clone()
    want = reference(want_buffer, targets, None, hidden, drafts, starts, counts_t, keep)
    got_buffer = buffer.to(device)
    got_targets, got_drafts, got = accept_and_pack(
        got_buffer, targets.to(device), None, hidden.to(device), rows.to(device)[:, 1:], starts.to(device),
        counts_t.to(device), keep.to(device))
    assert packed_span(got_targets, got_drafts, got) is not None
    assert got_targets.cpu().tolist() == targets.tolist() and got_drafts.cpu().tolist() == drafts.tolist()
    assert got.cpu().tolist() == want.tolist() and torch.equal(got_buffer.cpu(), want_buffer)
