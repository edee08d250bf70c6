"""Routers (V2 softmax greedy / group-limited, V3 sigmoid + bias) and the fused MoE experts equal
the cpu backend; the route alignment gives every routed pair exactly one row of its expert."""
import pytest
import torch

from cuda_support import DTYPES, assert_close
from mindspec.backend import ExpertWeights, RouterConfig
from mindspec.backends.cuda import moe_gate
from mindspec.backends.cuda.fused_moe import align_routes_fused, align_routes_torch

HIDDEN = 40

ROUTERS = {
    "v2_greedy": RouterConfig(top_k=6, scoring="softmax", topk_method="greedy", n_group=1, topk_group=1,
                              norm_topk_prob=False, routed_scaling_factor=1.0),
    "v2_group_limited": RouterConfig(top_k=3, scoring="softmax", topk_method="group_limited_greedy", n_group=4,
                                     topk_group=2, norm_topk_prob=False, routed_scaling_factor=16.0),
    "v3_noaux_tc": RouterConfig(top_k=4, scoring="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                                norm_topk_prob=True, routed_scaling_factor=2.5),
    "v3_one_group_no_norm": RouterConfig(top_k=2, scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
                                         norm_topk_prob=False, routed_scaling_factor=1.0),
}


def _sorted_routes(weights, ids):
    """The router's choice as a set: ids ascending per token, weights in the same order (the cpu
    backend's topk order is unspecified)."""
    ids, order = ids.cpu().sort(dim=1)
    return weights.cpu().gather(1, order), ids


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("num_experts", [12, 16])
@pytest.mark.parametrize("gate_inside", [True, False])
def test_router_matches_cpu(cuda_backend, cpu_backend, device, name, num_experts, gate_inside, monkeypatch):
    """The gate GEMM inside the router kernel (a small gate) or in torch before it (a large one)."""
    monkeypatch.setattr(moe_gate, "FUSED_GATE_MAX", 1 << 14 if gate_inside else 0)
    router = ROUTERS[name]
    g = torch.Generator().manual_seed(num_experts)
    x = torch.randn(37, HIDDEN, generator=g)
    gate = torch.randn(num_experts, HIDDEN, generator=g) * 0.3
    bias = torch.randn(num_experts, generator=g) * 0.1 if router.scoring == "sigmoid" else None
    w, ids = cuda_backend.moe_gate(x.to(device), gate.to(device), None if bias is None else bias.to(device), router)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (37, router.top_k)
    rw, rids = cpu_backend.moe_gate(x, gate, bias, router)
    w, ids = _sorted_routes(w, ids)
    rw, rids = _sorted_routes(rw, rids)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, atol=1e-5, rtol=1e-5)


def test_router_of_bf16_activations_runs_in_fp32(cuda_backend, cpu_backend, device):
    router = ROUTERS["v3_noaux_tc"]
    g = torch.Generator().manual_seed(1)
    x, gate = torch.randn(9, HIDDEN, generator=g).half(), (torch.randn(16, HIDDEN, generator=g) * 0.3).half()
    bias = torch.randn(16, generator=g) * 0.1
    w, ids = cuda_backend.moe_gate(x.to(device), gate.to(device), bias.to(device), router)
    rw, rids = cpu_backend.moe_gate(x, gate, bias, router)
    assert torch.equal(_sorted_routes(w, ids)[1], _sorted_routes(rw, rids)[1])


@pytest.mark.parametrize("bad,match", [
    (dict(n_group=5), "n_group"), (dict(topk_group=9), "topk_group"), (dict(top_k=40), "top_k"),
    (dict(scoring="relu"), "scoring"),
])
def test_bad_router_is_named(cuda_backend, device, bad, match):
    from dataclasses import replace

    router = replace(ROUTERS["v3_noaux_tc"], **bad)
    with pytest.raises(ValueError, match=match):
        cuda_backend.moe_gate(torch.ones(2, HIDDEN, device=device), torch.ones(16, HIDDEN, device=device), None, router)


def _experts(g, num_experts, inter, dtype):
    return ExpertWeights(
        w13=(torch.randn(num_experts, 2 * inter, HIDDEN, generator=g) * 0.2).to(dtype),
        w2=(torch.randn(num_experts, HIDDEN, inter, generator=g) * 0.2).to(dtype),
    )


def _on(device, experts):
    return ExpertWeights(experts.w13.to(device), experts.w2.to(device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,num_experts,inter", [(1, 2, 8, 16), (13, 3, 8, 24), (40, 6, 12, 32)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_experts_match_cpu(cuda_backend, cpu_backend, device, dtype, num_tokens, top_k, num_experts, inter, with_shared):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    w = torch.rand(num_tokens, top_k, generator=g) * 2
    experts = _experts(g, num_experts, inter, dtype)
    shared = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype) if with_shared else None
    out = cuda_backend.moe_experts(x.to(device), w.to(device), ids.to(device), _on(device, experts),
                                   None if shared is None else shared.to(device))
    assert out.shape == x.shape and out.dtype == dtype
    expected = cpu_backend.moe_experts(x, w, ids, experts, shared)
    assert_close(out, expected, dtype)
    if with_shared:  # the shared experts' output is added to the routed sum, not instead of it
        assert not torch.allclose(expected, cpu_backend.moe_experts(x, w, ids, experts))


def test_ids_outside_the_local_experts_are_skipped(cuda_backend, cpu_backend, device):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, HIDDEN, generator=g)
    ids = torch.randint(0, 8, (10, 3), generator=g)
    ids[0, 1], ids[4, 0], ids[9, 2] = -1, 8, 100  # another rank's experts
    ids[7] = -1  # a token with no local expert at all gets 0
    w = torch.rand(10, 3, generator=g)
    experts = _experts(g, 8, 16, torch.float32)
    out = cuda_backend.moe_experts(x.to(device), w.to(device), ids.to(device), _on(device, experts))
    assert_close(out, cpu_backend.moe_experts(x, w, ids, experts), torch.float32)
    assert torch.count_nonzero(out[7]) == 0


def test_no_tokens(cuda_backend, device):
    experts = _on(device, _experts(torch.Generator().manual_seed(0), 4, 16, torch.float32))
    out = cuda_backend.moe_experts(torch.zeros(0, HIDDEN, device=device), torch.zeros(0, 2, device=device),
                                   torch.zeros(0, 2, dtype=torch.int64, device=device), experts)
    assert out.shape == (0, HIDDEN)


@pytest.mark.parametrize("align", [align_routes_fused, align_routes_torch], ids=["fused", "torch"])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_routes_gives_each_pair_one_row_of_its_expert(device, block_m, align):
    g = torch.Generator().manual_seed(block_m)
    num_experts = 6
    ids = torch.randint(-1, num_experts + 1, (23, 3), generator=g)  # includes skipped ids -1 and 6
    plan = align(ids.to(device), num_experts, block_m)
    pairs = plan.sorted_pairs.cpu().long()
    experts = plan.block_expert.cpu().long().repeat_interleave(block_m)
    used = int(plan.num_rows.item())
    flat = ids.reshape(-1)
    real = pairs[:used] < flat.numel()
    assert sorted(pairs[:used][real].tolist()) == [p for p in range(flat.numel()) if 0 <= flat[p] < num_experts]
    assert torch.equal(flat[pairs[:used][real]], experts[:used][real])  # every row sits in its expert's blocks
    assert used % block_m == 0 and torch.all(pairs[used:] == flat.numel())


@pytest.mark.parametrize("tokens, top_k, num_experts, block_m", [
    (1, 6, 64, 16),  # a V2-Lite decode step
    (4, 8, 256, 16),  # V3, one sequence verifying 3 drafts
    (300, 6, 64, 32),  # several chunks of the fused kernel, experts hit many times
    (7, 2, 6, 64),  # fewer pairs than a block
])
def test_fused_align_routes_equals_the_torch_ops(device, tokens, top_k, num_experts, block_m):
    """The one-kernel alignment (every decode step) gives exactly the torch ops' plan: the same
    stable order of pairs within an expert, block experts and rows in use."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-1, num_experts + 1, (tokens, top_k), generator=g).to(device)
    fused, reference = align_routes_fused(ids, num_experts, block_m), align_routes_torch(ids, num_experts, block_m)
    assert torch.equal(fused.sorted_pairs, reference.sorted_pairs)
    assert torch.equal(fused.block_expert, reference.block_expert)
    assert torch.equal(fused.num_rows, reference.num_rows)


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 65])
def test_the_router_plans_the_experts_in_its_own_launch(cuda_backend, device, name, num_tokens):
    """Where one router program takes every token (decode and verification steps), it writes
    the experts' route plan after the ids, in the same launch: the plan align_routes makes of
    those ids, so the block's output is the separate launches' bit for bit. Past one program
    (65 tokens here) the plan is align_routes' again."""
    from mindspec.backends.cuda.fused_moe import block_rows

    router, num_experts = ROUTERS[name], 16
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(device)
    gate = torch.randn(num_experts, HIDDEN, generator=g).to(device)
    bias = (torch.randn(num_experts, generator=g) * 0.1).to(device) if router.scoring == "sigmoid" else None
    block_m = block_rows(num_tokens * router.top_k)
    weights, ids, plan = moe_gate.route_and_plan(x, gate, bias, router, block_m)
    want_w, want_ids = moe_gate.moe_gate(x, gate, bias, router)
    assert torch.equal(weights, want_w) and torch.equal(ids, want_ids)
    if num_tokens > 64:
        assert plan is None
    else:
        want = align_routes_fused(ids, num_experts, block_m)
        rows = int(want.num_rows.item())
        assert plan.block_m == block_m and int(plan.num_rows.item()) == rows
        assert torch.equal(plan.sorted_pairs[:rows], want.sorted_pairs[:rows])
        assert torch.equal(plan.block_expert[: rows // block_m], want.block_expert[: rows // block_m])
    experts = _on(device, _experts(g, num_experts, 8, torch.float32))
    shared = torch.randn(num_tokens, HIDDEN, generator=g).to(device)
    out = cuda_backend.moe_block(x, gate, bias, router, experts, shared)
    assert torch.equal(out, cuda_backend.moe_experts(x, want_w, want_ids, experts, shared))
