"""Counter-based sampling noise: splitmix64 against a pure-Python reference, its distribution,
its independence of the batch, and the same values compiled as eager."""
import math

import pytest
import torch

from mindspec.text_generator.sampling.noise import exponential_noise, keyed_for_step, row_keys, token_bits

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def ref_mix64(z: int) -> int:
    """splitmix64's output function in Python integers (Steele et al., SplittableRandom)."""
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def ref_bits(key: int, v: int) -> int:
    return ref_mix64((key + (v + 1) * GOLDEN) & MASK) >> 40


def test_the_reference_is_splitmix64():
    # splitmix64 seeded with 0: its first outputs, as published with the reference C code
    outs = [ref_mix64(i * GOLDEN) for i in (1, 2, 3)]
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_row_keys_equal_the_reference():
    seeds, positions = [0, 2**63 - 1, 42, -1, -1], [0, 9, 2**40, 3, 0]
    keys = row_keys(seeds, positions)
    assert keys.dtype.name == "int64"
    expected = [signed(ref_mix64(ref_mix64(s + GOLDEN) + (p + 1) * GOLDEN)) for s, p in zip(seeds[:3], positions[:3])]
    expected += [signed(ref_mix64(row * GOLDEN)) for row in (4, 5)]  # unseeded: the row's index (from 1)
    assert keys.tolist() == expected


def test_noise_equals_the_reference_at_every_token():
    keys = [0, 1, signed(0xFEDCBA9876543210), -5]
    bits = token_bits(torch.tensor(keys, dtype=torch.int64), 37)
    assert bits.tolist() == [[ref_bits(k & MASK, v) for v in range(37)] for k in keys]
    noise = exponential_noise(torch.tensor(keys, dtype=torch.int64), 37)
    assert noise.shape == (4, 37) and noise.dtype == torch.float32
    ref = [[-math.log((ref_bits(k & MASK, v) + 0.5) / 2**24) for v in range(37)] for k in keys]
    torch.testing.assert_close(noise, torch.tensor(ref, dtype=torch.float32), rtol=1e-6, atol=1e-7)


def test_noise_is_exponential_and_uncorrelated_across_rows_and_tokens():
    keys = keyed_for_step(torch.from_numpy(row_keys([-1] * 64, [0] * 64)), None, 7)
    e = exponential_noise(keys, 4096).double()  # 262144 draws
    assert (e > 0).all() and torch.isfinite(e).all()
    assert abs(e.mean().item() - 1) < 0.01 and abs(e.var().item() - 1) < 0.02
    u = torch.exp(-e).flatten()  # back to the uniform: Kolmogorov-Smirnov against U(0, 1)
    n = u.numel()
    ks = (torch.arange(1, n + 1, dtype=torch.float64) / n - u.sort().values).abs().max().item()
    assert ks < 1.95 / math.sqrt(n)  # the 0.1 % critical value
    rows = torch.corrcoef(e[:8])  # rows of one step
    assert (rows - torch.eye(8, dtype=torch.float64)).abs().max() < 0.07
    lag = torch.corrcoef(torch.stack([e[:, :-1].flatten(), e[:, 1:].flatten()]))[0, 1]
    assert abs(lag) < 0.01  # neighbouring tokens of a row


def test_a_seeded_row_keeps_its_key_whatever_the_step_and_the_batch():
    keys = row_keys([5, -1, 5, 6, 5], [3, 3, 4, 3, 3])
    assert keys[0] == keys[4]  # the same (seed, position) in two rows of one step
    assert len({keys[0], keys[2], keys[3]}) == 3
    seeded = torch.tensor([True, False, True, True, True])
    step = keyed_for_step(torch.from_numpy(keys), seeded, 11)
    other = keyed_for_step(torch.from_numpy(keys), seeded, 12)
    assert torch.equal(step[seeded], torch.from_numpy(keys)[seeded]) and torch.equal(other[seeded], step[seeded])
    assert step[1] != other[1]  # the unseeded row follows the step's draw
    assert row_keys([6, 5], [3, 4]).tolist() == [keys[3], keys[2]]  # another batch, the same keys


def test_unseeded_rows_of_one_step_differ():
    keys = keyed_for_step(torch.from_numpy(row_keys([-1] * 5, [0] * 5)), None, 3)
    assert len(set(keys.tolist())) == 5


@pytest.mark.slow
def test_compiled_noise_equals_eager():
    """The noise inside compiled code (Inductor's C++): int64 multiplication wraps there too, so
    the bits are equal; the vectorised log is within an ulp."""
    def noise(keys, seeded):
        keys = keyed_for_step(keys, seeded, 2**63 + 12345)
        return token_bits(keys, 1000), exponential_noise(keys, 1000)

    keys = torch.from_numpy(row_keys([0, 2**63 - 1, -1, 77], [0, 9, 3, 2**40]))
    seeded = torch.tensor([True, True, False, True])
    bits, e = torch.compile(noise, fullgraph=True, dynamic=False)(keys, seeded)
    ref_bits_, ref_e = noise(keys, seeded)
    assert torch.equal(bits, ref_bits_)
    torch.testing.assert_close(e, ref_e, rtol=2e-7, atol=0)


def test_a_step_traced_before_any_eager_one_takes_the_stream_offsets_as_a_constant(monkeypatch):
    """A compile worker exports a sampled step in a process that never ran one: the stream
    offsets must still be a constant of the package, not an ``arange`` times GOLDEN computed in
    its loops (Inductor's C++ folds that into signed index arithmetic that overflows, and the
    package then never returned)."""
    from mindspec.text_generator.sampling import noise

    monkeypatch.setattr(noise, "_OFFSETS", {})

    class Noise(torch.nn.Module):
        def forward(self, keys):
            return exponential_noise(keys, 777)

    keys = torch.arange(3, dtype=torch.int64)
    program = torch.export.export(Noise(), (keys,), strict=False)
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("arange" in op for op in ops), ops
    assert noise._OFFSETS == {}  # nothing traced was kept
    assert torch.equal(program.module()(keys), exponential_noise(keys, 777))
