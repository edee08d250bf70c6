"""Weights kept quantized in memory, whatever their format: block FP8 (fp8.Fp8Weight) or GGUF's
blocks (gguf_quants.GgufWeight). Both are [..., N, K] with ``shape``, ``dtype`` (the model's),
``nbytes``, ``dequantize(dtype)`` and expert indexing (``w[e]``); rows of a 2-D weight come from
``rows`` here (FP8 scales cover blocks of rows). The model builds its fused weights through
``cat_rows`` and ``stack``, which keep a weight quantized where its format allows and dequantize
otherwise.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from . import fp8, gguf_quants
from .fp8 import Fp8Weight
from .gguf_quants import GgufWeight

QuantizedWeight = Union[Fp8Weight, GgufWeight]
Weight = Union[torch.Tensor, Fp8Weight, GgufWeight]


def is_quantized(w) -> bool:
    return isinstance(w, (Fp8Weight, GgufWeight))


def dense(w: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight as a tensor (dequantized if quantized), in ``dtype`` if given."""
    if is_quantized(w):
        return w.dequantize(dtype)
    return w if dtype is None else w.to(dtype)


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """Row concatenation of [N_i, K] weights (dim -2): quantized if every part is of one format."""
    if all(isinstance(p, GgufWeight) for p in parts) and len({(p.qtype, p.dtype) for p in parts}) == 1:
        return gguf_quants.cat_rows(parts)
    if any(isinstance(p, GgufWeight) for p in parts):
        return torch.cat([dense(p) for p in parts], dim=-2)
    return fp8.cat_rows(parts)


def stack(parts: Sequence[Weight]) -> Weight:
    """torch.stack of equal-shaped weights: quantized if every part is of one format."""
    if all(isinstance(p, GgufWeight) for p in parts) and len({(p.qtype, p.dtype) for p in parts}) == 1:
        return gguf_quants.stack(parts)
    if any(isinstance(p, GgufWeight) for p in parts):
        return torch.stack([dense(p) for p in parts])
    return fp8.stack(parts)


def rows(w: Weight, start: int, stop: int | None = None) -> Weight:
    """Rows start:stop of a 2-D weight, a view where the format allows (GGUF blocks run along K)."""
    return fp8.slice_rows(w, start, stop) if isinstance(w, Fp8Weight) else w[start:stop]


def same(a: Weight, b: Weight) -> bool:
    """Whether two weights hold the same values (MTP modules' copies of the embedding and head)."""
    if a is b:
        return True
    if type(a) is not type(b) or tuple(a.shape) != tuple(b.shape):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return torch.equal(dense(a, torch.float32), dense(b, torch.float32))
