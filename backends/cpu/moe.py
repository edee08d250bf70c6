"""DeepSeekMoE on the cpu backend: the router (V2 softmax, V3 sigmoid + correction bias, group
limits) and the routed experts.

Experts run one of three ways, chosen by cost (measured on a 2-core x86 CPU, per-op overhead
~5-10 us). One token (a batch-1 decode step, an MTP draft step's lm_head row) runs only its
top_k experts: a decode step streams every layer's weights from memory, and reading top_k / E of
the experts' weights beats the fewer ops of the dense path (E = 6, top-2, twelve layers cycled
as in a step: 82 against 112 us per layer; with the weights left in cache by a loop over one
layer, 55 against 45; MTP off at batch 1: 1.06x tokens/s, paired runs). When experts are few
(E <= 4 * top_k, as in small models) and so are the tokens (a decode step, an MTP
verification), every expert runs on every token in two GEMMs (gate/up of all experts; their
down projections side by side, which also sums them) with weight 0 for unchosen pairs: a few
large ops beat a loop of tiny ones (at E = 6, top-2: 78 us against 182 us for the 4 tokens of an
MTP K=3 verification; 89 against 254 us with the weights streamed from memory), and nothing
waits for the host. That computes E / top_k times
the FLOPs needed, which a prefill pays for: beyond DENSE_MAX_TOKENS tokens the experts run sorted
(1.7 ms against 3.8 ms per layer for a prefill of 16 prompts of 65 tokens). Many experts
(DeepSeek-V3: 256, top-8): a handful of (token, expert) pairs run only the chosen experts (a small
loop grouped on the host: it reads k experts' weights, not E); beyond that, tokens are sorted by
expert and each active expert runs once on its tokens.

Inside a compiled step experts blocked for rows_gemm (a bfloat16 checkpoint run in float32 on an
AVX-512 cpu) run as one ``rows_gemm.rows_experts`` call up to ROWS_EXPERTS_MAX_TOKENS tokens:
each chosen expert once on all its tokens, its weights read once, nothing waiting for the host.

Experts kept quantized (``QuantizedExpertWeights``: block FP8 or GGUF blocks,
mindspec/modeling/quantized.py) run only the chosen experts, each dequantized into the
activations' dtype when tokens are routed to it: a decode step reads k experts' quantized bytes
per token and writes a dequantized copy it drops after the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from mindspec.backend import ExpertWeights, LinearWeight, RouterConfig
from mindspec.modeling.quantized import QuantizedWeight

from . import rows_gemm
from .linear import linear, quantized_linear


@dataclass
class CpuExpertWeights(ExpertWeights):
    """The experts plus their GEMM weights as ``linear`` takes them (packed, see linear.py)."""

    w13_all: LinearWeight  # [E * 2I, H]: every expert's gate/up in one GEMM
    w13_each: list[LinearWeight]  # E x [2I, H]
    w2_each: list[LinearWeight]  # E x [H, I]
    w2_all: Optional[LinearWeight] = None  # [H, E * I]: the down projections side by side (dense path)
    # w13 / w2 in bfloat16 where every value is one (linear.narrow): the gathered path reads these
    w13_narrow: Optional[torch.Tensor] = None  # [E, 2I, H]
    w2_narrow: Optional[torch.Tensor] = None  # [E, H, I]
    # or, where the cpu runs rows_gemm, the same values blocked for it (and no narrow copies)
    w13_blocked: Optional[torch.Tensor] = None  # [E, ceil(2I / 32), H, 32]
    w2_blocked: Optional[torch.Tensor] = None  # [E, ceil(H / 32), I, 32]


@dataclass
class QuantizedExpertWeights(ExpertWeights):
    """Routed experts kept quantized (block FP8 with its scales, or GGUF blocks)."""

    w13: QuantizedWeight  # [E, 2I, H]
    w2: QuantizedWeight  # [E, H, I]


DENSE_EXPERTS_PER_CHOICE = 4  # with E <= this * top_k, run every expert on every token ...
DENSE_MAX_EXPERTS = DENSE_EXPERTS_PER_CHOICE * 8  # ... (top_k <= 8 in DeepSeek's models): w2_all only then
DENSE_MAX_TOKENS = 64  # ... of a batch this small (E = 6, top-2: dense 299 / sorted 333 us at 64 tokens, 425 / 378 at 96)
# With packed experts (linear.py), gate/up and down each one GEMM: dense 256 / 298 / 353 us against
# sorted 428 / 440 / 456 at 128 / 160 / 192 tokens, 568 against 564 at 320 (an MTP K=3 draft
# stage at batch 32 runs 160-192 rows).
DENSE_MAX_TOKENS_PACKED = 192
FEW_PAIRS = 8  # otherwise, up to this many (token, expert) pairs run only the chosen experts
# Inside a compiled step up to this many pairs gather their experts' weights: an MTP Vanilla draft
# stage at batch 1 (6 rows, 12 pairs) too, where the dense path's gate/up GEMM of every expert ran
# as a library call (~0.2 ms, twice a K=3 step; vanilla K=3 0.80 -> 0.88x compiled MTP off, paired
# runs, benchmarks/README.md). Beyond it, dense: gathered lost at batch 2's 16 verification pairs.
GATHERED_PAIRS = 12
# Inside a compiled step experts blocked for rows_gemm run its rows_experts up to this many tokens
# (an MTP verification at batch 16): each chosen expert once, on all its tokens.
ROWS_EXPERTS_MAX_TOKENS = 64


def moe_gate(
    x: torch.Tensor,  # [T, H]
    gate_weight: torch.Tensor,  # [E, H]
    correction_bias: Optional[torch.Tensor],  # [E] float32
    router: RouterConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router in float32 -> (weights [T, k] float32, ids [T, k] int64), as transformers does."""
    logits = F.linear(x.to(torch.float32), gate_weight.to(torch.float32))  # [T, E]
    if router.scoring == "softmax":
        weights, ids = _softmax_topk(logits.softmax(dim=-1, dtype=torch.float32), router)
    elif router.scoring == "sigmoid":
        weights, ids = _sigmoid_topk(logits.sigmoid(), correction_bias, router)
    else:
        raise ValueError(f"unknown router scoring {router.scoring!r}")
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * router.routed_scaling_factor).to(torch.float32), ids.to(torch.int64)


def _group_mask(group_scores: torch.Tensor, router: RouterConfig, num_experts: int) -> torch.Tensor:
    """[T, E] bool: experts in the topk_group best groups."""
    T, g = group_scores.shape
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask.unsqueeze(-1).expand(T, g, num_experts // g).reshape(T, num_experts)


def _softmax_topk(scores: torch.Tensor, router: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = scores.shape
    if router.topk_method == "group_limited_greedy":
        group_scores = scores.view(T, router.n_group, -1).max(dim=-1).values
        scores = scores.masked_fill(~_group_mask(group_scores, router, E), 0.0)
    elif router.topk_method != "greedy":
        raise ValueError(f"softmax router does not support topk_method {router.topk_method!r}")
    return torch.topk(scores, k=router.top_k, dim=-1, sorted=False)


def _sigmoid_topk(scores: torch.Tensor, bias: Optional[torch.Tensor], router: RouterConfig):
    T, E = scores.shape
    choice = scores if bias is None else scores + bias.to(torch.float32)
    groups = choice.view(T, router.n_group, -1)  # [T, n_group, E / n_group]
    top2 = groups if groups.shape[-1] == 2 else groups.topk(2, dim=-1)[0]  # a pair's sum needs no top-2
    group_scores = top2.sum(dim=-1)  # top-2 sum per group
    choice = choice.masked_fill(~_group_mask(group_scores, router, E), float("-inf"))
    ids = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


def moe_experts(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int64; ids outside [0, E) (another rank's experts) are skipped
    experts: ExpertWeights,
) -> torch.Tensor:
    """sum_k w[t, k] * down(silu(gate(x)) * up(x)) -> [T, H]; each weighted expert output is
    rounded to x's dtype before the sum, as transformers' index_add does."""
    T, k = topk_ids.shape
    E = experts.w13.shape[0]
    if T == 0:
        return torch.zeros_like(x)
    if isinstance(experts, QuantizedExpertWeights):
        return _sorted_experts(x, topk_weights, topk_ids, experts)
    few_experts = E <= DENSE_EXPERTS_PER_CHOICE * k
    if torch.compiler.is_compiling():  # no host round trip inside a compiled graph
        blocked = _blocked(experts)
        if blocked is not None and T <= ROWS_EXPERTS_MAX_TOKENS and rows_gemm.available():
            return rows_gemm.rows_experts(x, topk_ids, topk_weights, *blocked, experts.w13.shape[1] // 2)
        if T * k <= GATHERED_PAIRS:
            return _gathered_experts(x, topk_weights, topk_ids, experts)
        dense = few_experts and T * k >= E
        return (_dense_experts if dense else _sorted_experts)(x, topk_weights, topk_ids, experts)
    if T == 1 and k < E:  # read only the chosen experts' weights (module docstring)
        return _few_experts(x, topk_weights, topk_ids, experts)
    w13_all = _w13_all(experts)
    dense_max = DENSE_MAX_TOKENS if w13_all is None or w13_all.packed is None else DENSE_MAX_TOKENS_PACKED
    if few_experts and T <= dense_max:
        return _dense_experts(x, topk_weights, topk_ids, experts)
    if T * k <= FEW_PAIRS:
        return _few_experts(x, topk_weights, topk_ids, experts)
    return _sorted_experts(x, topk_weights, topk_ids, experts)


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    half = h.shape[-1] // 2
    return F.silu(h[..., :half]) * h[..., half:]


def _expert(x: torch.Tensor, experts: ExpertWeights, e: int) -> torch.Tensor:
    """Expert e on x [n, H] -> [n, H] (unweighted)."""
    if isinstance(experts, QuantizedExpertWeights):  # dequantized for this call only
        return quantized_linear(_silu_and_mul(quantized_linear(x, experts.w13[e])), experts.w2[e])
    if isinstance(experts, CpuExpertWeights):
        return linear(_silu_and_mul(linear(x, experts.w13_each[e])), experts.w2_each[e])
    return F.linear(_silu_and_mul(F.linear(x, experts.w13[e])), experts.w2[e])


def _w13_all(experts: ExpertWeights) -> Optional[LinearWeight]:
    return experts.w13_all if isinstance(experts, CpuExpertWeights) else None


def _gate_up_all(x: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
    """Every expert's gate/up on x [T, H] in one GEMM -> [T, E * 2I]."""
    w13_all = _w13_all(experts)
    if w13_all is not None:
        return linear(x, w13_all)
    E, two_i, H = experts.w13.shape
    return F.linear(x, experts.w13.view(E * two_i, H))


def _few_experts(x, topk_weights, topk_ids, experts: ExpertWeights) -> torch.Tensor:
    """A handful of (token, expert) pairs: group them on the host, run each chosen expert once."""
    E = experts.w13.shape[0]
    by_expert: dict[int, list[tuple[int, int]]] = {}
    for t, row in enumerate(topk_ids.tolist()):
        for j, e in enumerate(row):
            if 0 <= e < E:
                by_expert.setdefault(e, []).append((t, j))
    out = torch.zeros_like(x)
    for e in sorted(by_expert):  # ascending expert id: the order transformers sums in
        pairs = by_expert[e]
        tok = torch.tensor([t for t, _ in pairs], device=x.device)
        w = topk_weights[tok, torch.tensor([j for _, j in pairs], device=x.device)]  # [n] float32
        h = _expert(x[tok], experts, e)
        out.index_add_(0, tok, (h * w[:, None]).to(out.dtype))
    return out


def _gathered_experts(x, topk_weights, topk_ids, experts: ExpertWeights) -> torch.Tensor:
    """The few-pairs case without leaving the device: each (token, expert) pair gathers its
    expert's weights and runs as one row of a batched GEMV."""
    T, k = topk_ids.shape
    E, _, H = experts.w13.shape
    valid = (topk_ids >= 0) & (topk_ids < E)
    ids, w = topk_ids, topk_weights * valid  # an expert of another rank weighs 0
    if k > 2:  # summed in ascending expert id, as transformers does; two terms sum alike either way
        order = torch.where(valid, topk_ids, E).argsort(dim=1)
        ids, w = ids.gather(1, order), w.gather(1, order)
    ids = ids.clamp(0, E - 1).reshape(-1)  # [T*k]
    w = w.reshape(-1, 1)  # [T*k, 1] float32
    xs = x.repeat_interleave(k, dim=0)  # [T*k, H]
    w13, w2 = _narrow(experts)
    if w13 is None:
        h = _silu_and_mul(torch.bmm(experts.w13[ids], xs[:, :, None])[..., 0])  # [T*k, I]
        y = torch.bmm(experts.w2[ids], h[:, :, None])[..., 0]  # [T*k, H]
    else:  # as linear.thin_linear: half the bytes, the same products in x's dtype
        h = _silu_and_mul((w13[ids].to(x.dtype) * xs[:, None, :]).sum(dim=-1))  # [T*k, I]
        y = (w2[ids].to(x.dtype) * h[:, None, :]).sum(dim=-1)  # [T*k, H]
    return (y * w).to(x.dtype).view(T, k, H).sum(dim=1)


def _blocked(experts: ExpertWeights) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(experts, CpuExpertWeights) and experts.w13_blocked is not None and experts.w2_blocked is not None:
        return experts.w13_blocked, experts.w2_blocked
    return None


def _narrow(experts: ExpertWeights) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if isinstance(experts, CpuExpertWeights) and experts.w13_narrow is not None and experts.w2_narrow is not None:
        return experts.w13_narrow, experts.w2_narrow
    return None, None


def _dense_experts(x, topk_weights, topk_ids, experts: ExpertWeights) -> torch.Tensor:
    """Every expert on every token, unchosen pairs weighted 0. The down projection is linear, so
    the routing weight scales its input, and one GEMM against the experts' down projections side
    by side does all of them and their weighted sum (426 -> 278 us at 128 tokens, 47 -> 35 at one,
    against a bmm, a multiply and a sum over experts). The sum happens in the GEMM's accumulator,
    so in bfloat16 the experts' outputs are not rounded one by one as in transformers."""
    E, two_i, H = experts.w13.shape
    T = x.shape[0]
    # Routing weights scattered to [T, E]; an id outside [0, E) lands in the dropped column E.
    ids = torch.where((topk_ids >= 0) & (topk_ids < E), topk_ids, E)
    dense_w = torch.zeros(T, E + 1, dtype=torch.float32, device=x.device)
    dense_w.scatter_add_(1, ids, topk_weights.to(torch.float32))  # a repeated id adds up
    h = _silu_and_mul(_gate_up_all(x, experts).view(T, E, two_i))  # [T, E, I]
    h = (h * dense_w[:, :E, None]).to(x.dtype).view(T, E * (two_i // 2))
    if isinstance(experts, CpuExpertWeights) and experts.w2_all is not None:
        return linear(h, experts.w2_all)
    return F.linear(h, _down_side_by_side(experts.w2))


def _down_side_by_side(w2: torch.Tensor) -> torch.Tensor:
    """w2 [E, H, I] -> [H, E * I]: column block e is expert e's down projection."""
    E, H, I = w2.shape
    return w2.permute(1, 0, 2).reshape(H, E * I)


def _sorted_experts(x, topk_weights, topk_ids, experts: ExpertWeights) -> torch.Tensor:
    out = torch.zeros_like(x)
    E = experts.w13.shape[0]
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_idx = order // k
    flat_w = topk_weights.reshape(-1)[order]
    counts = torch.bincount(flat_ids.clamp(-1, E) + 1, minlength=E + 2).tolist()  # [<0, 0..E-1, >=E]
    start = counts[0]
    for e, n in enumerate(counts[1 : E + 1]):
        if n == 0:
            continue
        sl = slice(start, start + n)
        start += n
        tok = token_idx[sl]
        h = _expert(x[tok], experts, e)
        out.index_add_(0, tok, (h * flat_w[sl, None]).to(out.dtype))  # weighted in float32, as HF
    return out
