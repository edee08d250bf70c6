"""The draft-stage kernel (backends/cuda/draft_shift.py) equals ``Backend.argmax_shift_in``'s torch
ops token for token: the argmax (torch's first index of the largest value, ties within and
across vocabulary blocks) and the rolled tokens with the drafts at the lm_head rows."""
import numpy as np
import pytest
import torch

from cuda_support import DTYPES
from mindspec.backend import Backend

reference = Backend.argmax_shift_in  # the default op: torch's argmax, roll and indexed write


def _check(cuda_backend, device, logits, ids, lm):
    want_drafts, want_ids = reference(None, logits, ids, lm)
    drafts, shifted = cuda_backend.argmax_shift_in(logits.to(device), ids.to(device), lm.to(device))
    assert drafts.dtype == torch.int64 and shifted.dtype == ids.dtype
    assert drafts.cpu().tolist() == want_drafts.tolist()
    assert shifted.cpu().tolist() == want_ids.tolist()


def _decode_layout(rng, rows_per_seq: list[int], newest: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T] and each sequence's lm_head row: sequence b holds rows_per_seq[b] rows (padding
    after its newest entry, row newest[b] of them)."""
    starts = np.cumsum([0] + rows_per_seq[:-1])
    ids = torch.from_numpy(rng.integers(0, 1000, sum(rows_per_seq)))
    return ids, torch.tensor([s + n for s, n in zip(starts, newest)], dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 4096, 70000])  # 70000: more than one vocabulary block everywhere
def test_kernel_equals_the_torch_ops(cuda_backend, device, dtype, vocab):
    rng = np.random.default_rng(vocab)
    ids, lm = _decode_layout(rng, [4, 4, 4, 4, 4], [3, 0, 2, 3, 1])
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    _check(cuda_backend, device, logits, ids, lm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_index_within_and_across_blocks(cuda_backend, device, dtype):
    vocab = 70000
    logits = torch.zeros(4, vocab, dtype=dtype)
    logits[0, [5, 9, 66000]] = 3.0  # ties in one block and across blocks (a block holds at most 65536)
    logits[1, [66000, 69999]] = 2.0  # ties only past the first block
    logits[2, 69999] = 1.0  # the last column alone
    logits[3] = float("-inf")  # a row with nothing allowed (an all-masked draft): torch says 0
    logits[3, [40, 41]] = -1.0
    ids, lm = _decode_layout(np.random.default_rng(0), [2, 3, 1, 4], [1, 2, 0, 0])
    _check(cuda_backend, device, logits, ids, lm)


def test_many_rows_and_unordered_lm_head_rows(cuda_backend, device):
    """More rows than one program copies, and lm_head rows in no particular order: every row is
    written once, the lm_head rows by the drafts."""
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.integers(0, 50, 1500))
    lm = torch.from_numpy(rng.permutation(1500)[:37].astype(np.int64))
    logits = torch.randn(37, 50, generator=torch.Generator().manual_seed(3))
    _check(cuda_backend, device, logits, ids, lm)


def test_one_row_per_sequence(cuda_backend, device):
    """The lm_head rows are all the rows (a narrowed stage's layout): the drafts alone."""
    logits = torch.randn(6, 33, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(6, dtype=torch.int64)
    _check(cuda_backend, device, logits, ids, torch.arange(6, dtype=torch.int64))
