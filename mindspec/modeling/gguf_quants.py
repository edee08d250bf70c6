"""GGUF (llama.cpp / ggml) quantized weights, kept quantized in memory as torch tensors.

A GGUF file stores most weights in ggml's block formats: each row of K values is cut into blocks of
32 values (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or 256 (the "k-quants" Q4_K, Q5_K, Q6_K), each block a
fixed-size record of packed small integers and float16 scales. Expanding such a model into the
model's dtype at load would cost 2-4x its file's memory, so the loader keeps these weights as they
are: a ``GgufWeight`` holds the block records split into one contiguous tensor per field ("planes",
together exactly the GGUF bytes), and the cpu backend dequantizes a weight when a linear uses it
(``GgufWeight.dequantize``: a few vectorized torch ops, bit-identical in float32 to ggml's
dequantize_row_* as gguf-py implements them in gguf.quants, then cast to the model dtype). An MoE
expert stack indexes one expert first (``w[e]``); an embedding dequantizes only the rows a step
looks up (``GgufWeight.rows``).

GGUF's other types (Q2_K, Q3_K, IQ*) are dequantized once, at load, by ``dequantize_raw`` (through
gguf.quants' numpy code). ``quantize`` goes the other way, for writing GGUF files: Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1 through gguf.quants (llama.cpp's reference quantizers, byte for byte); Q4_K,
Q5_K and Q6_K with a simple min/max quantizer of our own (see ``_quantize_k_min_max``), valid
blocks in ggml's exact layout but not llama.cpp's iterative scale search (make_qkx2_quants).

The host is assumed little-endian, like GGUF files and every machine mindspec runs on.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

Q = GGMLQuantizationType

KEPT_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
_TORCH_FLOAT = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}

_F16, _U8, _I8 = torch.float16, torch.uint8, torch.int8

# Each kept type's block record, field by field in file order (ggml-common.h's block_*):
# (plane name, bytes, element dtype). A float16 field becomes a plane [..., N, nb]; a byte field a
# plane [..., N, nb, bytes], nb = K // block_size.
_FIELDS: dict[GGMLQuantizationType, tuple[tuple[str, int, torch.dtype], ...]] = {
    Q.Q8_0: (("d", 2, _F16), ("qs", 32, _I8)),
    Q.Q4_0: (("d", 2, _F16), ("qs", 16, _U8)),
    Q.Q4_1: (("d", 2, _F16), ("m", 2, _F16), ("qs", 16, _U8)),
    Q.Q5_0: (("d", 2, _F16), ("qh", 4, _U8), ("qs", 16, _U8)),
    Q.Q5_1: (("d", 2, _F16), ("m", 2, _F16), ("qh", 4, _U8), ("qs", 16, _U8)),
    Q.Q4_K: (("d", 2, _F16), ("dmin", 2, _F16), ("scales", 12, _U8), ("qs", 128, _U8)),
    Q.Q5_K: (("d", 2, _F16), ("dmin", 2, _F16), ("scales", 12, _U8), ("qh", 32, _U8), ("qs", 128, _U8)),
    Q.Q6_K: (("ql", 128, _U8), ("qh", 64, _U8), ("scales", 16, _I8), ("d", 2, _F16)),
}
assert all(sum(n for _, n, _ in f) == GGML_QUANT_SIZES[q][1] for q, f in _FIELDS.items())
assert set(_FIELDS) == KEPT_TYPES


# ---------------------------------------------------------------------------------------------
# Dequantizers: planes -> float32 [..., N, nb, block values] (some with a sub-block dim), in the
# same float32 operations, in the same order, as gguf.quants' dequantize_blocks.


# The bit fields are unpacked eight bytes at a time, on int64 views of the byte planes: torch's
# uint8 shifts by a broadcast tensor of shift counts take ~10x longer than these scalar ones.
_LOW4 = 0x0F0F0F0F0F0F0F0F  # the low nibble of every byte of an int64
_LOW2 = 0x0303030303030303
_LOW1 = 0x0101010101010101


def _int64(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., L] -> the same bytes as int64 [..., L // 8]."""
    return b.view(torch.int64)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., L] -> int64 [..., 2, L // 8]: as bytes, every byte's low nibble, then every high
    nibble."""
    q = _int64(qs)
    return torch.stack((q & _LOW4, (q >> 4) & _LOW4), dim=-2)


def _bit_fields(qh: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., L] -> int64 [..., 8 // width, L // 8]: as bytes, row s holds bits width * s ..
    width * (s + 1) - 1 of every byte, shifted up by 4 (above a nibble)."""
    q, mask = _int64(qh), {1: _LOW1, 2: _LOW2}[width]
    return torch.stack([((q >> s) & mask) << 4 for s in range(0, 8, width)], dim=-2)


@functools.lru_cache(maxsize=None)
def _bit_table(device: torch.device) -> torch.Tensor:
    """int64 [256]: for byte value v, eight bytes, byte i = bit i of v, shifted up by 4."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1  # [256, 8]
    return (bits << 4).to(_U8).view(torch.int64).reshape(256).to(device)


def _deq_q8_0(p):
    return p["qs"].float().mul_(p["d"].float().unsqueeze(-1))  # [..., nb, 32]


def _deq_q4_0(p):
    q = _nibbles(p["qs"]).view(_I8).flatten(-2) - 8  # [..., nb, 32] in -8..7
    return q.float().mul_(p["d"].float().unsqueeze(-1))


def _deq_q4_1(p):
    q = _nibbles(p["qs"]).view(_U8).flatten(-2)  # [..., nb, 32] in 0..15
    return q.float().mul_(p["d"].float().unsqueeze(-1)).add_(p["m"].float().unsqueeze(-1))


def _q5_values(p) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit values, uint8 [..., nb, 32]: value j's high bit is bit j of qh (a
    little-endian uint32), its low bits the low (j < 16) or high (j >= 16) nibble of qs[j % 16]."""
    qh = p["qh"]  # [..., nb, 4]
    high = _bit_table(qh.device).index_select(0, qh.reshape(-1).long()).view(qh.shape)  # int64 [..., nb, 4]
    return (_nibbles(p["qs"]).flatten(-2) | high).view(_U8)


def _deq_q5_0(p):
    q = _q5_values(p).view(_I8) - 16  # [..., nb, 32] in -16..15
    return q.float().mul_(p["d"].float().unsqueeze(-1))


def _deq_q5_1(p):
    return _q5_values(p).float().mul_(p["d"].float().unsqueeze(-1)).add_(p["m"].float().unsqueeze(-1))


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's packed 6-bit sub-block scales and mins, uint8 [..., nb, 12] -> two [..., nb, 8]
    (ggml's get_scale_min_k4): bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3;
    scales and mins 4-7 keep their low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and
    their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((a & 63, (c & 15) | ((a >> 6) << 4)), dim=-1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=-1)
    return sc, mn


def _deq_k_min(p, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: q uint8 [..., nb, 8, 32] -> d * scale * q - dmin * min, float32."""
    sc, mn = _scale_min_k4(p["scales"])
    dl = p["d"].float().unsqueeze(-1) * sc.float()  # [..., nb, 8]
    ml = p["dmin"].float().unsqueeze(-1) * mn.float()  # [..., nb, 8]
    return q.float().mul_(dl.unsqueeze(-1)).sub_(ml.unsqueeze(-1))  # [..., nb, 8, 32]


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K qs, uint8 [..., nb, 128] -> int64 [..., nb, 8, 4], as bytes [..., nb, 8, 32]:
    4 chunks of 32 bytes, chunk c's low nibbles sub-block 2c, its high nibbles 2c + 1."""
    return _nibbles(qs.unflatten(-1, (4, 32))).flatten(-3, -2)


def _deq_q4_k(p):
    return _deq_k_min(p, _k_low(p["qs"]).view(_U8))


def _deq_q5_k(p):
    high = _bit_fields(p["qh"], 1)  # [..., nb, 8, 4]: bit s of qh[l] tops value l of sub-block s
    return _deq_k_min(p, (_k_low(p["qs"]) | high).view(_U8))


def _deq_q6_k(p):
    # Two halves of 128 values; in half h, value 64 * i + l (l < 64) takes nibble i of ql[64h + l],
    # value 32 * s + l (l < 32) takes bits 2s, 2s + 1 of qh[32h + l] as its top 2 bits.
    low = _nibbles(p["ql"].unflatten(-1, (2, 64))).flatten(-3)  # int64 [..., nb, 32]
    high = _bit_fields(p["qh"].unflatten(-1, (2, 32)), 2).flatten(-3)  # int64 [..., nb, 32]
    q = (low | high).view(_I8) - 32  # [..., nb, 256] in -32..31
    dl = p["d"].float().unsqueeze(-1) * p["scales"].float()  # [..., nb, 16]: one per 16 values
    return q.float().unflatten(-1, (16, 16)).mul_(dl.unsqueeze(-1))  # [..., nb, 16, 16]


_DEQUANT: dict[GGMLQuantizationType, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    Q.Q8_0: _deq_q8_0, Q.Q4_0: _deq_q4_0, Q.Q4_1: _deq_q4_1, Q.Q5_0: _deq_q5_0, Q.Q5_1: _deq_q5_1,
    Q.Q4_K: _deq_q4_k, Q.Q5_K: _deq_q5_k, Q.Q6_K: _deq_q6_k,
}


# ---------------------------------------------------------------------------------------------
# The weight.


def _dims_indexed(i) -> int:
    """How many leading dims one element of an index consumes (None adds one, consumes none)."""
    if i is None:
        return 0
    if isinstance(i, (torch.Tensor, np.ndarray)) and i.dtype in (torch.bool, np.bool_):
        return i.ndim
    return 1


@dataclass(frozen=True, eq=False, repr=False)
class GgufWeight:
    """A GGUF-quantized weight of logical shape [..., N, K], kept as its block fields."""

    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical torch shape [..., N, K]; K a multiple of the block size
    planes: dict[str, torch.Tensor]  # the block fields, each [..., N, K // block_size(, bytes)]
    dtype: torch.dtype  # what dequantize() returns by default (the model dtype)

    def __repr__(self) -> str:
        return f"GgufWeight({self.qtype.name}, shape={self.shape}, dtype={self.dtype}, device={self.device})"

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.planes.values())).device

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[..., N, K] in dtype (default self.dtype), computed in float32 as ggml does."""
        out = _DEQUANT[self.qtype](self.planes)  # float32 [..., N, nb, block values]
        return out.reshape(self.shape).to(self.dtype if dtype is None else dtype)

    def __getitem__(self, index) -> GgufWeight:
        """Index the leading dims, up to and including N (w[e]: one expert of [E, N, K]; w[a:b]:
        rows of [N, K]); K is not indexable."""
        index = index if isinstance(index, tuple) else (index,)
        lead = len(self.shape) - 1
        if any(i is Ellipsis for i in index):
            raise IndexError("GgufWeight takes no Ellipsis: index its leading dims explicitly")
        if sum(_dims_indexed(i) for i in index) > lead:
            raise IndexError(f"GgufWeight of shape {self.shape} indexes its first {lead} dims only, not K")
        planes = {name: p[index] for name, p in self.planes.items()}
        p = planes["d"]  # every type has one: float16 [..., nb]
        return GgufWeight(self.qtype, (*p.shape[:-1], self.shape[-1]), planes, self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """An embedding lookup on a 2-D [N, K] weight: ids [...] -> [..., K] in self.dtype,
        dequantizing only those rows."""
        if len(self.shape) != 2:
            raise ValueError(f"rows() needs a 2-D weight, this one is {self.shape}")
        flat = ids.reshape(-1).to(self.device, torch.long)  # [T]
        picked = {name: p.index_select(0, flat) for name, p in self.planes.items()}
        out = GgufWeight(self.qtype, (flat.numel(), self.shape[1]), picked, self.dtype).dequantize()
        return out.reshape(*ids.shape, self.shape[1])

    def to(self, device) -> GgufWeight:
        planes = {name: p.to(device) for name, p in self.planes.items()}
        return GgufWeight(self.qtype, self.shape, planes, self.dtype)


# ---------------------------------------------------------------------------------------------
# Raw GGUF bytes in and out.


def _kept(qtype) -> GGMLQuantizationType:
    qtype = Q(qtype)
    if qtype not in KEPT_TYPES:
        kept = ", ".join(sorted(t.name for t in KEPT_TYPES))
        raise ValueError(f"GGUF type {qtype.name} is not kept quantized (kept: {kept}); use dequantize_raw")
    return qtype


def _blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    """Blocks per row (nb), checking that K is a whole number of blocks."""
    block, _ = GGML_QUANT_SIZES[qtype]
    if len(shape) == 0 or shape[-1] % block:
        raise ValueError(f"{qtype.name} needs a last dim that is a multiple of {block}, got {tuple(shape)}")
    return shape[-1] // block


def _check_bytes(raw, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    dtype = raw.dtype
    if dtype not in (np.uint8, torch.uint8):
        raise ValueError(f"{qtype.name} raw data must be uint8 bytes, got {dtype}")
    size = raw.size if isinstance(raw, np.ndarray) else raw.numel()
    _, type_size = GGML_QUANT_SIZES[qtype]
    want = math.prod(shape[:-1]) * _blocks(shape, qtype) * type_size
    if size != want:
        raise ValueError(
            f"{qtype.name} weight of shape {shape} takes {want} bytes "
            f"({_blocks(shape, qtype)} blocks of {type_size} bytes per row), got {size}"
        )


def _plane(field, dtype: torch.dtype) -> torch.Tensor:
    """One field of every block, uint8 [..., nb, bytes] (numpy or torch, possibly a view of a
    memmap) -> a contiguous copy: float16 [..., nb], or int8/uint8 [..., nb, bytes]."""
    if isinstance(field, np.ndarray):
        t = torch.from_numpy(np.array(field))  # np.array copies (and drops the memmap)
    else:
        t = field.clone(memory_format=torch.contiguous_format)
    t = t.view(dtype)
    return t.squeeze(-1) if dtype == _F16 else t


def from_raw(raw, qtype, shape: tuple[int, ...], dtype: torch.dtype) -> GgufWeight:
    """GGUF bytes (uint8 [..., N, K // block_size * type_size], numpy as GGUFReader gives them, or
    torch) of a tensor of torch-order shape [..., N, K] -> a GgufWeight (planes copied out)."""
    qtype = _kept(qtype)
    shape = tuple(int(s) for s in shape)
    _check_bytes(raw, qtype, shape)
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(*shape[:-1], _blocks(shape, qtype), type_size)  # [..., N, nb, type_size]
    planes, start = {}, 0
    for name, size, field_dtype in _FIELDS[qtype]:
        planes[name] = _plane(blocks[..., start:start + size], field_dtype)
        start += size
    return GgufWeight(qtype, shape, planes, dtype)


def _join(planes: dict[str, torch.Tensor], qtype: GGMLQuantizationType) -> torch.Tensor:
    """Planes -> GGUF bytes, uint8 [..., N, nb * type_size] (the inverse of from_raw's split)."""
    fields = []
    for name, _, dtype in _FIELDS[qtype]:
        p = planes[name].contiguous()
        fields.append((p.unsqueeze(-1) if dtype == _F16 else p).view(_U8))  # [..., nb, bytes]
    blocks = torch.cat(fields, dim=-1)  # [..., N, nb, type_size]
    return blocks.flatten(-2)


def _float_raw(raw, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """A float GGUF tensor (numpy float32/float16 from GGUFReader, or bytes: BF16 always comes as
    uint8) -> a torch copy in its own dtype, [shape]."""
    t = torch.from_numpy(np.array(raw)) if isinstance(raw, np.ndarray) else raw.clone()
    dtype = _TORCH_FLOAT[qtype]
    want = math.prod(shape) * (1 if t.is_floating_point() else dtype.itemsize // t.element_size())
    if t.numel() != want:
        raise ValueError(f"{qtype.name} tensor of shape {shape} takes {want} elements of {t.dtype}, "
                         f"got {t.numel()}")
    if not t.is_floating_point():  # its bytes
        t = t.contiguous().reshape(-1).view(dtype)
    return t.reshape(shape)


def dequantize_raw(raw, qtype, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """GGUF data of any type gguf.quants can read -> torch [shape] in dtype: floats converted,
    kept types through the torch dequantizers, the rest (Q2_K, Q3_K, IQ*) through gguf.quants."""
    qtype, shape = Q(qtype), tuple(int(s) for s in shape)
    if qtype in FLOAT_TYPES:
        return _float_raw(raw, qtype, shape).to(dtype)
    if qtype in KEPT_TYPES:
        return from_raw(raw, qtype, shape, dtype).dequantize()
    _check_bytes(raw, qtype, shape)
    data = raw if isinstance(raw, np.ndarray) else raw.cpu().numpy()
    byte_shape = (*shape[:-1], _blocks(shape, qtype) * GGML_QUANT_SIZES[qtype][1])
    try:
        out = gguf_quants.dequantize(data.reshape(byte_shape), qtype)  # float32 [..., N, K]
    except NotImplementedError as e:
        raise ValueError(f"GGUF type {qtype.name} cannot be dequantized (gguf.quants: {e})") from e
    return torch.from_numpy(out).reshape(shape).to(dtype)


def _first(parts: Sequence[GgufWeight], what: str) -> GgufWeight:
    if not parts:
        raise ValueError(f"{what} needs at least one weight")
    return parts[0]


def cat_rows(parts: Sequence[GgufWeight]) -> GgufWeight:
    """Concatenate weights [..., N_i, K] along N (e.g. q/k/v projections into one)."""
    first = _first(parts, "cat_rows")
    if len(first.shape) < 2:
        raise ValueError(f"cat_rows needs weights of at least 2 dims, got {first.shape}")

    def kind(w):  # all but N
        return w.qtype, w.shape[:-2], w.shape[-1], w.dtype

    for w in parts[1:]:
        if kind(w) != kind(first):
            raise ValueError(f"cat_rows needs one qtype, leading dims, K and dtype: {first!r} vs {w!r}")
    dim = len(first.shape) - 2  # N, in every plane
    planes = {name: torch.cat([w.planes[name] for w in parts], dim=dim) for name in first.planes}
    n = sum(w.shape[-2] for w in parts)
    return GgufWeight(first.qtype, (*first.shape[:-2], n, first.shape[-1]), planes, first.dtype)


def stack(parts: Sequence[GgufWeight]) -> GgufWeight:
    """Stack same-shaped weights along a new leading dim (e.g. experts into [E, N, K])."""
    first = _first(parts, "stack")
    for w in parts[1:]:
        if (w.qtype, w.shape, w.dtype) != (first.qtype, first.shape, first.dtype):
            raise ValueError(f"stack needs one qtype, shape and dtype: {first!r} vs {w!r}")
    planes = {name: torch.stack([w.planes[name] for w in parts]) for name in first.planes}
    return GgufWeight(first.qtype, (len(parts), *first.shape), planes, first.dtype)


# ---------------------------------------------------------------------------------------------
# Quantizers (for writing GGUF files).


def _f16_at_least(x: torch.Tensor) -> torch.Tensor:
    """x >= 0, float32 -> the nearest float16, moved up one ulp where that is below x, so a scale
    derived from it never needs more than its field's largest code."""
    h = x.to(_F16)
    up = (h.view(torch.int16) + 1).view(_F16)
    return torch.where(h.float() < x, up, h)


def _ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b, 0 where b == 0 (an all-zero block or sub-block)."""
    return torch.where(b > 0, a / b, torch.zeros_like(a))


def _quantize_k_min_max(x: torch.Tensor, levels: int):
    """Q4_K (levels 15) / Q5_K (31): x float32 [..., nb, 8, 32] -> d, dmin float16 [..., nb],
    the 6-bit sub-block scales and mins uint8 [..., nb, 8], values uint8 [..., nb, 8, 32].

    A plain min/max quantizer, not llama.cpp's make_qkx2_quants search. A reader computes
    d * scale * q - dmin * min per sub-block, min >= 0, so each sub-block's offset is its minimum
    clipped to <= 0. Its 6-bit min is rounded to nearest against dmin (the largest over the
    super-block / 63, float16 rounded up); the scale is then the *ceiling* against d, chosen so the
    values above the quantized offset fit in `levels` steps: no value clips, and the error is at
    most half a step (values a rounded-up offset puts below zero, at most dmin / 2)."""
    low = x.amin(-1).clamp(max=0)  # [..., nb, 8]
    dmin = _f16_at_least(-low.amin(-1) / 63)  # [..., nb]
    mins = torch.round(_ratio(-low, dmin.float().unsqueeze(-1))).clamp(0, 63)  # [..., nb, 8]
    offset = dmin.float().unsqueeze(-1) * mins  # what the reader subtracts, [..., nb, 8]
    span = (x.amax(-1) + offset).clamp(min=0)  # [..., nb, 8] to cover from -offset up
    d = _f16_at_least(span.amax(-1) / (levels * 63))  # [..., nb]
    scales = torch.ceil(_ratio(span, levels * d.float().unsqueeze(-1))).clamp(0, 63)  # [..., nb, 8]
    step = (d.float().unsqueeze(-1) * scales).unsqueeze(-1)  # [..., nb, 8, 1]
    q = torch.round(_ratio(x + offset.unsqueeze(-1), step)).clamp(0, levels)  # [..., nb, 8, 32]
    return d, dmin, scales.to(_U8), mins.to(_U8), q.to(_U8)


def _pack_scale_min_k4(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8] 6-bit scales and mins -> ggml's 12 packed bytes (see _scale_min_k4)."""
    a = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    b = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    c = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return torch.cat((a, b, c), dim=-1)  # [..., 12]


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2, L] values < 16 -> [..., L] bytes (first row low nibbles); _nibbles' inverse."""
    return q[..., 0, :] | (q[..., 1, :] << 4)


def _pack_bits(q: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., 8 // width, L] values < 2**width -> [..., L] bytes, row s in bits width*s up."""
    out = torch.zeros_like(q[..., 0, :])
    for row, shift in enumerate(range(0, 8, width)):
        out |= q[..., row, :] << shift
    return out


def _quantize_q4_k(x: torch.Tensor) -> dict[str, torch.Tensor]:
    d, dmin, sc, mn, q = _quantize_k_min_max(x.unflatten(-1, (8, 32)), 15)  # q [..., nb, 8, 32]
    qs = _pack_nibbles(q.unflatten(-2, (4, 2))).flatten(-2)  # [..., nb, 128]
    return {"d": d, "dmin": dmin, "scales": _pack_scale_min_k4(sc, mn), "qs": qs}


def _quantize_q5_k(x: torch.Tensor) -> dict[str, torch.Tensor]:
    d, dmin, sc, mn, q = _quantize_k_min_max(x.unflatten(-1, (8, 32)), 31)  # q [..., nb, 8, 32]
    qs = _pack_nibbles((q & 15).unflatten(-2, (4, 2))).flatten(-2)  # [..., nb, 128]
    qh = _pack_bits(q >> 4, 1)  # [..., nb, 32]: bit s from sub-block s
    return {"d": d, "dmin": dmin, "scales": _pack_scale_min_k4(sc, mn), "qh": qh, "qs": qs}


def _quantize_q6_k(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x float32 [..., nb, 256] -> Q6_K planes. Simple, not llama.cpp's make_qx_quants: each
    16-value sub-block's step is its largest |value| / 31.5, so every value lands in [-31.5, 31.5]
    and rounds into the 6-bit range -32..31 within half a step; the int8 scale is that step's
    ceiling against d = the largest step / 127 (float16 rounded up), so it never clips."""
    x = x.unflatten(-1, (16, 16))  # [..., nb, 16, 16]
    want = x.abs().amax(-1) / 31.5  # [..., nb, 16]
    d = _f16_at_least(want.amax(-1) / 127)  # [..., nb]
    scales = torch.ceil(_ratio(want, d.float().unsqueeze(-1))).clamp(0, 127)  # [..., nb, 16]
    step = (d.float().unsqueeze(-1) * scales).unsqueeze(-1)  # [..., nb, 16, 1]
    q = (torch.round(_ratio(x, step)).clamp(-32, 31) + 32).to(_U8).flatten(-2)  # [..., nb, 256] in 0..63
    ql = _pack_nibbles((q & 15).unflatten(-1, (2, 2, 64))).flatten(-2)  # [..., nb, 128]
    qh = _pack_bits((q >> 4).unflatten(-1, (2, 4, 32)), 2).flatten(-2)  # [..., nb, 64]
    return {"ql": ql, "qh": qh, "scales": scales.to(_I8), "d": d}


_K_QUANTIZERS = {Q.Q4_K: _quantize_q4_k, Q.Q5_K: _quantize_q5_k, Q.Q6_K: _quantize_q6_k}


def quantize(tensor: torch.Tensor, qtype) -> np.ndarray:
    """A float tensor [..., N, K] -> what GGUFWriter.add_tensor(name, array, raw_dtype=qtype)
    takes: float32/float16 values for F32/F16, GGUF bytes uint8 [..., N, K // block * type_size]
    for BF16 (as gguf.quants.quantize gives them) and every kept type."""
    qtype = Q(qtype)
    x = tensor.detach().cpu()
    if qtype in FLOAT_TYPES:
        x = x.to(_TORCH_FLOAT[qtype]).contiguous()
        if qtype == Q.BF16:  # numpy has no bfloat16: its bytes, [..., 2 K]
            x = x.view(_U8)
        return np.array(x.numpy())
    qtype = _kept(qtype)
    x = x.to(torch.float32)
    nb = _blocks(tuple(x.shape), qtype)
    if qtype in _K_QUANTIZERS:
        planes = _K_QUANTIZERS[qtype](x.reshape(*x.shape[:-1], nb, GGML_QUANT_SIZES[qtype][0]))
        return _join(planes, qtype).numpy()
    return gguf_quants.quantize(x.numpy(), qtype)
