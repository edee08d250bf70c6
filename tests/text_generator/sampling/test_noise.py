"""Counter-based sampling noise: splitmix64 against a pure-Python reference, its distribution,
its independence of the batch, and the same values compiled as eager."""
import math

import pytest
import torch

from mindspec.text_generator.sampling.noise import GOLDEN, exponential_noise, mix64, row_keys, token_bits

MASK = (1 << 64) - 1


def ref_mix64(z: int) -> int:
    """splitmix64's output function in Python integers (Steele et al., SplittableRandom)."""
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def ref_bits(key: int, v: int) -> int:
    return ref_mix64((key + (v + 1) * 0x9E3779B97F4A7C15) & MASK) >> 40


def test_mix64_is_splitmix64():
    # splitmix64 seeded with 0: its first outputs, as published with the reference C code
    state, outs = 0, []
    for _ in range(3):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        outs.append(ref_mix64(state))
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    zs = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF, 42]
    got = mix64(torch.tensor([signed(z) for z in zs], dtype=torch.int64)).tolist()
    assert got == [signed(ref_mix64(z)) for z in zs]


def test_noise_equals_the_reference_at_every_token():
    keys = [0, 1, signed(0xFEDCBA9876543210), -5]
    bits = token_bits(torch.tensor(keys, dtype=torch.int64), 37)
    assert bits.tolist() == [[ref_bits(k & MASK, v) for v in range(37)] for k in keys]
    noise = exponential_noise(torch.tensor(keys, dtype=torch.int64), 37)
    assert noise.shape == (4, 37) and noise.dtype == torch.float32
    ref = [[-math.log((ref_bits(k & MASK, v) + 0.5) / 2**24) for v in range(37)] for k in keys]
    torch.testing.assert_close(noise, torch.tensor(ref, dtype=torch.float32), rtol=1e-6, atol=1e-7)
    assert GOLDEN == signed(0x9E3779B97F4A7C15)


def test_noise_is_exponential_and_uncorrelated_across_rows_and_tokens():
    keys = row_keys(torch.full((64,), -1, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 7)
    e = exponential_noise(keys, 4096).double()  # 262144 draws
    assert (e > 0).all() and torch.isfinite(e).all()
    assert abs(e.mean().item() - 1) < 0.01 and abs(e.var().item() - 1) < 0.02
    u = torch.exp(-e).flatten()  # back to the uniform: Kolmogorov-Smirnov against U(0, 1)
    n = u.numel()
    ks = (torch.arange(1, n + 1, dtype=torch.float64) / n - u.sort().values).abs().max().item()
    assert ks < 1.95 / math.sqrt(n)  # the 0.1 % critical value
    rows = torch.corrcoef(e[:8])  # rows of one step (consecutive keys)
    assert (rows - torch.eye(8, dtype=torch.float64)).abs().max() < 0.07
    lag = torch.corrcoef(torch.stack([e[:, :-1].flatten(), e[:, 1:].flatten()]))[0, 1]
    assert abs(lag) < 0.01  # neighbouring tokens of a row


def test_a_seeded_row_depends_on_its_seed_and_position_only():
    seeds = torch.tensor([5, -1, 5, 6, 5], dtype=torch.int64)
    positions = torch.tensor([3, 3, 4, 3, 3], dtype=torch.int64)
    keys = row_keys(seeds, positions, 11)
    assert keys[0] == keys[4]  # the same (seed, position) in two rows of one step
    assert len({keys[0].item(), keys[2].item(), keys[3].item()}) == 3
    other_step = row_keys(seeds.flip(0), positions.flip(0), 12)
    assert other_step[4] == keys[0] and other_step[2] == keys[2] and other_step[1] == keys[3]
    assert other_step[3] != keys[1]  # the unseeded row follows the step's draw


def test_unseeded_rows_of_one_step_differ():
    keys = row_keys(torch.full((5,), -1, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), 3)
    assert len(set(keys.tolist())) == 5


@pytest.mark.slow
def test_compiled_noise_equals_eager():
    """The noise inside compiled code (Inductor's C++): int64 multiplication wraps there too, so
    the bits are equal; the vectorised log is within an ulp."""
    def noise(seeds, positions):
        keys = row_keys(seeds, positions, 2**61 + 12345)
        return token_bits(keys, 1000), exponential_noise(keys, 1000)

    seeds = torch.tensor([0, 2**63 - 1, -1, 77], dtype=torch.int64)
    positions = torch.tensor([0, 9, 3, 2**40], dtype=torch.int64)
    bits, e = torch.compile(noise, fullgraph=True, dynamic=False)(seeds, positions)
    ref_bits_, ref_e = noise(seeds, positions)
    assert torch.equal(bits, ref_bits_)
    torch.testing.assert_close(e, ref_e, rtol=2e-7, atol=0)
