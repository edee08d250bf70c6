import types
from dataclasses import replace

import pytest
import torch

import op_references as ref
from mindspec.backend import ExpertWeights, RouterConfig
from mindspec.backends.cpu import CpuBackend, moe
from mindspec.backends.cpu import linear as packed_linear
from mindspec.backends.cpu import rows_gemm

HIDDEN, E, T = 32, 16, 23


def _fail(*_):
    raise AssertionError("F.linear was called")


def _sorted(w, ids):
    order = torch.argsort(ids, dim=-1)
    return w.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("method,n_group,topk_group", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_v2_router_matches_transformers(method, n_group, topk_group):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=E, num_experts_per_tok=4, n_group=n_group,
                           topk_group=topk_group, topk_method=method, routed_scaling_factor=16.0,
                           norm_topk_prob=False)
    hf = DeepseekV2TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, HIDDEN, generator=g).to(torch.bfloat16))  # a bf16 checkpoint
    x = torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16)
    _, hf_w, hf_ids = hf(x)
    router = RouterConfig(top_k=4, scoring="softmax", topk_method=method, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=False, routed_scaling_factor=16.0)
    w, ids = CpuBackend().moe_gate(x, hf.weight.data.to(torch.bfloat16), None, router)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (T, 4)
    w, ids = _sorted(w, ids)
    hf_w, hf_ids = _sorted(hf_w, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_group", [4, 8])  # 8: groups of two experts, whose top-2 is the pair
@pytest.mark.parametrize("norm", [True, False])
def test_v3_router_matches_transformers(norm, n_group):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=E, num_experts_per_tok=4, n_group=n_group,
                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=norm)
    hf = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(E, generator=g) * 0.5
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, HIDDEN, generator=g))
        hf.e_score_correction_bias.copy_(bias)
    x = torch.randn(T, HIDDEN, generator=g)
    _, hf_w, hf_ids = hf(x)
    router = RouterConfig(top_k=4, scoring="sigmoid", topk_method="noaux_tc", n_group=n_group, topk_group=2,
                          norm_topk_prob=norm, routed_scaling_factor=2.5)
    w, ids = CpuBackend().moe_gate(x, hf.weight.data, bias, router)
    w, ids = _sorted(w, ids)
    hf_w, hf_ids = _sorted(hf_w, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, atol=1e-6, rtol=1e-6)
    # the bias steers the choice only: the weights are the unbiased sigmoid scores
    s = torch.sigmoid(x @ hf.weight.data.T).gather(1, ids)
    if norm:
        s = s / s.sum(-1, keepdim=True)
    torch.testing.assert_close(w, s * 2.5, atol=1e-5, rtol=1e-5)


def test_v3_group_limit_restricts_choice():
    g = torch.Generator().manual_seed(2)
    x, gate = torch.randn(T, HIDDEN, generator=g), torch.randn(E, HIDDEN, generator=g)
    bias = torch.randn(E, generator=g)
    router = RouterConfig(top_k=3, scoring="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=1,
                          norm_topk_prob=True, routed_scaling_factor=1.0)
    w, ids = CpuBackend().moe_gate(x, gate, bias, router)
    choice = torch.sigmoid(x @ gate.T) + bias
    for t in range(T):
        group_score = [sorted(choice[t, 4 * k:4 * k + 4].tolist())[-2:] for k in range(4)]
        best = max(range(4), key=lambda k: sum(group_score[k]))
        assert set((ids[t] // 4).tolist()) == {best}
        in_group = choice[t, 4 * best:4 * best + 4]
        assert set(ids[t].tolist()) == set((torch.topk(in_group, 3).indices + 4 * best).tolist())
    torch.testing.assert_close(w.sum(-1), torch.ones(T))


def _experts(g, inter=12, dtype=torch.float32):
    return ExpertWeights(w13=(torch.randn(E, 2 * inter, HIDDEN, generator=g) * 0.2).to(dtype),
                         w2=(torch.randn(E, HIDDEN, inter, generator=g) * 0.2).to(dtype))


def test_moe_experts_matches_naive_loop():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, HIDDEN, generator=g)
    ex = _experts(g)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)])
    ids[:, 0] = 5  # a popular expert
    ids[0] = torch.tensor([0, 1, 2, 3])
    w = torch.rand(T, 4, generator=g)
    out = CpuBackend().moe_experts(x, w, ids, ex)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), ref.moe_experts(x, w, ids, ex.w13, ex.w2), atol=1e-5, rtol=1e-5)


def test_moe_experts_matches_transformers_experts_bf16():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    cfg = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=E, moe_intermediate_size=12)
    hf = DeepseekV3Experts(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    ex = _experts(g, dtype=torch.bfloat16)
    with torch.no_grad():
        hf.gate_up_proj.copy_(ex.w13)
        hf.down_proj.copy_(ex.w2)
    x = torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)])
    w = torch.rand(T, 4, generator=g)
    expected = DeepseekV3Experts.forward(hf, x, ids, w)
    out = CpuBackend().moe_experts(x, w, ids, ex)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_moe_experts_skips_foreign_ids_and_empty_batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, HIDDEN, generator=g)
    ex = _experts(g)
    ids = torch.tensor([[0, -1], [E, 3], [3, 3], [-1, E + 2]])
    w = torch.rand(4, 2, generator=g)
    out = CpuBackend().moe_experts(x, w, ids, ex)
    keep = (ids >= 0) & (ids < E)
    expected = ref.moe_experts(x, w * keep, ids.clamp(0, E - 1), ex.w13, ex.w2)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    empty = CpuBackend().moe_experts(x[:0], w[:0], ids[:0], ex)
    assert empty.shape == (0, HIDDEN)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("path", ["_few_experts", "_gathered_experts", "_dense_experts", "_sorted_experts"])
def test_every_expert_path_matches_naive_loop(monkeypatch, path, packed):
    """Each way of running the experts gives the same sums, foreign ids skipped; ``packed``: the
    experts as the cpu backend builds them, every GEMM forced onto the packed path (F.linear fails)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, HIDDEN, generator=g)
    ex = _experts(g)
    if packed:
        if not packed_linear.packing_enabled():
            pytest.skip("torch built without oneDNN")
        ex = CpuBackend().expert_weights(ex.w13, ex.w2)
        monkeypatch.setattr(packed_linear, "PACKED_MIN_MACS", 0)
        no_f_linear = types.SimpleNamespace(linear=_fail, silu=torch.nn.functional.silu)
        monkeypatch.setattr(packed_linear, "F", no_f_linear)
        monkeypatch.setattr(moe, "F", no_f_linear)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(7)])
    ids[1, 2], ids[4, 0] = -1, E + 1  # another rank's experts
    w = torch.rand(7, 3, generator=g)
    keep = (ids >= 0) & (ids < E)
    expected = ref.moe_experts(x, w * keep, ids.clamp(0, E - 1), ex.w13, ex.w2)
    torch.testing.assert_close(getattr(moe, path)(x, w, ids, ex).double(), expected, atol=1e-5, rtol=1e-5)



def _paths_taken(monkeypatch) -> list[str]:
    """The names of the expert paths moe_experts calls from now on, in order."""
    calls = []
    for name in ("_few_experts", "_gathered_experts", "_dense_experts", "_sorted_experts"):
        original = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _n=name, _f=original: calls.append(_n) or _f(*a))
    return calls


@pytest.mark.parametrize("num_experts,top_k,tokens,path", [
    (6, 2, 1, "_few_experts"),  # one token: only its experts' weights are read
    (6, 2, 2, "_dense_experts"),  # few experts: two batched GEMMs from two tokens on
    (6, 2, 4, "_dense_experts"),  # and for an MTP verification's tokens
    (6, 2, 64, "_dense_experts"),
    (6, 2, 65, "_sorted_experts"),  # a prefill: E / top_k times the FLOPs no longer pays
    (64, 2, 4, "_few_experts"),  # many experts, a handful of pairs
    (64, 2, 32, "_sorted_experts"),
])
def test_expert_path_chosen_by_cost(monkeypatch, num_experts, top_k, tokens, path):
    calls = _paths_taken(monkeypatch)
    g = torch.Generator().manual_seed(7)
    ex = ExpertWeights(w13=torch.randn(num_experts, 8, HIDDEN, generator=g), w2=torch.randn(num_experts, HIDDEN, 4, generator=g))
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    moe.moe_experts(torch.randn(tokens, HIDDEN, generator=g), torch.rand(tokens, top_k, generator=g), ids, ex)
    assert calls == [path]


@pytest.mark.skipif(not packed_linear.packing_enabled(), reason="torch built without oneDNN")
@pytest.mark.parametrize("tokens,path", [(192, "_dense_experts"), (193, "_sorted_experts")])
def test_packed_experts_stay_dense_up_to_more_tokens(monkeypatch, tokens, path):
    calls = _paths_taken(monkeypatch)
    g = torch.Generator().manual_seed(8)
    ex = CpuBackend().expert_weights(w13=torch.randn(6, 8, HIDDEN, generator=g), w2=torch.randn(6, HIDDEN, 4, generator=g))
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(tokens)])
    moe.moe_experts(torch.randn(tokens, HIDDEN, generator=g), torch.rand(tokens, 2, generator=g), ids, ex)
    assert calls == [path]


def test_gathered_top2_sums_alike_in_either_order():
    """With two experts per token the gathered path skips sorting them by id: a sum of two
    terms is the same either way round, so the output is bitwise what either order gives."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, HIDDEN, generator=g)
    ex = _experts(g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    ids[2, 1] = -1  # another rank's expert
    w = torch.rand(5, 2, generator=g)
    out = moe._gathered_experts(x, w, ids, ex)
    assert torch.equal(out, moe._gathered_experts(x, w.flip(1), ids.flip(1), ex))
    keep = (ids >= 0) & (ids < E)
    expected = ref.moe_experts(x, w * keep, ids.clamp(0, E - 1), ex.w13, ex.w2)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_gathered_experts_read_the_narrow_weights(monkeypatch):
    """Experts whose float32 values are all bfloat16 keep bfloat16 copies, which the gathered path
    (compiled decode steps on a cpu without rows_gemm) reads: the same sums as the float32
    experts', and a token's result does not depend on the tokens beside it."""
    monkeypatch.setattr(rows_gemm, "supported", lambda: False)
    g = torch.Generator().manual_seed(10)
    exact = ExpertWeights(w13=torch.randn(E, 8, HIDDEN, generator=g).to(torch.bfloat16).float(),
                          w2=torch.randn(E, HIDDEN, 4, generator=g).to(torch.bfloat16).float())
    ex = CpuBackend().expert_weights(exact.w13, exact.w2)
    assert ex.w13_narrow.dtype == torch.bfloat16 and torch.equal(ex.w13_narrow.float(), exact.w13)
    assert torch.equal(ex.w2_narrow.float(), exact.w2)
    x = torch.randn(4, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(4)])
    w = torch.rand(4, 2, generator=g)
    out = moe._gathered_experts(x, w, ids, ex)
    torch.testing.assert_close(out.double(), ref.moe_experts(x, w, ids, exact.w13, exact.w2), atol=1e-5, rtol=1e-5)
    assert torch.equal(moe._gathered_experts(x[2:3], w[2:3], ids[2:3], ex), out[2:3])
    other = replace(ex, w13_narrow=(ex.w13_narrow.float() * 2).to(torch.bfloat16))  # tells the copies apart
    assert not torch.allclose(moe._gathered_experts(x, w, ids, other), out)


def test_experts_keep_one_narrow_copy(monkeypatch):
    """The per-expert GEMM weights and the side-by-side gate/up weight read views of the experts'
    one bfloat16 copy, not copies of their own: bfloat16 copies add half the float32 size."""
    monkeypatch.setattr(rows_gemm, "supported", lambda: False)
    g = torch.Generator().manual_seed(11)
    w13 = torch.randn(E, 8, HIDDEN, generator=g).to(torch.bfloat16).float()
    w2 = torch.randn(E, HIDDEN, 4, generator=g).to(torch.bfloat16).float()
    ex = CpuBackend().expert_weights(w13, w2)
    base = ex.w13_narrow.untyped_storage().data_ptr()
    assert ex.w13_all.narrow.untyped_storage().data_ptr() == base
    assert all(w.narrow.untyped_storage().data_ptr() == base for w in ex.w13_each)
    assert all(torch.equal(w.narrow.float(), w2[e]) for e, w in enumerate(ex.w2_each))
    assert all(w.narrow.untyped_storage().data_ptr() == ex.w2_narrow.untyped_storage().data_ptr() for w in ex.w2_each)
    assert ex.w2_all.narrow is None


@pytest.mark.parametrize("num_experts,top_k,tokens,path", [
    (6, 2, 1, "_gathered_experts"),  # a plain decode step
    (6, 2, 4, "_gathered_experts"),  # an MTP K=3 verification at batch 1
    (6, 2, 6, "_gathered_experts"),  # an MTP Vanilla draft stage at batch 1 (6 rows, 12 pairs)
    (6, 2, 7, "_dense_experts"),  # past GATHERED_PAIRS: every expert on every token
    (64, 2, 32, "_sorted_experts"),  # many experts and many pairs
])
def test_compiled_expert_path_chosen_by_pairs(monkeypatch, num_experts, top_k, tokens, path):
    """Inside a compiled graph nothing waits for the host: up to moe.GATHERED_PAIRS (token, expert)
    pairs gather their experts' weights, more run dense (few experts) or sorted."""
    assert 6 * 2 <= moe.GATHERED_PAIRS < 7 * 2
    calls = _paths_taken(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(9)
    ex = ExpertWeights(w13=torch.randn(num_experts, 8, HIDDEN, generator=g), w2=torch.randn(num_experts, HIDDEN, 4, generator=g))
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    x, w = torch.randn(tokens, HIDDEN, generator=g), torch.rand(tokens, top_k, generator=g)
    out = moe.moe_experts(x, w, ids, ex)
    assert calls == [path]
    torch.testing.assert_close(out.double(), ref.moe_experts(x, w, ids, ex.w13, ex.w2), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not rows_gemm.supported(), reason="rows_gemm needs an AVX-512F cpu")
def test_experts_keep_one_blocked_copy_where_rows_gemm_runs():
    """Where the cpu runs rows_gemm the experts' one bfloat16 copy is blocked for it (no narrow
    copies beside it) and each expert's GEMM weight reads its slice."""
    g = torch.Generator().manual_seed(12)
    w13 = torch.randn(E, 8, HIDDEN, generator=g).to(torch.bfloat16).float()
    w2 = torch.randn(E, HIDDEN, 4, generator=g).to(torch.bfloat16).float()
    ex = CpuBackend().expert_weights(w13, w2)
    assert ex.w13_narrow is None and ex.w2_narrow is None
    assert torch.equal(ex.w13_blocked, rows_gemm.block_experts(w13.to(torch.bfloat16)))
    assert torch.equal(ex.w2_blocked, rows_gemm.block_experts(w2.to(torch.bfloat16)))
    base = ex.w13_blocked.untyped_storage().data_ptr()
    assert all(w.blocked.untyped_storage().data_ptr() == base and w.narrow is None for w in ex.w13_each)
    assert all(torch.equal(w.blocked, ex.w2_blocked[e]) for e, w in enumerate(ex.w2_each))


@pytest.mark.skipif(not rows_gemm.supported(), reason="rows_gemm needs an AVX-512F cpu")
@pytest.mark.parametrize("tokens,rows_experts", [(1, True), (4, True), (64, True), (65, False)])
def test_compiled_blocked_experts_run_rows_experts(monkeypatch, tokens, rows_experts):
    """Inside a compiled graph experts blocked for rows_gemm run rows_experts up to
    ROWS_EXPERTS_MAX_TOKENS tokens, the other paths beyond."""
    calls = _paths_taken(monkeypatch)
    original = rows_gemm.rows_experts
    monkeypatch.setattr(rows_gemm, "rows_experts", lambda *a: calls.append("rows_experts") or original(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(13)
    w13 = torch.randn(E, 8, HIDDEN, generator=g).to(torch.bfloat16).float()
    w2 = torch.randn(E, HIDDEN, 4, generator=g).to(torch.bfloat16).float()
    ex = CpuBackend().expert_weights(w13, w2)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
    x, w = torch.randn(tokens, HIDDEN, generator=g), torch.rand(tokens, 2, generator=g)
    out = moe.moe_experts(x, w, ids, ex)
    assert len(calls) == 1 and (calls[0] == "rows_experts") == rows_experts
    # 2e-5: beyond 64 tokens the dense path sums in the GEMM's blocked order (1.1e-5 seen in CI)
    torch.testing.assert_close(out.double(), ref.moe_experts(x, w, ids, w13, w2), atol=2e-5, rtol=1e-5)
