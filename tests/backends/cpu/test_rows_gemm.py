"""The few-row GEMM of compiled cpu steps (backends/cpu/rows_gemm.py, rows_gemm.cpp)."""
import logging
import subprocess
import zipfile

import pytest
import torch
import torch.nn.functional as F

from mindspec.backend import LinearWeight
from mindspec.backends.cpu import linear as packed_linear
from mindspec.backends.cpu import rows_gemm
from mindspec.backends.cpu.backend import CpuBackend

needs_kernel = pytest.mark.skipif(not rows_gemm.supported(), reason="rows_gemm needs an AVX-512F cpu")


def _bf16_weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=g) * 0.1).to(torch.bfloat16)


def test_block_layout_pairs_outputs_j_and_16_plus_j_per_k():
    """Per block of 32 outputs and per input, 32-bit lane j holds output j (its low half) and
    output 16 + j (its high half); outputs past N are zeros."""
    w = _bf16_weight(70, 5)
    b = rows_gemm.block(w)
    assert b.shape == (3, 5, 32) and b.dtype == torch.bfloat16
    for out in (0, 15, 16, 31, 32, 69):
        j = out % 32
        lane = 2 * j if j < 16 else 2 * (j - 16) + 1
        assert torch.equal(b[out // 32, :, lane], w[out])
    lanes = b.view(torch.int32)  # [3, 5, 16] little-endian lanes: low half = output j
    assert torch.equal((lanes[0] << 16).view(torch.float32), w[:16].T.float())
    assert torch.equal((lanes[0] & -65536).view(torch.float32), w[16:32].T.float())
    assert not b[2, :, 12:].any() and not b[2, :, 1:12:2].any()  # outputs 70..95 do not exist


@needs_kernel
@pytest.mark.parametrize("out", [6, 16, 17, 80, 192, 1000])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8, 9, 20])
def test_rows_linear_equals_x_times_w_transposed(rows, out):
    w = _bf16_weight(out, 96)
    x = torch.randn(rows, 96)
    y = rows_gemm.rows_linear(x, rows_gemm.block(w), out)
    assert y.shape == (rows, out) and y.dtype == torch.float32
    torch.testing.assert_close(y, (x.double() @ w.double().T).float(), atol=2e-5, rtol=1e-5)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    """Each output sums over k in one order whatever the row count: a decode step's row and the
    same row in an MTP verification (or a bigger batch) agree bitwise."""
    w = rows_gemm.block(_bf16_weight(4096, 192))
    x = torch.randn(13, 192)
    alone = rows_gemm.rows_linear(x[5:6], w, 4096)
    for rows in (slice(5, 7), slice(2, 8), slice(0, 13)):
        together = rows_gemm.rows_linear(x[rows], w, 4096)
        assert torch.equal(together[5 - rows.start], alone[0])


@needs_kernel
def test_leading_dims_and_strided_inputs():
    w = _bf16_weight(48, 32)
    x = torch.randn(2, 3, 64)[..., ::2]  # [2, 3, 32], not contiguous
    y = rows_gemm.rows_linear(x, rows_gemm.block(w), 48)
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, x @ w.float().T, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_bad_inputs_name_what_is_wrong():
    w = rows_gemm.block(_bf16_weight(32, 16))
    with pytest.raises(RuntimeError, match="float32 x and bfloat16 blocked weight"):
        rows_gemm.rows_linear(torch.randn(2, 16, dtype=torch.float64), w, 32)
    with pytest.raises(RuntimeError, match="does not hold 40 outputs of 16 inputs"):
        rows_gemm.rows_linear(torch.randn(2, 16), w, 40)


@needs_kernel
def test_cpu_backend_keeps_bfloat16_exact_weights_blocked():
    """A bfloat16 checkpoint's float32 weight keeps one bfloat16 copy, in the kernel's layout
    (no row-major ``narrow`` beside it); a weight off the bfloat16 grid keeps none."""
    exact = _bf16_weight(40, 24).float()
    w = CpuBackend().linear_weight(exact)
    assert w.narrow is None and torch.equal(w.blocked, rows_gemm.block(exact.to(torch.bfloat16)))
    off_grid = exact.clone()
    off_grid[1, 2] += 2.0 ** -20
    assert CpuBackend().linear_weight(off_grid).blocked is None


@needs_kernel
def test_compiled_linear_takes_rows_linear_up_to_max_rows(monkeypatch):
    """Inside a traced step a GEMM of up to LINEAR_MAX_ROWS rows against a blocked weight runs
    rows_linear; more rows run F.linear on the float32 weight (the two hold different values
    here to tell them apart)."""
    w = LinearWeight(_bf16_weight(24, 16).float(), blocked=rows_gemm.block(_bf16_weight(24, 16, seed=1)))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    few = torch.randn(rows_gemm.LINEAR_MAX_ROWS, 16)
    torch.testing.assert_close(packed_linear.linear(few, w), few @ _bf16_weight(24, 16, seed=1).float().T)
    more = torch.randn(rows_gemm.LINEAR_MAX_ROWS + 1, 16)
    torch.testing.assert_close(packed_linear.linear(more, w), F.linear(more, w.weight))


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 4, 9, 64])
def test_rows_heads_equals_bmm_per_head(tokens):
    """MLA's absorbed products: x [T, H, K] (a view with row and head strides, as q_nope is) times
    each head's weight, as bmm computes them; a token's result is the same bits alone."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(4, 32, 72, generator=g) * 0.1).to(torch.bfloat16)  # [H, K, N], 72: a partial block
    q = torch.randn(tokens, 4, 48, generator=g)
    x = q[..., :32]
    y = rows_gemm.rows_heads(x, rows_gemm.block_heads(w), 72)
    assert y.shape == (tokens, 4, 72) and y.is_contiguous()
    expected = torch.bmm(x.transpose(0, 1).double(), w.double()).transpose(0, 1)
    torch.testing.assert_close(y.double(), expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(rows_gemm.rows_heads(x[-1:], rows_gemm.block_heads(w), 72)[0], y[-1])
    with pytest.raises(RuntimeError, match="does not hold 100 outputs"):
        rows_gemm.rows_heads(x, rows_gemm.block_heads(w), 100)


@needs_kernel
def test_cpu_backend_head_products_run_rows_heads_when_compiled(monkeypatch):
    """The cpu backend keeps bfloat16-exact per-head weights blocked; inside a traced step up to
    HEAD_MAX_TOKENS tokens run rows_heads, eagerly (and beyond) bmm: the same products."""
    w = (torch.randn(4, 16, 40) * 0.1).to(torch.bfloat16).float()
    be = CpuBackend()
    hw = be.head_weight(w)
    assert torch.equal(hw.blocked, rows_gemm.block_heads(w.to(torch.bfloat16)))
    x = torch.randn(3, 4, 16)
    eager = be.head_linear(x, hw)
    calls = []
    original = rows_gemm.rows_heads
    monkeypatch.setattr(rows_gemm, "rows_heads", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(be.head_linear(x, hw), eager, atol=2e-5, rtol=1e-5)
    wide = torch.randn(rows_gemm.HEAD_MAX_TOKENS + 1, 4, 16)
    torch.testing.assert_close(be.head_linear(wide, hw), torch.bmm(wide.transpose(0, 1), w).transpose(0, 1))
    assert calls == [3]
    off_grid = w.clone()
    off_grid[0, 0, 0] += 2.0 ** -20
    assert be.head_weight(off_grid).blocked is None


def _experts(num: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num, 2 * inter, hidden, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(num, hidden, inter, generator=g) * 0.1).to(torch.bfloat16)
    return w13, w2


@needs_kernel
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (4, 2), (6, 2), (13, 3), (40, 2)])
@pytest.mark.parametrize("hidden,inter", [(48, 24), (40, 20)])  # 40: a partial block of outputs
def test_rows_experts_equals_the_reference_experts(tokens, top_k, hidden, inter):
    import op_references as ref

    w13, w2 = _experts(6, hidden, inter)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=g)
    out = rows_gemm.rows_experts(x, ids, w, rows_gemm.block_experts(w13), rows_gemm.block_experts(w2), inter)
    expected = ref.moe_experts(x, w, ids, w13.float(), w2.float())
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_rows_experts_skip_other_ranks_experts_and_keep_a_tokens_bits():
    """An id outside [0, E) adds nothing; a token's output is bitwise the same alone and among
    other tokens (its experts' rows sum in one order whatever runs beside them)."""
    import op_references as ref

    w13, w2 = _experts(6, 32, 16, seed=2)
    b13, b2 = rows_gemm.block_experts(w13), rows_gemm.block_experts(w2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 32, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(11)])
    ids[4, 0], ids[7, 1] = -1, 6
    w = torch.rand(11, 2, generator=g)
    out = rows_gemm.rows_experts(x, ids, w, b13, b2, 16)
    keep = (ids >= 0) & (ids < 6)
    torch.testing.assert_close(out.double(), ref.moe_experts(x, w * keep, ids.clamp(0, 5), w13.float(), w2.float()),
                               atol=2e-5, rtol=1e-5)
    for t in (0, 4, 10):
        assert torch.equal(rows_gemm.rows_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], b13, b2, 16)[0], out[t])


@needs_kernel
def test_rows_experts_bad_shapes_name_what_is_wrong():
    w13, w2 = _experts(6, 32, 16)
    b13, b2 = rows_gemm.block_experts(w13), rows_gemm.block_experts(w2)
    x, ids, w = torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    with pytest.raises(RuntimeError, match="do not hold 6 experts of 32 -> 24"):
        rows_gemm.rows_experts(x, ids, w, b13, b2, 24)
    with pytest.raises(RuntimeError, match="do not match 3 tokens"):
        rows_gemm.rows_experts(x, ids[:2], w[:2], b13, b2, 16)


class _Gemms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w1", rows_gemm.block(_bf16_weight(64, 32)))
        self.register_buffer("w2", rows_gemm.block(_bf16_weight(20, 64, seed=1)))

        w13, w2 = _experts(4, 20, 8)
        self.register_buffer("w13", rows_gemm.block_experts(w13))
        self.register_buffer("e2", rows_gemm.block_experts(w2))
        self.register_buffer("wh", rows_gemm.block_heads(_bf16_weight(8, 10).view(2, 4, 10)))

    def forward(self, x):
        h = rows_gemm.rows_linear(torch.relu(rows_gemm.rows_linear(x, self.w1, 64)), self.w2, 20)
        ids = torch.topk(h[:, :4], 2, dim=-1)[1]
        h = rows_gemm.rows_experts(h, ids, torch.ones_like(h[:, :2]), self.w13, self.e2, 8)
        return rows_gemm.rows_heads(h[:, :8].view(-1, 2, 4), self.wh, 10)


@needs_kernel
@pytest.mark.slow
def test_package_calls_the_c_shim_directly(tmp_path, monkeypatch):
    """An AOTInductor package of a step calling rows_linear calls the kernel's C function (no
    proxy executor) and computes what the op computes eagerly."""
    from mindspec.modeling import exported_step

    monkeypatch.setenv(exported_step.AUTOTUNE_ENV, "0")
    module, x = _Gemms(), torch.randn(4, 32)
    program = torch.export.export(module, (x,))
    path = tmp_path / "gemms.pt2"
    exported_step.compile_package(program, path, CpuBackend().step_kernels())
    with zipfile.ZipFile(path) as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_rows_linear(") >= 2 and wrapper.count("aoti_torch_cpu_rows_experts(") >= 1
    assert wrapper.count("aoti_torch_cpu_rows_heads(") >= 1
    assert "proxy_executor_call_function" not in wrapper
    runner = torch._inductor.aoti_load_package(str(path))
    assert torch.equal(runner(x), module(x))


def test_a_failed_build_leaves_compiled_steps_on_inductors_gemms(monkeypatch, caplog):
    def broken():
        raise subprocess.SubprocessError("rows_gemm.cpp:1: error: no compiler here")

    monkeypatch.setattr(rows_gemm, "supported", lambda: True)
    monkeypatch.setattr(rows_gemm, "_built", broken)
    with caplog.at_level(logging.WARNING, logger=rows_gemm.__name__):
        assert rows_gemm._loaded.__wrapped__() is None
    assert "no compiler here" in caplog.text and "Inductor's GEMMs" in caplog.text


def test_build_errors_carry_the_compilers_message(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(rows_gemm.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(rows_gemm, "_command", lambda out: ["sh", "-c", "echo 'bad.cpp:3: error: nope' >&2; exit 1"])
    with pytest.raises(subprocess.SubprocessError, match="bad.cpp:3: error: nope"):
        rows_gemm._built()
    assert not list((tmp_path / "kernels").iterdir())  # no half-written library left behind


def test_a_child_process_loads_its_parents_library(tmp_path, monkeypatch):
    """Once loaded, the library's path is in the environment: a compile worker started with
    another cache directory loads that file instead of building its own."""
    if not rows_gemm.available():
        pytest.skip("rows_gemm needs an AVX-512F cpu")
    monkeypatch.setenv("MINDSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(rows_gemm, "_command", lambda out: pytest.fail("built again"))
    assert rows_gemm._built() == rows_gemm._loaded() and not (tmp_path / "kernels").exists()


def test_switched_off_by_env(monkeypatch):
    monkeypatch.setenv(rows_gemm.ENV_SWITCH, "0")
    assert not rows_gemm.supported()
