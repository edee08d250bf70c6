"""Each attention program finds its own tile (sequence, first new token) from q_lens on the device."""
import pytest
import torch
import triton
import triton.language as tl

from mindspec.backends.cuda.tiles import num_tile_programs, seq_block, tile_of


@triton.jit
def _tiles_kernel(q_lens_ptr, num_seqs, seq_ptr, first_ptr, TILE_Q: tl.constexpr, SEQ_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b, first = tile_of(q_lens_ptr, num_seqs, pid, TILE_Q, SEQ_BLOCK)
    tl.store(seq_ptr + pid, b)
    tl.store(first_ptr + pid, first)


def _expected(q_lens: list[int], tile_q: int, programs: int) -> tuple[list[int], list[int]]:
    """Tiles in order: sequence b's ceil(q_b / tile_q) tiles, then (-1, *) for the programs left."""
    tiles = [(b, i) for b, q in enumerate(q_lens) for i in range(0, q, tile_q)]
    assert len(tiles) <= programs
    return [b for b, _ in tiles] + [-1] * (programs - len(tiles)), [i for _, i in tiles]


def _tiles(q_lens: list[int], tile_q: int, device, block=None, dtype=torch.int32):
    programs = num_tile_programs(sum(q_lens), len(q_lens), tile_q)
    seq = torch.full((programs,), -7, dtype=torch.int32, device=device)
    first = torch.full((programs,), -7, dtype=torch.int32, device=device)
    q = torch.tensor(q_lens, dtype=dtype, device=device)
    _tiles_kernel[(programs,)](q, len(q_lens), seq, first, TILE_Q=tile_q,
                               SEQ_BLOCK=block or seq_block(len(q_lens)))
    return programs, seq.cpu().tolist(), first.cpu().tolist()


@pytest.mark.parametrize("q_lens,tile_q", [
    ([1], 1), ([4], 4), ([4, 4, 4], 4), ([3, 1, 4, 1, 5], 4), ([1, 1, 1, 1], 16),
    ([0, 5, 0, 0, 9, 0], 4),  # empty sequences own no tile
    ([37, 2, 64, 1], 16), ([0], 8), ([129, 3], 64),
])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_every_program_finds_its_tile(device, q_lens, tile_q, dtype):
    programs, seq, first = _tiles(q_lens, tile_q, device, dtype=dtype)
    want_seq, want_first = _expected(q_lens, tile_q, programs)
    assert seq == want_seq
    real = [i for i, b in enumerate(want_seq) if b >= 0]
    assert [first[i] for i in real] == want_first


@pytest.mark.parametrize("block", [2, 4, 8])
def test_sequences_summed_over_several_blocks(device, block):
    """More sequences than one SEQ_BLOCK holds: the running sum carries across blocks."""
    g = torch.Generator().manual_seed(block)
    q_lens = torch.randint(0, 7, (23,), generator=g).tolist()
    programs, seq, first = _tiles(q_lens, 2, device, block=block)
    want_seq, want_first = _expected(q_lens, 2, programs)
    assert seq == want_seq
    assert [first[i] for i, b in enumerate(want_seq) if b >= 0] == want_first
    assert seq_block(1000) == 256 and seq_block(3) == 4
