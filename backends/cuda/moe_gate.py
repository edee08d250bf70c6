"""DeepSeekMoE routers: logits -> (topk_weights [T, k] float32, topk_ids [T, k] int64).

The gate GEMM runs in float32, as transformers'. A small gate (E * H <= FUSED_GATE_MAX: the
shipped model's 6 x 192) is multiplied inside the router kernel, which then routes from the
logits it wrote: one launch where widening the activations, cuBLAS's GEMM and the router took
three or four. A larger one runs in torch (cuBLAS, spread over the GPU) first. One Triton program
per tile of tokens then does the routing in float32:
- V2 ("softmax"): softmax; "greedy" top-k, or "group_limited_greedy": groups scored by their max,
  the top ``topk_group`` groups kept, the rest set to 0, then top-k;
- V3 ("sigmoid", "noaux_tc"): sigmoid; for choosing only, + e_score_correction_bias; groups scored
  by the sum of their top-2; the top ``topk_group`` groups kept, the rest -inf; top-k; weights are
  the unbiased sigmoid scores.
Then optional renormalisation (sum + 1e-20) and routed_scaling_factor. Top-k is k rounds of argmax
(ties go to the lower expert id); ids come out ordered by descending choice score.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mindspec.backend import RouterConfig
from mindspec.backends.cuda.availability import interpreting
from mindspec.backends.cuda.fused_moe import FUSED_ALIGN_MAX_PAIRS, RoutePlan, align_pairs, plan_buffers
from mindspec.backends.cuda.launch import pow2
from mindspec.backends.cuda.linear import project

SCORINGS = {"softmax": 0, "sigmoid": 1}


FUSED_GATE_MAX = 1 << 14  # gate weights (experts x hidden) the router kernel multiplies itself


@triton.jit
def _router_kernel(
    x_ptr, gate_ptr, logits_ptr, bias_ptr, w_out_ptr, id_out_ptr,
    num_tokens, num_experts, hidden, per_group, n_group, stride_x, stride_g, stride_l, stride_w, stride_id, scaling,
    sorted_ptr, block_expert_ptr, num_rows_ptr, pad_start_ptr, seen_ptr, max_rows, block_m,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EPG: tl.constexpr,
    GATE_INSIDE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_AE: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # ALIGN (one program routes every token; ids contiguous [T, TOP_K]): the experts' route plan
    # (fused_moe.align_pairs) from the ids this program has just written, in the same launch.
    NEG: tl.constexpr = float("-inf")
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    rows64 = rows.to(tl.int64)
    if GATE_INSIDE:  # logits = x @ gate.T in float32 into this tile's rows of logits_ptr, read back below
        e_all = tl.arange(0, BLOCK_E)
        acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < hidden
            xv = tl.load(x_ptr + rows64[:, None] * stride_x + h[None, :], mask=row_ok[:, None] & h_ok[None, :],
                         other=0.0).to(tl.float32)  # [BT, BH]
            gv = tl.load(gate_ptr + e_all[:, None] * stride_g + h[None, :],
                         mask=(e_all[:, None] < num_experts) & h_ok[None, :], other=0.0).to(tl.float32)  # [BE, BH]
            acc += tl.sum(xv[:, None, :] * gv[None, :, :], 2)
        tl.store(logits_ptr + rows64[:, None] * stride_l + e_all[None, :], acc,
                 mask=row_ok[:, None] & (e_all[None, :] < num_experts))
        tl.debug_barrier()  # the program's own writes, visible to all its threads
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_EPG)
    expert = g[:, None] * per_group + j[None, :]  # [G, EPG] expert id of each lane
    lane_ok = (g[:, None] < n_group) & (j[None, :] < per_group)
    ok = row_ok[:, None, None] & lane_ok[None, :, :]  # [BT, G, EPG]
    logit = tl.load(logits_ptr + rows64[:, None, None] * stride_l + expert[None, :, :], mask=ok, other=NEG)

    if SIGMOID:
        score = tl.where(ok, 1.0 / (1.0 + tl.exp(-logit)), 0.0)
        choice = score
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert, mask=lane_ok, other=0.0)
            choice = score + bias[None, :, :]
        choice = tl.where(ok, choice, NEG)
    else:
        top = tl.max(tl.max(logit, 2), 1)  # [BT]
        top = tl.where(row_ok, top, 0.0)
        e = tl.where(ok, tl.exp(logit - top[:, None, None]), 0.0)
        denom = tl.sum(tl.sum(e, 2), 1)
        score = e / tl.where(row_ok, denom, 1.0)[:, None, None]
        choice = tl.where(ok, score, NEG)

    if GROUPED:
        if SIGMOID:  # a group's score is the sum of its two best experts
            best = tl.max(choice, 2)  # [BT, G]
            first = tl.argmax(choice, 2)
            rest = tl.where(j[None, None, :] == first[:, :, None], NEG, choice)
            group_score = best + tl.max(rest, 2)
        else:  # V2 group_limited_greedy: a group's score is its best expert
            group_score = tl.max(choice, 2)
        group_score = tl.where(g[None, :] < n_group, group_score, NEG)
        keep = tl.zeros([BLOCK_T, BLOCK_G], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_score, 1)  # [BT]
            chosen = g[None, :] == pick[:, None]
            keep = keep | chosen
            group_score = tl.where(chosen, NEG, group_score)
        dropped = ok & ~keep[:, :, None]
        # V3 masks dropped groups to -inf; V2 sets their scores to 0 (transformers' masked_fill)
        choice = tl.where(dropped, NEG if SIGMOID else 0.0, choice)

    flat_choice = tl.reshape(choice, [BLOCK_T, BLOCK_G * BLOCK_EPG])
    flat_score = tl.reshape(tl.where(ok, score, 0.0), [BLOCK_T, BLOCK_G * BLOCK_EPG])
    flat_expert = tl.reshape(expert, [BLOCK_G * BLOCK_EPG])
    lane = tl.arange(0, BLOCK_G * BLOCK_EPG)
    k_idx = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
    for k in tl.static_range(TOP_K):
        pick = tl.argmax(flat_choice, 1)  # [BT] lane of the best remaining expert
        hit = lane[None, :] == pick[:, None]
        w = tl.sum(tl.where(hit, flat_score, 0.0), 1)
        eid = tl.sum(tl.where(hit, flat_expert[None, :], 0), 1)
        weights = tl.where(k_idx[None, :] == k, w[:, None], weights)
        ids = tl.where(k_idx[None, :] == k, eid.to(tl.int64)[:, None], ids)
        flat_choice = tl.where(hit, NEG, flat_choice)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
    weights = weights * scaling
    out_ok = row_ok[:, None] & (k_idx[None, :] < TOP_K)
    tl.store(w_out_ptr + rows64[:, None] * stride_w + k_idx[None, :], weights, mask=out_ok)
    tl.store(id_out_ptr + rows64[:, None] * stride_id + k_idx[None, :], ids, mask=out_ok)
    if ALIGN:
        tl.debug_barrier()  # the ids, visible to every thread of the program
        align_pairs(id_out_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, pad_start_ptr, seen_ptr,
                    num_tokens * TOP_K, num_experts, max_rows, block_m, BLOCK_P, BLOCK_AE, BLOCK_B)


def _check_router(router: RouterConfig, num_experts: int) -> tuple[bool, int]:
    """(grouped, number of groups) or one ValueError naming the bad setting."""
    if router.scoring not in SCORINGS:
        raise ValueError(f"unknown router scoring {router.scoring!r}")
    if router.scoring == "softmax" and router.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"softmax router does not support topk_method {router.topk_method!r}")
    grouped = router.scoring == "sigmoid" or router.topk_method == "group_limited_greedy"
    n_group = router.n_group if grouped else 1
    if grouped and (n_group < 1 or num_experts % n_group):
        raise ValueError(f"router n_group={n_group} must divide the {num_experts} experts")
    if grouped and not 1 <= router.topk_group <= n_group:
        raise ValueError(f"router topk_group={router.topk_group} must lie in [1, n_group={n_group}]")
    if router.scoring == "sigmoid" and num_experts // n_group < 2:
        raise ValueError("sigmoid routing scores groups by their top-2 experts: it needs >= 2 experts per group")
    if not 1 <= router.top_k <= num_experts:
        raise ValueError(f"router top_k={router.top_k} must lie in [1, {num_experts}]")
    return grouped, n_group


def moe_gate(
    x: torch.Tensor,  # [T, H]
    gate_weight: torch.Tensor,  # [E, H]
    correction_bias: Optional[torch.Tensor],  # [E] float32 (V3)
    router: RouterConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids, _ = route_and_plan(x, gate_weight, correction_bias, router, None)
    return weights, ids


def route_and_plan(
    x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: Optional[torch.Tensor], router: RouterConfig,
    block_m: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor, Optional[RoutePlan]]:
    """``moe_gate`` and, given the experts' ``block_m``, where one router program takes every token
    (a decode or verification step), their route plan in the same launch (otherwise None:
    ``fused_moe.align_routes`` makes it)."""
    num_experts, hidden = gate_weight.shape
    grouped, n_group = _check_router(router, num_experts)
    num_tokens = x.shape[0]
    inside = num_experts * hidden <= FUSED_GATE_MAX and x.stride(-1) == 1 and gate_weight.stride(-1) == 1
    if inside:
        logits = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=x.device)  # [T, E]
    else:
        logits = project(x.to(torch.float32), gate_weight.to(torch.float32))  # [T, E] in fp32
    k = router.top_k
    weights = torch.empty((num_tokens, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, k), dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids, None
    has_bias = router.scoring == "sigmoid" and correction_bias is not None
    bias = correction_bias.to(device=x.device, dtype=torch.float32).contiguous() if has_bias else logits
    per_group = num_experts // n_group
    block_g, block_epg = pow2(n_group), pow2(per_group)
    lanes = block_g * block_epg
    block_t = pow2(min(num_tokens, 64)) if interpreting() else max(1, min(16, 4096 // lanes))
    block_e = pow2(num_experts)
    block_h = min(pow2(hidden), max(1, 8192 // (block_t * block_e)))  # a [BT, BE, BH] product per step
    align = block_m is not None and num_tokens <= block_t and num_tokens * k <= FUSED_ALIGN_MAX_PAIRS
    buffers = plan_buffers(num_tokens * k, num_experts, block_m, x.device) if align else None
    plan_args = ((buffers.plan.sorted_pairs, buffers.plan.block_expert, buffers.plan.num_rows, buffers.scratch[0],
                  buffers.scratch[1], buffers.max_rows, block_m) if align else (ids, ids, ids, ids, ids, 0, 1))
    plan_constexprs = buffers.constexprs() if align else dict(BLOCK_P=1, BLOCK_E=1, BLOCK_B=1)
    _router_kernel[(triton.cdiv(num_tokens, block_t),)](
        x, gate_weight, logits, bias, weights, ids,
        num_tokens, num_experts, hidden, per_group, n_group, x.stride(0), gate_weight.stride(0), logits.stride(0),
        weights.stride(0), ids.stride(0), float(router.routed_scaling_factor), *plan_args,
        TOP_K=k, BLOCK_K=pow2(k), TOPK_GROUP=router.topk_group if grouped else 1, SIGMOID=router.scoring == "sigmoid",
        GROUPED=grouped, HAS_BIAS=has_bias, NORMALIZE=bool(router.norm_topk_prob),
        BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_EPG=block_epg, GATE_INSIDE=inside, BLOCK_E=block_e, BLOCK_H=block_h,
        ALIGN=align, BLOCK_P=plan_constexprs["BLOCK_P"], BLOCK_AE=plan_constexprs["BLOCK_E"],
        BLOCK_B=plan_constexprs["BLOCK_B"],
    )
    return weights, ids, buffers.plan if align else None
