"""GGUF quantized weights kept quantized (mindspec/modeling/gguf_quants.py): the torch dequantizers
against gguf-py's numpy ones (the independent reference) bit for bit, on our quantizer's blocks and
on random bytes; the quantizers against gguf-py's bytes and against error bounds argued from each
format; the weight's indexing, row lookup, concatenation and stacking against the same operation on
the dequantized tensor; the errors; a GGUF file written and read back through gguf-py."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from mindspec.modeling.gguf_quants import (
    FLOAT_TYPES,
    KEPT_TYPES,
    GgufWeight,
    cat_rows,
    dequantize_raw,
    from_raw,
    quantize,
    stack,
)

KEPT = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_QUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}  # gguf-py cannot quantize these: ours
# (leading dims, blocks per row): 2-D with one block (K = block size) and several, 3-D expert stacks
SHAPES = [((3,), 1), ((5,), 3), ((2, 3), 2), ((4, 1), 1)]
F16_ULP = 2.0**-10  # relative gap between float16 neighbours (normal range); rounding is half that
F16_TINY = 2.0**-24  # float16's smallest subnormal: an absolute bound on its rounding


def _f16_error(v):
    """How far float16 rounding to nearest moves v: half an ulp, relative or (subnormal) absolute."""
    return v.abs() * 2.0**-11 + F16_TINY / 2


def _shape(qtype, lead, blocks):
    return (*lead, blocks * GGML_QUANT_SIZES[qtype][0])


def _weights(shape, seed=0):
    """Random values whose scale (0.05 to 2.7) and offset change every 16 values, so sub-blocks of
    one super-block differ, plus a zero row, a constant row and a row of one sign."""
    g = torch.Generator().manual_seed(seed)
    groups = (*shape[:-1], shape[-1] // 16, 1)
    scale = torch.exp(torch.rand(groups, generator=g) * 4 - 3)
    offset = (torch.rand(groups, generator=g) * 2 - 1) * scale
    x = ((torch.randn(*shape[:-1], shape[-1] // 16, 16, generator=g) * scale) + offset).reshape(shape)
    rows = x.reshape(-1, shape[-1])
    if rows.shape[0] >= 3:
        rows[0] = 0.0
        rows[1] = 0.5
        rows[2] = rows[2].abs()
    return x


def _reference(raw, qtype):
    return torch.from_numpy(gguf_quants.dequantize(raw, qtype))


# ---------------------------------------------------------------------------------------------
# Error bounds, from the data and each format's quantizer (never from the quantized output).


def _blocks_of(x, size):
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)  # [..., nb, size]


def _bound_q8_0(x):
    # d = max|x| / 127, values round to nearest: half a step, plus |q| <= 127 times d's float16
    # rounding.
    d = _blocks_of(x, 32).abs().amax(-1, keepdim=True) / 127
    return (d / 2 + 127 * _f16_error(d)).expand(*d.shape[:-1], 32)


def _bound_symmetric(x, half_levels):
    # Q4_0 / Q5_0: d = (the value of largest magnitude) / -half_levels, so x / d lies in
    # [-half_levels, half_levels]; codes reach half_levels - 1 only, so values above
    # half_levels - 0.5 steps clip (error <= one step), the rest round (half a step). Plus
    # |q| <= half_levels times d's float16 rounding.
    b = _blocks_of(x, 32)
    extreme = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))  # the first largest |x|
    d = extreme / -half_levels
    t = torch.where(d != 0, b / d, torch.zeros_like(b))
    steps = torch.where(t > half_levels - 0.5 - 1e-4, 1.0, 0.5)
    return d.abs() * steps + half_levels * _f16_error(d)


def _bound_min_max(x, levels):
    # Q4_1 / Q5_1: d = (max - min) / levels from the block minimum m: half a step, plus
    # levels * d's and m's float16 roundings.
    b = _blocks_of(x, 32)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / levels
    return (d / 2 + levels * _f16_error(d) + _f16_error(lo)).expand_as(b)


def _bound_k_min(x, levels):
    # Q4_K (levels 15) / Q5_K (31), our quantizer: per 32-value sub-block, offset = the minimum
    # clipped to <= 0 (R = max - offset), its 6-bit code rounded against dmin = (largest offset over
    # the super-block) / 63 (float16, rounded up); the scale the ceiling against d = (largest
    # R + dmin / 2) / (levels * 63), so step <= (R + dmin / 2) / levels + d and nothing clips. The
    # error is at most half a step, or half of dmin (values a rounded-up offset puts below zero).
    sb = x.reshape(*x.shape[:-1], x.shape[-1] // 256, 8, 32)
    low = sb.amin(-1, keepdim=True).clamp(max=0)
    r = sb.amax(-1, keepdim=True) - low  # [..., nb, 8, 1]
    dmin = (-low).amax(-2, keepdim=True) / 63 * (1 + F16_ULP) + F16_TINY
    d = (r.amax(-2, keepdim=True) + dmin / 2) / (levels * 63) * (1 + F16_ULP) + F16_TINY
    step = (r + dmin / 2) / levels + d
    return torch.maximum(step, dmin).div(2).expand_as(sb)


def _bound_q6_k(x):
    # Q6_K, our quantizer: per 16 values, step >= max|x| / 31.5 so x / step lies in [-31.5, 31.5]
    # and rounds into -32..31 within half a step; the int8 scale is the ceiling against
    # d = (largest step over the super-block) / 127, so step <= max|x| / 31.5 + d.
    sb = x.reshape(*x.shape[:-1], x.shape[-1] // 256, 16, 16)
    want = sb.abs().amax(-1, keepdim=True) / 31.5
    d = want.amax(-2, keepdim=True) / 127 * (1 + F16_ULP) + F16_TINY
    return ((want + d) / 2).expand_as(sb)


BOUNDS = {
    Q.Q8_0: _bound_q8_0,
    Q.Q4_0: lambda x: _bound_symmetric(x, 8),
    Q.Q5_0: lambda x: _bound_symmetric(x, 16),
    Q.Q4_1: lambda x: _bound_min_max(x, 15),
    Q.Q5_1: lambda x: _bound_min_max(x, 31),
    Q.Q4_K: lambda x: _bound_k_min(x, 15),
    Q.Q5_K: lambda x: _bound_k_min(x, 31),
    Q.Q6_K: _bound_q6_k,
}


# ---------------------------------------------------------------------------------------------
# Quantize -> dequantize, against gguf-py.


@pytest.mark.parametrize("lead,blocks", SHAPES)
@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_round_trip_matches_gguf_and_stays_within_the_format_bound(qtype, lead, blocks):
    shape = _shape(qtype, lead, blocks)
    x = _weights(shape, seed=blocks)
    raw = quantize(x, qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (*lead, blocks * type_size)
    if qtype not in K_QUANTS:  # (b) llama.cpp's reference quantizer, byte for byte
        assert np.array_equal(raw, gguf_quants.quantize(x.numpy(), qtype))
    w = from_raw(raw, qtype, shape, torch.bfloat16)
    y = w.dequantize(torch.float32)
    ref = _reference(raw, qtype)  # (a) the independent dequantizer
    assert y.dtype == torch.float32 and y.shape == shape and torch.equal(y, ref)
    err = (y - x).abs().reshape(-1)
    bound = BOUNDS[qtype](x).reshape(-1) * (1 + 1e-5) + 1e-6 * x.abs().max()  # (c) float32 slack
    worst = int((err - bound).argmax())
    assert err[worst] <= bound[worst], f"value {worst}: error {err[worst]:.3g} > bound {bound[worst]:.3g}"


def test_k_quants_are_about_as_accurate_as_the_32_value_types_of_their_bits():
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(1))

    def rms(qtype):
        return (dequantize_raw(quantize(x, qtype), qtype, x.shape, torch.float32) - x).pow(2).mean().sqrt()

    # Q4_K/Q5_K pay 6-bit sub-block scales and mins (Q4_1/Q5_1 have float16 ones); Q6_K's extra bit
    # halves Q5's error.
    assert rms(Q.Q4_K) < 1.1 * rms(Q.Q4_1)
    assert rms(Q.Q5_K) < 1.1 * rms(Q.Q5_1)
    assert rms(Q.Q6_K) < 0.6 * rms(Q.Q5_1)


# Offsets of the float16 fields in each block (ggml-common.h), which random bytes must keep finite.
F16_FIELDS = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108],
}


def _random_raw(qtype, shape, seed=0):
    """Random blocks: every code and packed scale possible, finite float16 scales of both signs."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = (rng.standard_normal(blocks.shape[:-1]) * 0.01).astype(np.float16)
        blocks[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


@pytest.mark.parametrize("qtype", KEPT + [Q.Q2_K, Q.Q3_K], ids=lambda q: q.name)
def test_any_valid_blocks_dequantize_as_gguf_does(qtype):
    for i, shape in enumerate([_shape(qtype, (3,), 2), _shape(qtype, (2, 2), 1)]):
        raw = _random_raw(qtype, shape, seed=i)
        ref = _reference(raw, qtype)
        assert torch.equal(dequantize_raw(raw, qtype, shape, torch.float32), ref)
        assert torch.equal(dequantize_raw(torch.from_numpy(raw), qtype, shape, torch.float32), ref)
        assert torch.equal(dequantize_raw(raw, qtype, shape, torch.bfloat16), ref.to(torch.bfloat16))
        if qtype in KEPT_TYPES:
            assert torch.equal(from_raw(raw, qtype, shape, torch.float32).dequantize(), ref)


@pytest.mark.parametrize("qtype", sorted(FLOAT_TYPES), ids=lambda q: q.name)
def test_float_types_quantize_as_gguf_and_convert_back(qtype):
    x = _weights((4, 48))
    raw = quantize(x, qtype)
    if qtype == Q.BF16:  # bytes, as gguf-py gives them
        assert raw.dtype == np.uint8 and np.array_equal(raw, gguf_quants.quantize(x.numpy(), qtype))
        expect = x.to(torch.bfloat16)
    else:
        dtype = {Q.F32: torch.float32, Q.F16: torch.float16}[qtype]
        assert np.array_equal(raw, gguf_quants.quantize(x.numpy(), qtype)) and raw.shape == (4, 48)
        expect = x.to(dtype)
    for data in (raw, torch.from_numpy(raw)):
        out = dequantize_raw(data, qtype, (4, 48), torch.float32)
        assert out.shape == (4, 48) and torch.equal(out, expect.float())


def test_a_gguf_file_written_and_read_back(tmp_path):
    path = tmp_path / "w.gguf"
    types = KEPT + sorted(FLOAT_TYPES)
    shapes = {t: _shape(t, (2, 3), 2) if t in KEPT_TYPES else (2, 3, 64) for t in types}
    tensors = {t: _weights(shape, seed=int(t)) for t, shape in shapes.items()}
    writer = GGUFWriter(path, "llama")
    for t, x in tensors.items():
        writer.add_tensor(t.name, quantize(x, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = {r.name: r for r in GGUFReader(path).tensors}
    for t, x in tensors.items():
        r = read[t.name]
        shape = tuple(reversed(r.shape.tolist()))  # ggml lists dims innermost first
        assert r.tensor_type == t and shape == tuple(x.shape)
        expect = dequantize_raw(quantize(x, t), t, shape, torch.float32)
        assert torch.equal(dequantize_raw(r.data, t, shape, torch.float32), expect)
        if t in KEPT_TYPES:  # r.data is a memmap of the file: the planes are copies
            w = from_raw(r.data, t, shape, torch.float32)
            assert w.nbytes == r.n_bytes and torch.equal(w.dequantize(), expect)
            assert not any(np.shares_memory(p.numpy(), r.data) for p in w.planes.values())


# ---------------------------------------------------------------------------------------------
# The weight.


def _weight(qtype, shape, seed=0, dtype=torch.bfloat16):
    return from_raw(quantize(_weights(shape, seed), qtype), qtype, shape, dtype)


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_planes_are_the_gguf_bytes_split_by_field(qtype):
    shape = _shape(qtype, (2, 3), 2)
    raw = quantize(_weights(shape), qtype)
    w = from_raw(raw, qtype, shape, torch.bfloat16)
    assert w.nbytes == raw.nbytes and w.shape == shape and w.device == torch.device("cpu")
    for p in w.planes.values():
        assert p.is_contiguous() and p.shape[:3] == (2, 3, 2)  # [..., N, nb(, bytes)]
    raw[...] = 0  # the weight holds copies
    assert torch.equal(w.dequantize(torch.float32), _reference(quantize(_weights(shape), qtype), qtype))
    assert w.dequantize().dtype == torch.bfloat16
    assert torch.equal(w.dequantize(), w.dequantize(torch.float32).to(torch.bfloat16))
    assert torch.equal(w.to("cpu").dequantize(), w.dequantize())
    assert qtype.name in repr(w)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_indexing_matches_the_dequantized_tensor(qtype):
    experts = _weight(qtype, _shape(qtype, (3, 5), 2))  # [E, N, K]
    full = experts.dequantize(torch.float32)
    pick = torch.tensor([2, 0])
    mask = torch.tensor([True, False, True])
    indices = [1, -1, slice(1, 3), (0, 2), (2, slice(1, 4)), (slice(None), 3), pick, (1, pick), (None, 1), mask]
    for index in indices:
        part = experts[index]
        assert part.shape == full[index].shape and torch.equal(part.dequantize(torch.float32), full[index])
    matrix = experts[1]  # [N, K]
    assert torch.equal(matrix[1:4].dequantize(torch.float32), full[1, 1:4])
    assert torch.equal(matrix[2].dequantize(torch.float32), full[1, 2])  # one row, [K]
    with pytest.raises(IndexError, match="Ellipsis"):
        experts[..., 0]
    with pytest.raises(IndexError, match="not K"):
        matrix[0, 0]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q5_K], ids=lambda q: q.name)
def test_rows_looks_up_an_embedding(qtype):
    table = _weight(qtype, _shape(qtype, (7,), 2))
    full = table.dequantize()  # bfloat16, the weight's dtype
    for ids in (torch.tensor([3, 0, 3, 6]), torch.tensor([[1, 2], [5, 0]]), torch.zeros(0, dtype=torch.long)):
        out = table.rows(ids)
        assert out.dtype == torch.bfloat16 and torch.equal(out, full[ids])
    with pytest.raises(ValueError, match="2-D"):
        stack([table, table]).rows(torch.tensor([0]))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q6_K], ids=lambda q: q.name)
def test_cat_rows_and_stack_match_the_dequantized_tensors(qtype):
    a, b = _weight(qtype, _shape(qtype, (2,), 2), seed=1), _weight(qtype, _shape(qtype, (5,), 2), seed=2)
    both = cat_rows([a, b])
    assert both.shape == _shape(qtype, (7,), 2) and both.nbytes == a.nbytes + b.nbytes
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = _weight(qtype, b.shape, seed=5)
    experts = stack([b, c, b])  # [3, 5, K]
    assert experts.shape == (3, *b.shape)
    assert torch.equal(experts.dequantize(), torch.stack([b.dequantize(), c.dequantize(), b.dequantize()]))
    e1 = _weight(qtype, _shape(qtype, (2, 3), 2), seed=3)  # [E, N, K], N = 3 and 1
    e2 = _weight(qtype, _shape(qtype, (2, 1), 2), seed=4)
    assert torch.equal(cat_rows([e1, e2]).dequantize(), torch.cat([e1.dequantize(), e2.dequantize()], dim=-2))
    other = Q.Q5_0 if qtype != Q.Q5_0 else Q.Q8_0
    with pytest.raises(ValueError, match="qtype"):
        cat_rows([a, _weight(other, _shape(qtype, (2,), 2))])
    with pytest.raises(ValueError, match="K"):
        cat_rows([a, _weight(qtype, _shape(qtype, (2,), 1))])
    with pytest.raises(ValueError, match="shape"):
        stack([a, b])


# ---------------------------------------------------------------------------------------------
# Errors.


def test_from_raw_names_what_is_wrong():
    shape = (4, 64)
    raw = quantize(_weights(shape), Q.Q8_0)  # 4 x 2 blocks of 34 bytes
    with pytest.raises(ValueError, match=r"Q8_0 .*\(4, 64\) takes 272 bytes .* got 271"):
        from_raw(raw.reshape(-1)[:-1], Q.Q8_0, shape, torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        from_raw(raw, Q.Q8_0, (4, 68), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        from_raw(raw.view(np.int8), Q.Q8_0, shape, torch.float32)
    for qtype in (Q.Q2_K, Q.F16):
        with pytest.raises(ValueError, match=f"{qtype.name} is not kept quantized"):
            from_raw(raw, qtype, shape, torch.float32)
    assert isinstance(from_raw(raw.reshape(-1), Q.Q8_0, shape, torch.float32), GgufWeight)  # any byte shape


def test_dequantize_raw_and_quantize_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="Q8_K cannot be dequantized"):
        dequantize_raw(np.zeros(292, np.uint8), Q.Q8_K, (1, 256), torch.float32)
    with pytest.raises(ValueError, match="takes 84 bytes"):
        dequantize_raw(np.zeros(80, np.uint8), Q.Q2_K, (1, 256), torch.float32)
    with pytest.raises(ValueError, match="takes 6 elements"):
        dequantize_raw(np.zeros(5, np.float32), Q.F32, (2, 3), torch.float32)
    with pytest.raises(ValueError, match="takes 12 elements of torch.uint8, got 11"):
        dequantize_raw(np.zeros(11, np.uint8), Q.BF16, (2, 3), torch.float32)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(torch.zeros(2, 128), Q.Q4_K)
    with pytest.raises(ValueError, match="Q2_K is not kept quantized"):
        quantize(torch.zeros(2, 256), Q.Q2_K)
