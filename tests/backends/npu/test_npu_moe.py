"""DeepSeekMoE of the npu backend: the fused V3 gate within its A2/A3 limits (torch router outside
them) and the init_routing_v2 -> grouped_matmul -> swiglu -> token_unpermute expert path, against
the cpu backend."""
import pytest
import torch

from mindspec.backend import ExpertWeights, RouterConfig
from mindspec.backends.cpu import CpuBackend
from npu_cases import HALF, TOL, close, rand

CPU = CpuBackend()
V3 = RouterConfig(top_k=8, scoring="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                  routed_scaling_factor=2.5)


def _sorted(weights, ids):
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
def test_v3_gate_fused(npu_backend, npu_ref, dtype):
    g = torch.Generator().manual_seed(1)
    x, gate = rand(g, 13, 64, dtype=dtype), rand(g, 256, 64, dtype=dtype, scale=0.2)
    bias = 0.05 * torch.randn(256, generator=g)
    w, ids = _sorted(*npu_backend.moe_gate(x, gate, bias, V3))
    w_ref, ids_ref = _sorted(*CPU.moe_gate(x, gate, bias, V3))
    assert torch.equal(ids, ids_ref) and ids.dtype == torch.int64 and w.dtype == torch.float32
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    (call,) = npu_ref.calls("npu_moe_gating_top_k")
    kw = call.kwargs
    assert call.args[0].dtype == torch.float32 and call.args[1] == 8  # router logits in fp32
    assert (kw["k_group"], kw["group_count"], kw["group_select_mode"], kw["norm_type"]) == (4, 8, 1, 1)
    assert kw["routed_scaling_factor"] == 2.5 and kw["bias"].dtype == torch.float32


@pytest.mark.parametrize("router,experts,bias", [
    (RouterConfig(2, "sigmoid", "noaux_tc", 2, 1, True, 2.5), 8, True),  # tiny V3: outside A2/A3 limits
    (RouterConfig(6, "softmax", "group_limited_greedy", 8, 3, False, 1.0), 256, False),  # V2 router
    (RouterConfig(6, "softmax", "greedy", 1, 1, False, 1.0), 64, False),
    (RouterConfig(8, "sigmoid", "noaux_tc", 8, 4, True, 2.5), 256, False),  # no correction bias
])
def test_gate_outside_limits_uses_the_torch_router(npu_backend, npu_ref, router, experts, bias):
    g = torch.Generator().manual_seed(2)
    x, gate = rand(g, 7, 32), rand(g, experts, 32, scale=0.2)
    b = 0.05 * torch.randn(experts, generator=g) if bias else None
    w, ids = npu_backend.moe_gate(x, gate, b, router)
    w_ref, ids_ref = CPU.moe_gate(x, gate, b, router)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
    assert not npu_ref.calls("npu_moe_gating_top_k") and npu_backend.fallbacks.ops() == {"moe_gate"}


def _experts(g, num, hidden, inter, dtype):
    return ExpertWeights(w13=rand(g, num, 2 * inter, hidden, dtype=dtype, scale=0.2),
                         w2=rand(g, num, hidden, inter, dtype=dtype, scale=0.2))


@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
def test_experts_permute_gmm_unpermute(npu_backend, npu_ref, dtype):
    g = torch.Generator().manual_seed(3)
    T, k, E, H, I = 11, 3, 16, 24, 8
    x = rand(g, T, H, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # some experts get no token
    weights = torch.rand(T, k, generator=g)
    w_npu = _experts(g, E, H, I, dtype)
    w_cpu = ExpertWeights(w_npu.w13.clone(), w_npu.w2.clone())
    close(npu_backend.moe_experts(x, weights, ids, w_npu), CPU.moe_experts(x, weights, ids, w_cpu), dtype)
    # The record was re-laid out once for npu_grouped_matmul ([E, K, N] contiguous), values unchanged.
    assert w_npu.w13.transpose(1, 2).is_contiguous() and torch.equal(w_npu.w13, w_cpu.w13)
    (routing,) = npu_ref.calls("npu_moe_init_routing_v2")
    assert routing.args[1].dtype == torch.int32 and routing.kwargs["active_num"] == T * k
    assert routing.kwargs["expert_tokens_num_type"] == 1 and routing.kwargs["active_expert_range"] == [0, E]
    gmm = npu_ref.calls("npu_grouped_matmul")
    assert len(gmm) == 2 and all(c.kwargs["group_list"].dtype == torch.int64 for c in gmm)
    assert [c.args[1][0].shape for c in gmm] == [(E, H, 2 * I), (E, I, H)]
    (unpermute,) = npu_ref.calls("npu_moe_token_unpermute")
    assert unpermute.args[1].dtype == torch.int32 and unpermute.kwargs["probs"].shape == (T, k)
    assert npu_ref.calls("npu_swiglu") and not npu_backend.fallbacks.counts


def test_experts_of_other_ranks_contribute_nothing(npu_backend, npu_ref):
    g = torch.Generator().manual_seed(4)
    x, E = rand(g, 4, 16), 6
    ids = torch.tensor([[0, 7], [-1, 2], [5, 9], [3, 3]])  # 7, 9, -1: not on this rank
    weights = torch.rand(4, 2, generator=g)
    w_npu = _experts(g, E, 16, 4, torch.float32)
    w_cpu = ExpertWeights(w_npu.w13.clone(), w_npu.w2.clone())
    expected = CPU.moe_experts(x, weights, ids, w_cpu)
    torch.testing.assert_close(npu_backend.moe_experts(x, weights, ids, w_npu), expected, **TOL[torch.float32])


def test_experts_empty_batch(npu_backend):
    w = _experts(torch.Generator().manual_seed(5), 4, 8, 2, torch.float32)
    out = npu_backend.moe_experts(torch.zeros(0, 8), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64), w)
    assert out.shape == (0, 8)
