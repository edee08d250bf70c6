"""The cpu backend's GEMMs against weights: oneDNN's packed layout where it is faster, F.linear
otherwise, both giving x @ W.T."""
import pytest
import torch

from mindspec.backend import LinearWeight
from mindspec.backends.cpu import linear as packed_linear
from mindspec.backends.cpu import rows_gemm
from mindspec.backends.cpu.backend import CpuBackend

pytestmark = pytest.mark.skipif(not packed_linear.packing_enabled(), reason="torch built without oneDNN")


class _NoFLinear:
    """Stands in for torch.nn.functional inside linear.py: any F.linear call fails the test, so a
    passing result proves the packed path computed it."""

    @staticmethod
    def linear(*_):
        raise AssertionError("F.linear was called")


def _weight(out_features, in_features, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=g) * 0.1).to(dtype)


@pytest.mark.parametrize("rows", [1, 2, 4, 16, 100])
def test_packed_gemm_equals_x_times_w_transposed(monkeypatch, rows):
    w = CpuBackend().linear_weight(_weight(96, 40))
    assert w.packed is not None
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ w.weight.double().T
    monkeypatch.setattr(packed_linear, "PACKED_MIN_MACS", 0)
    monkeypatch.setattr(packed_linear, "F", _NoFLinear)
    out = CpuBackend().linear(x, w)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_packed_gemm_takes_strided_and_batched_inputs(monkeypatch):
    w = CpuBackend().linear_weight(_weight(64, 32))
    monkeypatch.setattr(packed_linear, "PACKED_MIN_MACS", 0)
    monkeypatch.setattr(packed_linear, "F", _NoFLinear)
    wide = torch.randn(8, 50)
    strided = wide[:, 5:37]  # a column slice, as q_a out of the fused qkv_a GEMM
    torch.testing.assert_close(CpuBackend().linear(strided, w), strided @ w.weight.T)
    batched = torch.randn(2, 3, 32)
    assert CpuBackend().linear(batched, w).shape == (2, 3, 64)
    torch.testing.assert_close(CpuBackend().linear(batched, w), batched @ w.weight.T)
    assert CpuBackend().linear(torch.randn(0, 32), w).shape == (0, 64)


def test_bfloat16_weights_are_packed_where_the_cpu_can(monkeypatch):
    w = CpuBackend().linear_weight(_weight(64, 32, torch.bfloat16))
    assert (w.packed is not None) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if w.packed is None:  # an AVX2-only cpu: bfloat16 runs on F.linear, and packing it would raise
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(w.weight.contiguous())
        return
    monkeypatch.setattr(packed_linear, "PACKED_MIN_MACS", 0)
    monkeypatch.setattr(packed_linear, "F", _NoFLinear)
    x = torch.randn(8, 32).to(torch.bfloat16)
    out = CpuBackend().linear(x, w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ w.weight.float().T, atol=2e-2, rtol=2e-2)


def test_small_products_stay_on_f_linear(monkeypatch):
    """The rule: rows * in * out below PACKED_MIN_MACS runs F.linear, from it on packed."""
    w = CpuBackend().linear_weight(_weight(128, 64))  # 8192 MACs a row
    calls = []
    real = packed_linear.F

    class _Spy:
        @staticmethod
        def linear(x, weight):
            calls.append(x.shape[0])
            return real.linear(x, weight)

    monkeypatch.setattr(packed_linear, "F", _Spy)
    monkeypatch.setattr(packed_linear, "PACKED_MIN_MACS", 8192 * 4)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(CpuBackend().linear(x, w), x @ w.weight.T)
    assert calls == [1, 3]


def test_no_packing_where_it_cannot_be_used(monkeypatch):
    backend = CpuBackend()
    assert backend.linear_weight(_weight(8, 4, torch.float16)).packed is None  # oneDNN: fp32 / bf16 here
    assert backend.linear_weight(torch.randn(2, 3, 4)).packed is None
    monkeypatch.setenv(packed_linear.ENV_SWITCH, "0")
    off = CpuBackend()
    assert not off.pack_weights and off.linear_weight(_weight(8, 4)).packed is None
    x = torch.randn(3, 4)
    w = off.linear_weight(_weight(8, 4))
    torch.testing.assert_close(off.linear(x, w), x @ w.weight.T)


def test_compiled_graphs_and_mismatched_dtypes_use_the_plain_weight(monkeypatch):
    w = CpuBackend().linear_weight(_weight(16, 8))
    calls = []
    real = packed_linear.F

    class _Spy:
        @staticmethod
        def linear(x, weight):
            calls.append(weight is w.weight)
            return real.linear(x, weight)

    monkeypatch.setattr(packed_linear, "F", _Spy)
    monkeypatch.setattr(packed_linear, "PACKED_MIN_MACS", 0)
    CpuBackend().linear(torch.randn(4, 8, dtype=torch.float64), LinearWeight(w.weight.double(), w.packed))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a traced graph keeps F.linear
    CpuBackend().linear(torch.randn(4, 8), w)
    assert calls == [False, True]


def test_packing_stops_before_memory_runs_short(monkeypatch):
    """A packed copy doubles a weight: past the point where a quarter of memory would no longer be
    free, weights stay unpacked (and run F.linear), so a big checkpoint keeps room for its cache."""
    backend = CpuBackend()
    weight = _weight(256, 256)  # 256 KiB
    total = 1 << 30
    monkeypatch.setattr(backend, "mem_get_info", lambda: (total // 4 + (512 << 10), total))
    assert backend.linear_weight(weight).packed is not None
    monkeypatch.setattr(backend, "mem_get_info", lambda: (total // 4 + (128 << 10), total))
    small = backend.linear_weight(weight)
    assert small.packed is None
    x = torch.randn(64, 256)
    torch.testing.assert_close(backend.linear(x, small), x @ weight.T)


def test_narrow_copy_only_where_every_value_fits():
    """A float32 weight whose values are all bfloat16 (a bfloat16 checkpoint run in float32)
    gets a bfloat16 copy holding the same values; one value off the bfloat16 grid, or a weight
    already narrow, gets none."""
    exact = _weight(12, 8, torch.bfloat16).float()
    half = packed_linear.narrow(exact)
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), exact)
    kept = CpuBackend().linear_weight(exact)
    assert (kept.blocked if rows_gemm.supported() else kept.narrow) is not None  # blocked: test_rows_gemm.py
    off_grid = exact.clone()
    off_grid[3, 5] += 2.0 ** -20
    assert packed_linear.narrow(off_grid) is None
    assert CpuBackend().linear_weight(off_grid).narrow is None
    assert packed_linear.narrow(exact.to(torch.bfloat16)) is None


def test_compiled_thin_gemms_read_the_narrow_weight(monkeypatch):
    """Inside a compiled graph up to THIN_MAX_ROWS rows run thin_linear on ``narrow``; more rows
    run F.linear on the float32 weight (here the two hold different values to tell them apart)."""
    w = LinearWeight(_weight(24, 16), narrow=_weight(24, 16, torch.bfloat16, seed=1))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    thin = torch.randn(packed_linear.THIN_MAX_ROWS, 16)
    torch.testing.assert_close(packed_linear.linear(thin, w), thin @ w.narrow.float().T)
    wide = torch.randn(packed_linear.THIN_MAX_ROWS + 1, 16)
    torch.testing.assert_close(packed_linear.linear(wide, w), wide @ w.weight.T)


def test_compiled_thin_gemm_gives_a_row_the_same_result_in_any_batch():
    """Compiled by Inductor, thin_linear sums each output in one order whatever the row count:
    a row's result is bitwise the same alone and among others (a decode step and an MTP
    verification of the same token agree), and equals x @ W.T to rounding."""
    weight = _weight(64, 48, torch.bfloat16)
    x = torch.randn(4, 2, 48)
    step = torch.compile(packed_linear.thin_linear, backend="inductor", fullgraph=True, dynamic=False)
    together = step(x, weight)  # [4, 2, 64]
    alone = step(x[1:2], weight)
    assert torch.equal(alone[0], together[1])
    torch.testing.assert_close(together, x @ weight.float().T, atol=1e-5, rtol=1e-5)


def _normed_thin_gemm(x, weight):
    """An rms norm feeding a thin GEMM, as every decoder layer's first projection."""
    return packed_linear.thin_linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), weight)


def _compiled_nodes(fn, *args) -> tuple[int, torch.Tensor]:
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    out = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)(*args)
    return metrics.ir_nodes_pre_fusion, out


def test_compiled_thin_gemm_stores_its_input_once(monkeypatch):
    """Inductor would inline the norm into the GEMM's reduction and recompute it for each output
    (the draft lm_head: 122 -> 79 us); thin_linear makes its input a buffer of its own (one IR
    node more than the inlined form) and computes the same floats."""
    weight, x = _weight(64, 48, torch.bfloat16), torch.randn(2, 48)
    stored, out = _compiled_nodes(_normed_thin_gemm, x, weight)
    monkeypatch.setattr(packed_linear, "materialized", lambda t: t)
    inlined, reference = _compiled_nodes(_normed_thin_gemm, x, weight)
    assert stored == inlined + 1
    assert torch.equal(out, reference)
