"""Routed experts as two grouped GEMMs over the (token, expert) pairs, with SwiGLU fused in.

1. ``align_routes`` (on the device, no host sync, static shapes): sort the T*k pairs by expert
   and pad each expert's run to a multiple of BLOCK_M, so every M-block of rows belongs to one
   expert. Ids outside [0, E) (experts of another rank) are given no row: they are skipped, as in
   the cpu backend. Up to FUSED_ALIGN_MAX_PAIRS pairs (every decode step) this is one kernel of
   one program: as ~20 torch ops it was ~25 launches per MoE layer, a quarter of a small model's
   decode step; larger batches (prefill) use the torch ops, whose kernels are then not tiny.
   Where one router program routes every token, the router runs this program's body
   (``align_pairs``) on the ids it has written and hands the plan to ``moe_experts``
   (moe_gate.route_and_plan): no launch of its own.
2. ``_gate_up_silu_kernel``: per M-block and N-tile of the intermediate size, x[token] @ w13[e]^T
   for the gate and the up rows at once, then silu(gate) * up -> act [T*k, I].
3. ``_down_kernel``: act @ w2[e]^T, times the pair's routing weight (float32, then cast as the
   reference does) -> per-pair rows [T*k, H].
4. ``_combine_kernel``: each token's k rows summed in float32 and rounded, skipped pairs left out,
   plus the shared experts' output where given (one launch where a zero fill, a torch sum, a cast
   and the shared add took four).
Each expert's weights are read once per M-block of its rows: in decode (few tokens per expert)
that is once per step, which is what the bandwidth benchmark measures.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mindspec.backend import ExpertWeights
from mindspec.backends.cuda.activation import _silu_f32
from mindspec.backends.cuda.availability import interpreting
from mindspec.backends.cuda.launch import MIN_DOT, dot_precision, pow2, unit_last_stride


@dataclass
class RoutePlan:
    sorted_pairs: torch.Tensor  # [max_rows] int32 pair index (token * k + j); num_pairs = padding
    block_expert: torch.Tensor  # [max_blocks] int32 expert of each M-block
    num_rows: torch.Tensor  # [1] int32 padded rows in use; blocks at or past it exit
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


FUSED_ALIGN_MAX_PAIRS = 8192
_ALIGN_CHUNK = 128  # pairs per pass of the fused kernel (its rank step compares a chunk pairwise)


def _max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the plan can need: at most min(E, P) experts are non-empty, each wasting < block_m rows."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def align_routes(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    if topk_ids.numel() <= FUSED_ALIGN_MAX_PAIRS:
        return align_routes_fused(topk_ids, num_experts, block_m)
    return align_routes_torch(topk_ids, num_experts, block_m)


@triton.jit
def _align_routes_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, pad_start_ptr, seen_ptr,
    num_pairs, num_experts, max_rows, block_m,
    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, pad_start_ptr, seen_ptr,
                num_pairs, num_experts, max_rows, block_m, BLOCK_P, BLOCK_E, BLOCK_B)


@triton.jit
def align_pairs(
    ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, pad_start_ptr, seen_ptr,
    num_pairs, num_experts, max_rows, block_m,
    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The route plan of ``num_pairs`` expert ids in one program (the router calls it too, on the
    ids it has just written: routing and planning in one launch)."""
    e = tl.arange(0, BLOCK_E)  # bins: experts [0, E), then E for skipped ids (BLOCK_E > E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        key = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
        key = tl.where((key >= 0) & (key < num_experts), key, num_experts).to(tl.int32)
        counts += tl.histogram(key, BLOCK_E)
    padded = tl.where(e < num_experts, (counts + block_m - 1) // block_m * block_m, 0)
    pad_end = tl.cumsum(padded, 0)
    tl.store(pad_start_ptr + e, pad_end - padded)
    tl.store(seen_ptr + e, tl.zeros([BLOCK_E], tl.int32))
    tl.store(num_rows_ptr, tl.sum(padded, 0))
    # Block b's expert: the experts whose padded runs end at or before its first row (searchsorted).
    for b0 in range(0, max_rows // block_m, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        ended = (pad_end[None, :] <= (b * block_m)[:, None]) & (e[None, :] < num_experts)
        expert = tl.minimum(tl.sum(ended.to(tl.int32), 1), num_experts - 1)
        tl.store(block_expert_ptr + b, expert, mask=b < max_rows // block_m)
    for r0 in range(0, max_rows, BLOCK_P):
        r = r0 + tl.arange(0, BLOCK_P)
        tl.store(sorted_ptr + r, tl.zeros([BLOCK_P], tl.int32) + num_pairs, mask=r < max_rows)
    tl.debug_barrier()
    # Pair p's row: its expert's first row + the pairs of that expert before it (a stable sort).
    for p0 in range(0, num_pairs, BLOCK_P):
        i = tl.arange(0, BLOCK_P)
        p = p0 + i
        key = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
        key = tl.where((key >= 0) & (key < num_experts), key, num_experts).to(tl.int32)
        valid = key < num_experts
        earlier = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None])
        rank = tl.sum(earlier.to(tl.int32), 1)
        row = tl.load(pad_start_ptr + key, mask=valid, other=0) + tl.load(seen_ptr + key, mask=valid, other=0) + rank
        tl.store(sorted_ptr + row, p.to(tl.int32), mask=valid)
        seen = tl.load(seen_ptr + e) + tl.histogram(key, BLOCK_E)
        tl.debug_barrier()  # every lane has read the counts before they change
        tl.store(seen_ptr + e, seen)
        tl.debug_barrier()


@dataclass
class PlanBuffers:
    """Where ``align_pairs`` writes a plan, with its launch arguments (``plan_buffers``)."""

    plan: RoutePlan
    scratch: torch.Tensor  # [2, BLOCK_E] int32: padded starts, pairs placed so far
    max_rows: int

    def constexprs(self) -> dict:
        block_e = self.scratch.shape[1]
        return dict(BLOCK_P=_ALIGN_CHUNK, BLOCK_E=block_e, BLOCK_B=max(1, 4096 // block_e))


def plan_buffers(num_pairs: int, num_experts: int, block_m: int, device) -> PlanBuffers:
    max_rows = _max_rows(num_pairs, num_experts, block_m)
    plan = RoutePlan(sorted_pairs=torch.empty(max_rows, dtype=torch.int32, device=device),
                     block_expert=torch.empty(max_rows // block_m, dtype=torch.int32, device=device),
                     num_rows=torch.empty(1, dtype=torch.int32, device=device), block_m=block_m)
    scratch = torch.empty(2, pow2(num_experts + 1), dtype=torch.int32, device=device)
    return PlanBuffers(plan, scratch, max_rows)


def align_routes_fused(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    """``align_routes`` as one single-program kernel: a histogram of the experts, their padded
    runs' starts (a cumulative sum), each block's expert, then each pair's row in chunks of
    _ALIGN_CHUNK pairs (its rank among earlier pairs of its expert)."""
    flat = topk_ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    out = plan_buffers(flat.shape[0], num_experts, block_m, topk_ids.device)
    plan = out.plan
    _align_routes_kernel[(1,)](
        flat, plan.sorted_pairs, plan.block_expert, plan.num_rows, out.scratch[0], out.scratch[1],
        flat.shape[0], num_experts, out.max_rows, block_m, **out.constexprs(), num_warps=4,
    )
    return plan


def align_routes_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P] pairs
    num_pairs = flat.shape[0]
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # skipped ids sort last, into bucket E
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    # The skipped bucket gets no rows. (Not `padded[E] = 0`: indexing with a Python scalar copies a
    # host tensor to the device, which a CUDA graph capture refuses.)
    padded[num_experts:].zero_()
    pad_end = torch.cumsum(padded, 0)  # [E + 1]
    pad_start = pad_end - padded
    order = torch.argsort(key, stable=True)  # [P] pairs grouped by expert
    sorted_key = key[order]
    cnt_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - cnt_start[sorted_key]
    max_rows = _max_rows(num_pairs, num_experts, block_m)
    dest = torch.where(sorted_key < num_experts, pad_start[sorted_key] + rank, max_rows)  # skipped -> spill row
    sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, dest, order)
    block_start = torch.arange(max_rows // block_m, device=device) * block_m
    block_expert = torch.searchsorted(pad_end[:num_experts], block_start, right=True)
    return RoutePlan(
        sorted_pairs=sorted_pairs[:max_rows].to(torch.int32),
        block_expert=block_expert.clamp(max=num_experts - 1).to(torch.int32),
        num_rows=pad_end[num_experts - 1 : num_experts].to(torch.int32),
        block_m=block_m,
    )


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w13_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr, num_rows_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [M]
    row_ok = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    kk = tl.arange(0, BLOCK_K)
    w_gate = w13_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn  # rows [0, I) gate, [I, 2I) up
    w_up = w_gate + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + kk
        k_ok = k < hidden
        a = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_gate + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [K, N]
        wu = tl.load(w_up + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g += tl.dot(a, wg, input_precision=PRECISION)
        acc_u += tl.dot(a, wu, input_precision=PRECISION)
    dtype = act_ptr.dtype.element_ty
    # The reference rounds the GEMM output, then silu, then the product, to the activation dtype.
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    act = _silu_f32(gate).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * stride_act + n[None, :], act.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_rows_ptr,
    num_pairs, hidden, inter,
    stride_act, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [M]
    row_ok = pair < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    kk = tl.arange(0, BLOCK_K)
    w_rows = w2_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + kk
        k_ok = k < inter
        a = tl.load(act_ptr + pair[:, None] * stride_act + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    route_w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)  # float32
    out = acc.to(dtype).to(tl.float32) * route_w[:, None]
    tl.store(out_ptr + pair[:, None] * stride_out + n[None, :], out.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(
    pair_out_ptr, ids_ptr, shared_ptr, out_ptr, num_tokens, num_experts, hidden,
    stride_pair, stride_it, stride_ik, stride_shared, stride_out,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SHARED: tl.constexpr,
):
    """out[t] = sum over k of token t's pair rows, in float32 and in k order, rounded to the
    output dtype (a pair whose expert id lies outside [0, E) was skipped and adds nothing); then
    plus the shared experts' row, rounded again (as ``out + shared``)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
    t_ok = t < num_tokens
    t = t.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    ok = t_ok[:, None] & (n[None, :] < hidden)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * stride_it + k * stride_ik, mask=t_ok, other=-1)  # [T]
        routed = ok & ((e >= 0) & (e < num_experts))[:, None]
        row = tl.load(pair_out_ptr + (t * TOP_K + k)[:, None] * stride_pair + n[None, :], mask=routed, other=0.0)
        acc += row.to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + t[:, None] * stride_shared + n[None, :], mask=ok, other=0.0)
        out = (out.to(tl.float32) + shared.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t[:, None] * stride_out + n[None, :], out, mask=ok)


def _combine_tiles(num_tokens: int, hidden: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_N) of the combine: under the interpreter whole rows for many tokens (its
    cost is per program); on a GPU a few tokens per program, 4096 elements."""
    block_n = min(pow2(hidden), 1024)
    if interpreting():
        return min(pow2(num_tokens), max(1, 16384 // block_n)), block_n
    return min(pow2(num_tokens), max(1, 4096 // block_n)), block_n


def block_rows(num_pairs: int) -> int:
    """BLOCK_M of the expert GEMMs: the rows of one expert one program multiplies."""
    if interpreting():
        return MIN_DOT
    return 16 if num_pairs <= 64 else 32 if num_pairs <= 512 else 64


def _tiles(num_pairs: int, hidden: int, inter: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K)."""
    if interpreting():
        wide = min(pow2(max(hidden, inter), MIN_DOT), 128)
        return block_rows(num_pairs), wide, wide
    return block_rows(num_pairs), 64, 64


def moe_experts(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
    experts: ExpertWeights,
    shared: torch.Tensor | None = None,  # [T, H] added to the sum (the shared experts' output)
    plan: RoutePlan | None = None,  # the pairs' route plan where the router made it (block_m from block_rows)
) -> torch.Tensor:
    """sum_k w[t, k] * down(silu(gate(x)) * up(x)) over the chosen experts (+ shared) -> [T, H]."""
    num_tokens, hidden = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"moe_experts: topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
                         f"do not match {num_tokens} tokens")
    w13, w2 = experts.w13, experts.w2
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"moe_experts: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden {hidden}")
    if shared is not None and shared.shape != x.shape:
        raise ValueError(f"moe_experts: shared {tuple(shared.shape)} does not match x {tuple(x.shape)}")
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    block_m, block_n, block_k = _tiles(num_pairs, hidden, inter)
    if plan is None:
        plan = align_routes(topk_ids, num_experts, block_m)
    elif plan.block_m != block_m:
        raise ValueError(f"moe_experts: a route plan of {plan.block_m}-row blocks, the GEMMs tile {block_m}")
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    pair_out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)  # skipped pairs: never read
    route_w = topk_weights.to(torch.float32).reshape(-1).contiguous()
    precision = dot_precision(x.dtype)
    _gate_up_silu_kernel[(plan.max_blocks, triton.cdiv(inter, block_n))](
        x, w13, act, plan.sorted_pairs, plan.block_expert, plan.num_rows,
        num_pairs, top_k, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
    )
    _down_kernel[(plan.max_blocks, triton.cdiv(hidden, block_n))](
        act, w2, route_w, pair_out, plan.sorted_pairs, plan.block_expert, plan.num_rows,
        num_pairs, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
    )
    out = torch.empty_like(x)
    combine_t, combine_n = _combine_tiles(num_tokens, hidden)
    shared = None if shared is None else unit_last_stride(shared)
    _combine_kernel[(triton.cdiv(num_tokens, combine_t), triton.cdiv(hidden, combine_n))](
        pair_out, topk_ids, out if shared is None else shared, out, num_tokens, num_experts, hidden,
        pair_out.stride(0), topk_ids.stride(0), topk_ids.stride(1), 0 if shared is None else shared.stride(0),
        out.stride(0), TOP_K=top_k, BLOCK_T=combine_t, BLOCK_N=combine_n, HAS_SHARED=shared is not None,
    )
    return out
