"""Counter-based Exp(1) noise for the sampler's exponential race: pure tensor ops, no generators.

Row i's noise at token v is a function of the row's 64-bit key and v alone: splitmix64 (Steele,
Lea and Flood; java.util.SplittableRandom) at stream position v + 1 of a stream seeded by the key,
its top 24 bits turned into a uniform u in (0, 1) and E = -log(u). A seeded row's key depends on
(seed, output position) only, so a seeded request's tokens depend on neither the batch, nor the
other rows, nor the device; an unseeded row's key comes from its index and one host draw per step.
The keys are computed on the host with the rest of the sampling metadata. Every op is elementwise int64 arithmetic (multiplication wraps modulo 2**64 on every torch
backend), so the noise runs inside compiled packages and captured graphs as it runs eagerly, and
seeded sampling needs neither a generator per row nor a host loop.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import torch


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch holds it."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN = _signed(0x9E3779B97F4A7C15)  # splitmix64's stream increment
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_UNIFORM_BITS = 24  # a float32 holds them exactly
_MASK = (1 << 64) - 1


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mixed_top_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function, in place, its top 24 bits only: its last xor-shift (by 31)
    leaves them as they are, so it is skipped. In-place ops: a large [N, V] pays per pass."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_M1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_M2)
    return _shr(z, 64 - _UNIFORM_BITS)


def _mix64_int(z: int) -> int:
    """splitmix64's output function over Python ints (one row's key: cheaper than an array op)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * (_M1 & _MASK)) & _MASK
    z = ((z ^ (z >> 27)) * (_M2 & _MASK)) & _MASK
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=64)
def _unseeded_keys(num_rows: int) -> np.ndarray:
    keys = np.array([_signed(_mix64_int(row * GOLDEN)) for row in range(1, num_rows + 1)], dtype=np.int64)
    keys.setflags(write=False)
    return keys


def row_keys(seeds: Sequence[int], output_positions: Sequence[int]) -> np.ndarray:
    """[N] int64 stream keys, on the host: a seeded row's (seed >= 0) from (seed, output
    position) alone; an unseeded row's from its index, to which the sampler adds its step's draw
    (``keyed_for_step``)."""
    keys = _unseeded_keys(len(seeds)).copy()
    for i, (seed, position) in enumerate(zip(seeds, output_positions)):
        if seed >= 0:
            keys[i] = _signed(_mix64_int(_mix64_int(seed + GOLDEN) + (position + 1) * GOLDEN))
    return keys


def keyed_for_step(keys: torch.Tensor, seeded: Optional[torch.Tensor], step_key: int) -> torch.Tensor:
    """keys [N] from ``row_keys`` (on the device), seeded [N] bool (None: no row is) -> the
    step's keys: unseeded rows' offset by ``step_key``, a host draw per step."""
    stepped = keys + _signed(step_key)
    return stepped if seeded is None else torch.where(seeded, keys, stepped)


_OFFSETS: dict[tuple[int, str], torch.Tensor] = {}


def stream_offsets(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] int64 (v + 1) * GOLDEN, made once per vocabulary and device and read from memory:
    compiled code that computed them from its loop index would overflow a signed integer in its
    index arithmetic, which C++ leaves undefined (Inductor's C++ then looped for ever, or gave
    wrong bits and crashed on an AVX-512 cpu). Made with numpy, so that a step exported before any
    eager one ran (a compile worker's) takes them as a constant too; torch.compile, which cannot
    trace numpy's uint64, takes them from a list of Python ints (a constant as well)."""
    key = (vocab_size, str(device))
    offsets = _OFFSETS.get(key)
    if offsets is not None:
        return offsets
    if torch.compiler.is_dynamo_compiling():
        return torch.tensor([_signed((v + 1) * GOLDEN) for v in range(vocab_size)], dtype=torch.int64, device=device)
    with torch.inference_mode(False):  # a plain tensor: compiled steps take it as a constant
        host = np.arange(1, vocab_size + 1, dtype=np.uint64) * np.uint64(GOLDEN & _MASK)
        offsets = torch.from_numpy(host.view(np.int64)).to(device)
    if not torch.compiler.is_compiling():  # not a traced stand-in
        _OFFSETS[key] = offsets
    return offsets


def token_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [N] int64 -> [N, V] int64 in [0, 2**24): the top bits of splitmix64's output at
    stream position v + 1 (the integer part: the same on every backend, compiled or not)."""
    return _mixed_top_(keys.unsqueeze(1) + stream_offsets(vocab_size, keys.device))


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [N] int64 -> Exp(1) noise [N, V] fp32, every value in [3e-8, 17.4] (finite, > 0).
    The log may differ by an ulp between implementations (vectorised or not)."""
    u = token_bits(keys, vocab_size).to(torch.float32).add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)
    return u.log_().neg_()
