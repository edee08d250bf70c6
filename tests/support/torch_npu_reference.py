"""Reference implementations of the torch_npu ops mindspec's npu backend calls. TEST SUPPORT ONLY.

Nothing in this module runs on, or pretends to be, an Ascend NPU. Every op is plain torch on the
host, written from the op's documented semantics, and refuses (``OpRefused``, a RuntimeError like
the real ops' parameter checks) what the documents say the real op refuses: dtypes, layouts, host
lists versus tensors, shape limits. Modes the backend does not use raise ``NotModelled`` instead of
guessing. Where documents are silent or disagree between versions, the choice is marked
"(unconfirmed)" or "(stricter)" next to the rule.

``installed()`` puts this module into ``sys.modules["torch_npu"]`` and a host stand-in into
``torch.npu`` (device queries that report no NPU, streams and events that run synchronously, memory
figures, and an emulated graph capture, see section 7) for the duration of a test, and undoes both.
``REFERENCE_ON_HOST`` tells the npu backend it may run on device "cpu" with this module.

Sources: shared/reference/npu_ops.md (vllm-ascend and op-plugin notes) and the op-plugin API docs
torch_npu-npu_fused_infer_attention_score(_v2).md, -npu_kv_rmsnorm_rope_cache.md,
-npu_moe_gating_top_k.md, -npu_moe_init_routing_v2.md, -npu_grouped_matmul.md; CANN's
aclnnMoeTokenUnpermute and aclnnScatterPaKvCache docs; vLLM's torch top-k/top-p (the semantics
npu_top_k_top_p replaces in vllm-ascend).
"""
from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

REFERENCE_ON_HOST = True
__version__ = "0+host-reference"

HALF = (torch.float16, torch.bfloat16)
FLOATS = HALF + (torch.float32,)
MASK_SIZE = 2048


class OpRefused(RuntimeError):
    """The real op's parameter check would reject these arguments."""


class NotModelled(NotImplementedError):
    """A documented mode of the op that this reference does not implement."""


class GraphCaptureError(RuntimeError):
    """Something a captured NPU graph cannot do (host synchronisation, a wait that never ends)."""


# ================================================================================================
# 1. Bookkeeping: call log, argument checks
# ================================================================================================


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict


CALLS: list[Call] = []  # every op call, in order, for argument-contract tests


def calls(name: str) -> list[Call]:
    return [c for c in CALLS if c.name == name]


def _logged(name: str):
    def wrap(fn):
        def op(*args, **kwargs):
            CALLS.append(Call(name, args, dict(kwargs)))
            return fn(*args, **kwargs)

        op.__name__ = name
        op.__doc__ = fn.__doc__
        return op

    return wrap


def _need(ok: bool, op: str, msg: str) -> None:
    if not ok:
        raise OpRefused(f"{op}: {msg}")


def _dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    _need(t.dtype in allowed, op, f"{name} dtype {t.dtype} not supported (takes {', '.join(map(str, allowed))})")


def _host_ints(op: str, name: str, value) -> list[int]:
    """SymInt[] arguments are Python int lists; a device tensor is refused."""
    _need(isinstance(value, (list, tuple)), op, f"{name} must be a host list of ints (SymInt[]), got {type(value).__name__}")
    _need(all(isinstance(v, int) and not isinstance(v, bool) for v in value), op, f"{name} must hold Python ints")
    return list(value)


def _eager() -> bool:
    """Value checks need the data on the host: real ops check values on the device (or not at all),
    so inside an emulated graph capture they are skipped rather than turned into host syncs."""
    return _STATE.recorder is None


def _unset(op: str, **kwargs) -> None:
    for name, value in kwargs.items():
        if value is not None:
            raise NotModelled(f"{op}: argument {name} is not modelled by this reference")


# ================================================================================================
# 2. Norms, activation, rope
# ================================================================================================


@_logged("npu_rms_norm")
def npu_rms_norm(self, gamma, epsilon=1e-6):
    """-> (y, rstd): y = x * rsqrt(mean(x^2) + eps) * gamma over gamma's dims, in float32, cast once."""
    op = "npu_rms_norm"
    _dtype(op, "x", self, FLOATS)
    _need(gamma.dtype == self.dtype, op, f"gamma dtype {gamma.dtype} != x dtype {self.dtype} (stricter)")
    _need(tuple(gamma.shape) == tuple(self.shape[self.dim() - gamma.dim():]), op,
          f"gamma shape {tuple(gamma.shape)} must equal the trailing dims of x {tuple(self.shape)}")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


@_logged("npu_add_rms_norm")
def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """-> (y, rstd, x): x = x1 + x2 (the new residual), y = RMSNorm(x) * gamma."""
    op = "npu_add_rms_norm"
    _dtype(op, "x1", x1, FLOATS)
    _need(x1.dtype == x2.dtype == gamma.dtype, op, f"x1/x2/gamma dtypes differ: {x1.dtype}/{x2.dtype}/{gamma.dtype}")
    _need(x1.shape == x2.shape, op, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
    summed = x1.float() + x2.float()  # (unconfirmed) y is normalised from the float32 sum
    rstd = torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + epsilon)
    return (summed * rstd * gamma.float()).to(x1.dtype), rstd, summed.to(x1.dtype)


@_logged("npu_swiglu")
def npu_swiglu(input, dim=-1):
    """silu(first half) * second half along ``dim``."""
    op = "npu_swiglu"
    _dtype(op, "x", input, FLOATS)
    _need(input.shape[dim] % 2 == 0, op, f"size {input.shape[dim]} of dim {dim} is odd")
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Last dim [x0, x1, x2, ...] viewed as [.., D/2, 2], transposed -> [x0, x2, ..., x1, x3, ...]."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(*x.shape[:-1], d)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _interleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The documented RoPE of both Ascend rope ops: de-interleave, then rotate-half (float32)."""
    k = _deinterleave(x.float())
    return k * cos.float() + _rotate_half(k) * sin.float()


@_logged("npu_interleave_rope")
def npu_interleave_rope(x, cos, sin):
    """x [B, N, S, 64], cos/sin [B, 1, S, 64] -> [B, N, S, 64] in the de-interleaved (half) order."""
    op = "npu_interleave_rope"
    _need(x.dim() == 4, op, f"x must be 4-D [B, N, S, D], got {tuple(x.shape)}")
    _dtype(op, "x", x, HALF)
    B, N, S, D = x.shape
    _need(D == 64, op, f"D must be 64, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        _need(tuple(t.shape) == (B, 1, S, D), op, f"{name} must be [B, 1, S, D] = {(B, 1, S, D)}, got {tuple(t.shape)}")
        _need(t.dtype == x.dtype, op, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
    return _interleave_rope(x, cos, sin).to(x.dtype)


# ================================================================================================
# 3. Paged cache writes
# ================================================================================================


def _scatter_rows(flat: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """flat[index[t]] = rows[t] for index >= 0; negative entries are skipped. No host sync (so it
    can be captured): rows are sorted by slot and written through a mask of the hit slots."""
    n = flat.shape[0]
    valid = index >= 0
    safe = torch.where(valid, index, torch.zeros_like(index))
    hit = torch.zeros(n, dtype=torch.int32, device=flat.device).scatter_reduce_(0, safe, valid.to(torch.int32), "amax")
    order = torch.argsort(torch.where(valid, index, torch.full_like(index, n)), stable=True)
    flat.masked_scatter_(hit.bool()[:, None].expand_as(flat), rows[order].to(flat.dtype))


def _check_slots(op: str, index: torch.Tensor, capacity: int) -> None:
    if not _eager():
        return
    used = index[index >= 0]
    _need(bool((used < capacity).all()), op, f"slot index beyond the cache ({capacity} slots)")
    _need(used.unique().numel() == used.numel(), op, "repeated slot indices (the op's behaviour is undefined)")


@_logged("npu_kv_rmsnorm_rope_cache")
def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                              k_rope_offset=None, c_kv_offset=None, epsilon=1e-5, cache_mode="Norm", is_output_kv=False):
    """kv [B, 1, S, 576] -> RMSNorm(kv[..., :512]) * gamma into ckv_cache and RoPE(kv[..., 512:])
    (de-interleave + rotate-half) into k_cache at ``index``; -> (k_cache, ckv_cache, k_embed_out
    [B, 1, S, 64], y_out [B, 1, S, 512]), the last two only with is_output_kv (PA modes)."""
    op = "npu_kv_rmsnorm_rope_cache"
    _unset(op, k_rope_scale=k_rope_scale, c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset, c_kv_offset=c_kv_offset)
    if cache_mode not in ("PA", "PA_BNSD"):
        raise NotModelled(f"{op}: cache_mode {cache_mode!r} is not modelled (PA / PA_BNSD are)")
    _need(kv.dim() == 4 and kv.shape[1] == 1 and kv.shape[-1] == 576, op,
          f"kv must be [batch, 1, seq, 576] (512 + 64 only), got {tuple(kv.shape)}")
    _dtype(op, "kv", kv, HALF)
    B, _, S, _ = kv.shape
    _need(tuple(gamma.shape) == (512,) and gamma.dtype == kv.dtype, op, f"gamma must be [512] in {kv.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        _need(tuple(t.shape) == (B, 1, S, 64), op, f"{name} must be [batch, 1, seq, 64], got {tuple(t.shape)}")
        _need(t.dtype == kv.dtype, op, f"{name} dtype {t.dtype} != kv dtype {kv.dtype}")
    _need(index.dtype == torch.int64, op, f"index must be int64, got {index.dtype}")
    _need(tuple(index.shape) == (B * S,), op, f"index must be [batch * seq] = [{B * S}] in PA mode, got {tuple(index.shape)}")
    for name, t, d in (("k_cache", k_cache, 64), ("ckv_cache", ckv_cache, 512)):
        _need(t.dim() == 4 and t.shape[2] == 1 and t.shape[3] == d, op,
              f"{name} must be [block_num, block_size, 1, {d}] in PA mode, got {tuple(t.shape)}")
        _need(t.dtype == kv.dtype, op, f"{name} dtype {t.dtype} != kv dtype {kv.dtype} (non-quantised)")
        _need(t.is_contiguous(), op, f"{name} must be a contiguous ND tensor (written in place)")
    _need(k_cache.shape[:2] == ckv_cache.shape[:2], op, "k_cache and ckv_cache have different block layouts")
    _check_slots(op, index, ckv_cache.shape[0] * ckv_cache.shape[1])
    x = kv.float()
    rms_in, rope_in = x[..., :512], x[..., 512:]
    y = (rms_in * torch.rsqrt(rms_in.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()).to(kv.dtype)
    k_embed = _interleave_rope(rope_in, cos, sin).to(kv.dtype)
    _scatter_rows(ckv_cache.view(-1, 512), index, y.reshape(-1, 512))
    _scatter_rows(k_cache.view(-1, 64), index, k_embed.reshape(-1, 64))
    if not is_output_kv:
        return k_cache, ckv_cache, kv.new_empty(0), kv.new_empty(0)
    return k_cache, ckv_cache, k_embed, y


@_logged("npu_scatter_pa_kv_cache")
def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="Norm"):
    """'Norm' mode: key [T, N, Dk], value [T, N, Dv] into key_cache [nb, bs, N, Dk] and value_cache
    [nb, bs, N, Dv] at slot_mapping [T]; slots < 0 are skipped (op-plugin's test golden)."""
    op = "npu_scatter_pa_kv_cache"
    _unset(op, compress_lens=compress_lens, compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens)
    if cache_mode != "Norm":
        raise NotModelled(f"{op}: cache_mode {cache_mode!r} is not modelled (Norm is)")
    _dtype(op, "key", key, HALF + (torch.int8,))  # A2/A3: float16, bfloat16, int8
    _need(key.dim() == 3 and value.dim() == 3 and key.shape[:2] == value.shape[:2], op,
          f"key/value must be [tokens, heads, dim] with equal tokens and heads, got {tuple(key.shape)}, {tuple(value.shape)}")
    _need(slot_mapping.dtype in (torch.int32, torch.int64), op, f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    _need(tuple(slot_mapping.shape) == (key.shape[0],), op, "slot_mapping must hold one slot per token")
    for name, src, cache in (("key", key, key_cache), ("value", value, value_cache)):
        _need(cache.dim() == 4 and tuple(cache.shape[2:]) == tuple(src.shape[1:]), op,
              f"{name}_cache must be [num_blocks, block_size, heads, dim] matching {name}, got {tuple(cache.shape)}")
        _need(cache.dtype == src.dtype, op, f"{name}_cache dtype {cache.dtype} != {name} dtype {src.dtype}")
        _need(cache.is_contiguous(), op, f"{name}_cache must be contiguous (written in place)")
    _need(key_cache.shape[:2] == value_cache.shape[:2], op, "key and value caches have different block layouts")
    index = slot_mapping.to(torch.int64)
    _check_slots(op, index, key_cache.shape[0] * key_cache.shape[1])
    _scatter_rows(key_cache.view(-1, key_cache.shape[2] * key_cache.shape[3]), index, key.reshape(key.shape[0], -1))
    _scatter_rows(value_cache.view(-1, value_cache.shape[2] * value_cache.shape[3]), index, value.reshape(value.shape[0], -1))


# ================================================================================================
# 4. Attention: npu_fused_infer_attention_score (v1) and _v2, MLA paths
# ================================================================================================


@dataclass
class _Fia:
    """Arguments of either FIA version under one set of names."""

    op: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_rope: Optional[torch.Tensor]
    key_rope: Optional[torch.Tensor]
    atten_mask: Optional[torch.Tensor]
    qlen: Any
    kvlen: Any
    block_table: Optional[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    scale: float
    layout: str
    sparse_mode: int
    block_size: int
    lse: bool


def _check_mask(a: _Fia) -> None:
    _need(a.atten_mask is not None, a.op, f"sparse_mode {a.sparse_mode} needs the optimised 2048 x 2048 atten_mask")
    m = a.atten_mask
    _need(m.dtype in (torch.bool, torch.int8, torch.uint8), a.op, f"atten_mask dtype {m.dtype} (bool/int8/uint8)")
    _need(tuple(m.shape) in ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE)), a.op,
          f"sparse_mode {a.sparse_mode} takes a fixed 2048 x 2048 mask, got {tuple(m.shape)}")
    if _eager():
        canonical = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool), diagonal=1)
        _need(torch.equal(m.reshape(MASK_SIZE, MASK_SIZE).bool().cpu(), canonical), a.op,
              "the sparse_mode 3 mask must be triu(ones, 1) (1 = masked above the diagonal)")


def _sparse(a: _Fia, q_lens: list[int], mla: bool) -> None:
    """D=512: Q_S == 1 only sparse 0 without mask, Q_S > 1 only sparse 3 with mask; TND otherwise
    sparse 0 without mask or 3 with mask."""
    if mla and max(q_lens) == 1:
        _need(a.sparse_mode == 0 and a.atten_mask is None, a.op,
              "one query token per request takes sparse_mode 0 and no mask")
    elif mla:
        _need(a.sparse_mode == 3, a.op, f"more than one query token per request takes sparse_mode 3, got {a.sparse_mode}")
        _check_mask(a)
    elif a.sparse_mode == 0:
        _need(a.atten_mask is None, a.op, "TND with sparse_mode 0 takes no mask")
    else:
        _need(a.sparse_mode == 3, a.op, f"TND takes sparse_mode 0 or 3, got {a.sparse_mode}")
        _check_mask(a)


def _cumulative(op: str, name: str, ends: list[int], total: Optional[int]) -> list[int]:
    """Cumulative ends -> per-request lengths, checking they never decrease."""
    lens, prev = [], 0
    for e in ends:
        _need(e >= prev, op, f"{name} must be cumulative (non-decreasing), got {ends}")
        lens.append(e - prev)
        prev = e
    if total is not None:
        _need(prev == total, op, f"{name} must end at the token count {total}, got {ends}")
    return lens


def _attend(q, q_rope, k, k_rope, v, scale, causal: bool, lse: bool):
    """One request. q [Q, N, D], k/v [K, KN, D] (KN divides N); causal aligned bottom-right."""
    Q, N, _ = q.shape
    K, KN = k.shape[0], k.shape[1]
    rep = N // KN
    kf, krf, vf = (t.float().repeat_interleave(rep, dim=1) for t in (k, k_rope, v))
    s = (torch.einsum("qnd,knd->nqk", q.float(), kf) + torch.einsum("qnr,knr->nqk", q_rope.float(), krf)) * scale
    if causal:
        allowed = torch.arange(K)[None, :] <= (K - Q) + torch.arange(Q)[:, None]  # [Q, K]
        s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    out = torch.einsum("nqk,knd->qnd", torch.softmax(s, dim=-1), vf).to(q.dtype)
    return out, (torch.logsumexp(s, dim=-1).transpose(0, 1)[..., None] if lse else None)  # lse [Q, N, 1]


def _fia_mla_paged(a: _Fia):
    """query D 512 + rope 64 over the paged latent cache (key = value), key heads 1."""
    op = a.op
    _need(a.query.dim() == 3, op, f"TND query must be 3-D [T, N, D], got {tuple(a.query.shape)}")
    T, N, _ = a.query.shape
    _need(N == a.num_heads, op, f"num heads {a.num_heads} != query heads {N}")
    _need(N in (32, 64, 128), op, f"MLA with D 512 takes 32, 64 or 128 query heads (v2 doc; stricter), got {N}")
    _need(a.num_kv_heads == 1, op, f"MLA takes 1 key/value head, got {a.num_kv_heads}")
    _need(tuple(a.query_rope.shape) == (T, N, 64), op, f"query_rope must be [T, N, 64], got {tuple(a.query_rope.shape)}")
    _need(a.block_table is not None, op, "query D 512 needs page attention (block_table)")
    bt = a.block_table
    _need(bt.dtype == torch.int32 and bt.dim() == 2, op, f"block_table must be a 2-D int32 tensor, got {bt.dtype} {tuple(bt.shape)}")
    _need(a.block_size in (16, 128), op, f"block_size must be 16 or 128 for the ND MLA cache, got {a.block_size}")
    key = a.key
    if key.dim() == 4:
        _need(key.shape[1] == 1, op, "4-D key must be [blocks, 1, block_size, D]")
        key = key[:, 0]
    _need(key.dim() == 3 and key.shape[1] == a.block_size and key.shape[2] == 512, op,
          f"paged key must be [blocks, block_size, 512], got {tuple(a.key.shape)}")
    _need(a.value.shape == a.key.shape, op, "key and value shapes must be identical")
    _need(key.dtype == a.query.dtype, op, f"key dtype {key.dtype} != query dtype {a.query.dtype}")
    kr = a.key_rope.reshape(key.shape[0], key.shape[1], -1)
    _need(kr.shape[-1] == 64 and kr.dtype == key.dtype, op, "key_rope must be [blocks, block_size, 64] in the key dtype")
    _need(not a.lse, op, "softmax lse is not supported with query D 512")
    ends = _host_ints(op, "actual_seq_qlen", a.qlen) if a.qlen is not None else None
    _need(ends is not None, op, "TND needs actual_seq_qlen (cumulative query ends)")
    _need(a.kvlen is not None, op, "page attention needs actual_seq_kvlen")
    kv_lens = _host_ints(op, "actual_seq_kvlen", a.kvlen)
    B = len(ends)
    _need(B == bt.shape[0], op, f"{B} requests in actual_seq_qlen but block_table has {bt.shape[0]} rows")
    _need(len(kv_lens) == B, op, f"actual_seq_kvlen has {len(kv_lens)} entries for {B} requests (per request, not cumulative)")
    _need(B <= 4096, op, f"at most 4096 requests in TND, got {B}")
    q_lens = _cumulative(op, "actual_seq_qlen", ends, T)
    _need(all(1 <= q <= 16 for q in q_lens), op, f"TND with query D 512 takes 1..16 query tokens per request, got {q_lens}")
    _sparse(a, q_lens, mla=True)
    outs, start = [], 0
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        _need(q <= kv, op, f"request {b}: {q} query tokens but only {kv} key tokens")
        blocks = -(-kv // a.block_size)
        _need(blocks <= bt.shape[1], op, f"request {b}: {kv} tokens need {blocks} blocks, block_table has {bt.shape[1]}")
        rows = bt[b, :blocks].long()
        k = key[rows].reshape(-1, 1, 512)[:kv]
        k_rope = kr[rows].reshape(-1, 1, 64)[:kv]
        out, _ = _attend(a.query[start:start + q], a.query_rope[start:start + q], k, k_rope, k, a.scale,
                         causal=a.sparse_mode == 3, lse=False)
        outs.append(out)
        start += q
    out = torch.cat(outs)  # [T, N, 512]
    return out, torch.zeros(1, dtype=torch.float32, device=out.device)


def _fia_tnd_rope(a: _Fia):
    """Unpaged TND: q/k/v D 128 with rope 64, bfloat16 only (the MLA prefill path)."""
    op = a.op
    _need(a.block_table is None, op, "page attention is not supported with query D 128 and rope")
    for name, t in (("query", a.query), ("key", a.key), ("value", a.value), ("query_rope", a.query_rope), ("key_rope", a.key_rope)):
        _need(t.dim() == 3, op, f"TND {name} must be 3-D, got {tuple(t.shape)}")
        _dtype(op, name, t, (torch.bfloat16,))
    T, N, D = a.query.shape
    Tk, KN, _ = a.key.shape
    _need(D == 128 and a.key.shape[2] == 128 and a.value.shape[2] == 128, op, "with query_rope, q/k/v D must be 128")
    _need(a.query_rope.shape == (T, N, 64) and a.key_rope.shape == (Tk, KN, 64), op, "query_rope/key_rope must be [., heads, 64]")
    _need(a.value.shape[:2] == (Tk, KN), op, "key and value must have equal tokens and heads")
    _need(N == a.num_heads and a.num_kv_heads in (0, KN) and (a.num_kv_heads or N) == KN, op,
          f"head counts: query {N} (num_heads {a.num_heads}), key/value {KN} (num_key_value_heads {a.num_kv_heads})")
    _need(N % KN == 0 and N // KN <= 64, op, f"query heads {N} must be a multiple of key heads {KN}, ratio <= 64")
    _need(a.qlen is not None and a.kvlen is not None, op, "TND needs both cumulative length lists")
    q_ends = _host_ints(op, "actual_seq_lengths (q)", a.qlen)
    kv_ends = _host_ints(op, "actual_seq_lengths_kv", a.kvlen)
    _need(len(q_ends) == len(kv_ends) <= 4096, op, "one entry per request in both lists, at most 4096 requests")
    q_lens = _cumulative(op, "query lengths", q_ends, T)
    kv_lens = _cumulative(op, "key lengths", kv_ends, Tk)
    _sparse(a, q_lens, mla=False)
    outs, lses, qs, ks = [], [], 0, 0
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        if a.sparse_mode == 3:
            _need(q <= kv, op, f"request {b}: sparse_mode 3 needs query length <= key length, got {q} > {kv}")
        out, lse = _attend(a.query[qs:qs + q], a.query_rope[qs:qs + q], a.key[ks:ks + kv], a.key_rope[ks:ks + kv],
                           a.value[ks:ks + kv], a.scale, causal=a.sparse_mode == 3, lse=a.lse)
        outs.append(out)
        lses.append(lse)
        qs, ks = qs + q, ks + kv
    out = torch.cat(outs)
    lse = torch.cat(lses) if a.lse else torch.zeros(1, dtype=torch.float32, device=out.device)
    return out, lse


def _fia(a: _Fia):
    op = a.op
    _need((a.query_rope is None) == (a.key_rope is None), op, "query_rope and key_rope must be given together")
    if a.query_rope is None:
        raise NotModelled(f"{op}: attention without query_rope/key_rope is not modelled")
    if a.layout not in ("TND", "TND_NTD"):
        raise NotModelled(f"{op}: input_layout {a.layout!r} is not modelled (TND, TND_NTD are)")
    for name, t in (("query", a.query), ("query_rope", a.query_rope)):
        _need(t.is_contiguous(), op, f"{name} must be contiguous")
        _dtype(op, name, t, HALF)
    _need(a.query_rope.dtype == a.query.dtype, op, "query_rope dtype must equal the query dtype")
    d = a.query.shape[-1]
    _need(d in (512, 128), op, f"with query_rope, query D must be 512 or 128, got {d}")
    out, lse = _fia_mla_paged(a) if d == 512 else _fia_tnd_rope(a)
    if a.layout == "TND_NTD":
        out = out.transpose(0, 1).contiguous()
    return out, lse


_V2_DEFAULTS = dict(pse_shift=None, dequant_scale_query=None, dequant_scale_key=None, dequant_offset_key=None,
                    dequant_scale_value=None, dequant_offset_value=None, dequant_scale_key_rope=None,
                    quant_scale_out=None, quant_offset_out=None)


def _fia_v2_args(query, key, value, *, query_rope=None, key_rope=None, atten_mask=None, actual_seq_qlen=None,
                 actual_seq_kvlen=None, block_table=None, num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0,
                 pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH", sparse_mode=0, block_size=0,
                 query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0, return_softmax_lse=False,
                 **rest) -> _Fia:
    op = "npu_fused_infer_attention_score_v2"
    _unset(op, **{k: v for k, v in rest.items() if k in _V2_DEFAULTS or not k.endswith("_dtype")})
    if key_quant_mode or value_quant_mode or query_quant_mode:
        raise NotModelled(f"{op}: quantised modes are not modelled")
    return _Fia(op, query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                num_query_heads, num_key_value_heads, softmax_scale, input_layout, sparse_mode, block_size, return_softmax_lse)


def _fia_v1_args(query, key, value, *, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
                 block_table=None, query_rope=None, key_rope=None, num_heads=1, scale=1.0, pre_tokens=2147483647,
                 next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
                 block_size=0, antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0, value_antiquant_mode=0,
                 **rest) -> _Fia:
    op = "npu_fused_infer_attention_score"
    _unset(op, **rest)
    if antiquant_mode or key_antiquant_mode or value_antiquant_mode:
        raise NotModelled(f"{op}: antiquant modes are not modelled")
    return _Fia(op, query, key, value, query_rope, key_rope, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                block_table, num_heads, num_key_value_heads, scale, input_layout, sparse_mode, block_size, softmax_lse_flag)


class _FiaOp:
    """Callable op with the ``.out`` variant graph capture uses (workspace + preallocated outputs)."""

    def __init__(self, name: str, parse):
        self.name, self.parse = name, parse

    def __call__(self, query, key, value, **kwargs):
        CALLS.append(Call(self.name, (query, key, value), dict(kwargs)))
        return _fia(self.parse(query, key, value, **kwargs))

    def out(self, query, key, value, *, workspace, out, **kwargs):
        CALLS.append(Call(self.name + ".out", (query, key, value), dict(kwargs, workspace=workspace, out=out)))
        _need(isinstance(workspace, torch.Tensor), self.name, "the .out variant needs the workspace tensor")
        result, lse = _fia(self.parse(query, key, value, **kwargs))
        _need(out[0].shape == result.shape and out[0].dtype == result.dtype, self.name,
              f"out[0] must be {tuple(result.shape)} {result.dtype}, got {tuple(out[0].shape)} {out[0].dtype}")
        out[0].copy_(result)
        if out[1].shape == lse.shape:
            out[1].copy_(lse)
        return out


npu_fused_infer_attention_score = _FiaOp("npu_fused_infer_attention_score", _fia_v1_args)
npu_fused_infer_attention_score_v2 = _FiaOp("npu_fused_infer_attention_score_v2", _fia_v2_args)


def _workspace(name: str, parse):
    def get_max_workspace(query, key, value, **kwargs):
        CALLS.append(Call(name, (query, key, value), dict(kwargs)))
        parse(query, key, value, **kwargs)  # the same argument checks as the op
        return torch.empty(1 << 10, dtype=torch.uint8, device=query.device)  # size: (unconfirmed) placeholder

    return get_max_workspace


_npu_fused_infer_attention_score_get_max_workspace = _workspace(
    "_npu_fused_infer_attention_score_get_max_workspace", _fia_v1_args)
_npu_fused_infer_attention_score_v2_get_max_workspace = _workspace(
    "_npu_fused_infer_attention_score_v2_get_max_workspace", _fia_v2_args)


# ================================================================================================
# 5. MoE: gating, routing, grouped matmul, unpermute
# ================================================================================================


@_logged("npu_moe_gating_top_k")
def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """Sigmoid scores (+ bias for selection only), groups ranked by max (mode 0) or top-2 sum (mode
    1), top-k_group groups kept, top-k experts among them; weights are the unbiased scores,
    renormalised (sum + eps) and times routed_scaling_factor -> (y [T, k] x.dtype, ids int32, norm_out)."""
    op = "npu_moe_gating_top_k"
    _need(x.dim() == 2, op, f"x must be 2-D, got {tuple(x.shape)}")
    _dtype(op, "x", x, FLOATS)
    E = x.shape[-1]
    _need(E <= 2048, op, f"at most 2048 experts, got {E}")
    _need(renorm == 0, op, f"renorm must be 0 (norm, then top-k), got {renorm}")
    if norm_type != 1:
        raise NotModelled(f"{op}: norm_type {norm_type} (softmax) is not modelled: its renormalisation is unconfirmed")
    _need(group_select_mode in (0, 1), op, f"group_select_mode must be 0 or 1, got {group_select_mode}")
    _need(group_count > 0 and E % group_count == 0 and E // group_count > 2, op,
          f"{E} experts must split into group_count {group_count} groups of more than 2")
    per_group = E // group_count
    _need(-(-per_group // 32) * 32 * group_count <= 2048, op, "32-aligned group size times group_count must be <= 2048")
    _need(1 <= k_group <= group_count, op, f"k_group {k_group} must be in [1, group_count {group_count}]")
    _need(1 <= k <= per_group * k_group, op, f"k {k} must be in [1, {per_group * k_group}]")
    # Atlas A2/A3 (PyTorch 7.0.0 docs; stricter): 256 experts, k_group 4, k <= 32, bias required.
    _need(E == 256 and k_group == 4 and k <= 32 and bias is not None, op,
          f"A2/A3 take 256 experts, k_group 4, k <= 32 and a bias; got {E}, {k_group}, {k}, bias {bias is not None}")
    _need(tuple(bias.shape) == (E,) and bias.dtype == x.dtype, op, f"bias must be [{E}] in {x.dtype}")
    scores = torch.sigmoid(x.float())  # normOut
    choice = scores + bias.float()
    grouped = choice.view(-1, group_count, per_group)
    group_score = grouped.max(-1).values if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(k_group, dim=-1).indices, 1.0)
    choice = choice.masked_fill(keep.repeat_interleave(per_group, dim=1) == 0, float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    y = w / (w.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    return y.to(x.dtype), ids.to(torch.int32), (scores if out_flag else scores.new_empty(0))


@_logged("npu_moe_init_routing_v2")
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1, expert_num=-1,
                            drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=0,
                            active_expert_range=(), row_idx_type=0):
    """Sort the flattened (row, k) pairs by expert (stable); expanded_x[i] = x[sorted_row[i] // K];
    expanded_row_idx: gather type (row_idx_type 0) idx[sorted_row[i]] = i, scatter type (1)
    idx[i] = sorted_row[i], -1 where the expert is outside active_expert_range (unconfirmed);
    expert counts (type 1) over the active range, int64."""
    op = "npu_moe_init_routing_v2"
    _unset(op, scale=scale, offset=offset)
    _need(x.dim() == 2 and expert_idx.dim() == 2 and x.shape[0] == expert_idx.shape[0], op,
          f"x [rows, H] and expert_idx [rows, K] expected, got {tuple(x.shape)}, {tuple(expert_idx.shape)}")
    _dtype(op, "x", x, FLOATS)
    _need(expert_idx.dtype == torch.int32, op, f"expert_idx must be int32, got {expert_idx.dtype}")
    rows, K = expert_idx.shape
    _need(active_num == rows * K, op, f"active_num must equal rows * K = {rows * K}, got {active_num}")
    _need(drop_pad_mode == 0, op, f"only drop_pad_mode 0 (dropless) is supported, got {drop_pad_mode}")
    _need(expert_tokens_num_type in (1, 2), op, f"expert_tokens_num_type must be 1 or 2, got {expert_tokens_num_type}")
    if expert_tokens_num_type == 2:
        raise NotModelled(f"{op}: key_value expert token counts are not modelled")
    _need(expert_tokens_num_flag, op, "expert_tokens_num_flag must be True")
    if quant_mode != -1:
        raise NotModelled(f"{op}: quant_mode {quant_mode} is not modelled (-1 is)")
    _need(0 <= expert_num <= 10240, op, f"expert_num must be in [0, 10240], got {expert_num}")
    _need(row_idx_type in (0, 1), op, f"row_idx_type must be 0 or 1, got {row_idx_type}")
    start, end = _host_ints(op, "active_expert_range", active_expert_range)
    _need(0 <= start < end <= expert_num, op, f"active_expert_range {[start, end]} outside [0, {expert_num}]")
    if _eager():
        _need(bool(((expert_idx >= 0) & (expert_idx < expert_num)).all()), op, f"expert ids must be in [0, {expert_num})")
    flat = expert_idx.reshape(-1).long()
    n = flat.numel()
    active = (flat >= start) & (flat < end)
    order = torch.argsort(torch.where(active, flat, torch.full_like(flat, end)), stable=True)  # sorted_row_idx
    available = active.sum()
    position = torch.arange(n, device=x.device)
    valid = position < available  # the first available_idx_num rows of the outputs are valid
    expanded_x = torch.where(valid[:, None], x[order // K], torch.full_like(x[order // K], float("nan")))
    minus = torch.full((n,), -1, dtype=torch.int32, device=x.device)
    if row_idx_type == 0:
        row_idx = minus.scatter(0, order, torch.where(valid, position, -1).to(torch.int32))
    else:
        row_idx = torch.where(valid, order, -1).to(torch.int32)
    counts = torch.bincount(torch.where(active, flat - start, end - start), minlength=end - start + 1)[: end - start]
    return expanded_x, row_idx, counts.to(torch.int64), torch.zeros(n, dtype=torch.float32, device=x.device)


@_logged("npu_grouped_matmul")
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config=None):
    """Single x [M, K] split along M into groups (group_type 0), group g times weight[g] [K, N];
    -> [out [M, N]]. group_list int64: cumulative ends (type 0) or counts (type 1)."""
    op = "npu_grouped_matmul"
    _unset(op, bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
           per_token_scale=per_token_scale, activation_input=activation_input,
           activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset)
    _need(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op, "x and weight are tensor lists")
    if len(x) != 1 or len(weight) != 1 or group_type != 0 or split_item not in (2, 3):
        raise NotModelled(f"{op}: only one x split along M (group_type 0, split_item 2/3) over one stacked weight")
    a, w = x[0], weight[0]
    _need(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], op,
          f"x [M, K] and weight [E, K, N] expected, got {tuple(a.shape)}, {tuple(w.shape)}")
    _dtype(op, "x", a, FLOATS)
    _need(w.dtype == a.dtype, op, f"weight dtype {w.dtype} != x dtype {a.dtype}")
    _need(group_list is not None and isinstance(group_list, torch.Tensor), op, "group_list must be a tensor")
    _need(group_list.dtype == torch.int64 and tuple(group_list.shape) == (w.shape[0],), op,
          f"group_list must be int64 [{w.shape[0]}], got {group_list.dtype} {tuple(group_list.shape)}")
    _need(group_list_type in (0, 1), op, f"group_list_type must be 0 or 1, got {group_list_type}")
    ends = group_list if group_list_type == 0 else group_list.cumsum(0)
    if _eager():
        _need(bool((group_list >= 0).all()) and int(ends[-1]) <= a.shape[0], op, "groups must be >= 0 and fit in M rows")
        if group_list_type == 0:
            _need(bool((ends[1:] >= ends[:-1]).all()), op, "cumulative group_list must not decrease")
    M = a.shape[0]
    group = torch.searchsorted(ends, torch.arange(M, device=a.device), right=True)  # [M]
    inside = group < w.shape[0]
    per_row = w[group.clamp(max=w.shape[0] - 1)]  # [M, K, N]
    out = torch.einsum("mk,mkn->mn", a.float(), per_row.float()).to(output_dtype or a.dtype)
    return [torch.where(inside[:, None], out, torch.full_like(out, float("nan")))]  # rows past the groups: undefined


@_logged("npu_moe_token_unpermute")
def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """out[i] = sum_j probs[i, j] * permuted_tokens[sorted_indices[i * topK + j]] (aclnn doc)."""
    op = "npu_moe_token_unpermute"
    _need(not padded_mode, op, "only padded_mode False is supported")
    _dtype(op, "permuted_tokens", permuted_tokens, FLOATS)
    _need(sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1, op,
          f"sorted_indices must be 1-D int32, got {sorted_indices.dtype} {tuple(sorted_indices.shape)}")
    n = permuted_tokens.shape[0]
    _need(sorted_indices.numel() == n, op, f"{sorted_indices.numel()} indices for {n} permuted rows")
    topk = 1 if probs is None else probs.shape[1]
    if probs is not None:
        _need(probs.dim() == 2 and probs.numel() == n, op, f"probs must be [tokens, topK] with tokens * topK = {n}")
        _need(probs.dtype == permuted_tokens.dtype, op, f"probs dtype {probs.dtype} != tokens dtype {permuted_tokens.dtype}")
    if _eager():
        _need(bool(((sorted_indices >= 0) & (sorted_indices < n)).all()), op, "indices must be in [0, rows)")
        _need(sorted_indices.unique().numel() == n, op, "repeated indices (the result is undefined)")
    rows = permuted_tokens.float()[sorted_indices.long()].view(n // topk, topk, -1)
    if probs is not None:
        rows = rows * probs.float()[..., None]
    return rows.sum(dim=1).to(permuted_tokens.dtype)


# ================================================================================================
# 6. Sampling
# ================================================================================================


@_logged("npu_top_k_top_p")
def npu_top_k_top_p(logits, p, k):
    """vLLM's top-k then top-p on ascending-sorted logits: keep >= the k-th largest, drop tokens whose
    ascending cumulative probability is <= 1 - p, always keep the largest; removed -> -inf."""
    op = "npu_top_k_top_p"
    _need(logits.dim() == 2, op, f"logits must be 2-D, got {tuple(logits.shape)}")
    _dtype(op, "logits", logits, FLOATS)
    B, V = logits.shape
    _need(tuple(p.shape) == (B,) and p.dtype == logits.dtype, op, f"p must be [{B}] in {logits.dtype}, got {p.dtype}")
    _need(tuple(k.shape) == (B,) and k.dtype == torch.int32, op, f"k must be [{B}] int32, got {k.dtype}")
    if _eager():
        _need(bool(((k >= 1) & (k <= min(1024, V))).all()), op, "k must be in [1, 1024] (and <= vocab)")
    srt, idx = logits.sort(dim=-1)
    kth = srt.gather(1, (V - k.long())[:, None])
    srt = srt.masked_fill(srt < kth, float("-inf"))
    cum = srt.float().softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - p.float()[:, None]
    drop[:, -1] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, srt)


# ================================================================================================
# 7. torch.npu stand-in: device queries, streams, events, memory, graph capture
# ================================================================================================
# The graph stand-in emulates what matters to the backend: a captured graph replays its work with
# the arguments it was captured with (host lists and Python ints included), device tensors read at
# replay time. Capture records every aten op (TorchDispatchMode); replay re-runs them in order into
# the same tensors. Task groups mark ops that graph_task_update_begin/end may replace, which is how
# a re-issued FIA call with new host lengths takes effect. Host synchronisation during capture is
# refused, as a real capture would fail, and an ExternalEvent the graph waits on must be recorded
# before each replay, or the replay would block.

_HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "_unique2", "unique_dim",
                  "unique_consecutive", "allclose"}


@dataclass
class _Record:
    func: Any
    args: tuple
    kwargs: dict
    out: Any
    rerun_only: bool  # mutates or aliases its inputs: re-running is the whole effect

    def replay(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if not self.rerun_only:
            _copy_into(self.out, result)


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


@dataclass
class _TaskGroup:
    records: list = field(default_factory=list)


@dataclass
class _State:
    recorder: Optional["_Recorder"] = None
    graph: Optional["NPUGraph"] = None


_STATE = _State()


class _Recorder(TorchDispatchMode):
    def __init__(self, target: list):
        super().__init__()
        self.target = target

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _HOST_SYNC_OPS or _bool_index(name, args):
            raise GraphCaptureError(f"aten.{name} synchronises with the host; it cannot be captured in an NPU graph")
        out = func(*args, **kwargs)
        schema = func._schema
        rerun_only = schema.is_mutable or any(r.alias_info is not None for r in schema.returns) or name.startswith("empty")
        self.target.append(_Record(func, args, kwargs, out, rerun_only))
        return out


def _bool_index(name: str, args) -> bool:
    if name not in ("index", "index_put", "index_put_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


class ExternalEvent:
    def __init__(self):
        self.recorded = 0

    def record(self, stream=None):
        if _STATE.recorder is not None:
            raise GraphCaptureError("ExternalEvent.record belongs on the update stream, outside the capture")
        self.recorded += 1

    def wait(self, stream=None):
        if _STATE.graph is not None:
            _STATE.graph.waits.append(self)

    def reset(self, stream=None):
        if _STATE.graph is None:
            self.recorded = 0


class NPUGraph:
    def __init__(self):
        self.items: list = []
        self.waits: list[ExternalEvent] = []
        self.captured = False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if _STATE.recorder is not None:
            raise GraphCaptureError("an NPU graph capture is already in progress")
        _STATE.graph = self
        _STATE.recorder = _Recorder(self.items)
        _STATE.recorder.__enter__()

    def capture_end(self):
        recorder, _STATE.recorder, _STATE.graph = _STATE.recorder, None, None
        recorder.__exit__(None, None, None)
        self.captured = True
        _poison(self.items)  # captured work has not run: its fresh outputs hold nothing yet

    def replay(self):
        if not self.captured:
            raise GraphCaptureError("replay of a graph that was never captured")
        for event in self.waits:
            if event.recorded == 0:
                raise GraphCaptureError("replay would wait forever: an ExternalEvent the graph waits on was not "
                                        "recorded since the last replay (missing attention update)")
        with torch.inference_mode():
            for item in self.items:
                for record in (item.records if isinstance(item, _TaskGroup) else [item]):
                    record.replay()
        for event in self.waits:
            event.recorded = 0  # the captured reset

    def reset(self):
        self.items, self.waits, self.captured = [], [], False


def _poison(items) -> None:
    for item in items:
        for record in (item.records if isinstance(item, _TaskGroup) else [item]):
            outs = record.out if isinstance(record.out, (list, tuple)) else [record.out]
            for t in outs:
                if not record.rerun_only and isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.fill_(float("nan"))


@contextmanager
def _graph(npu_graph: NPUGraph, pool=None, stream=None, capture_error_mode="global") -> Iterator[None]:
    npu_graph.capture_begin(pool)
    try:
        yield
    finally:
        npu_graph.capture_end()


def _graph_task_group_begin(stream=None):
    if _STATE.recorder is None:
        raise GraphCaptureError("graph_task_group_begin outside a graph capture")
    group = _TaskGroup()
    _STATE.recorder.target.append(group)
    _STATE.recorder.target = group.records


def _graph_task_group_end(stream=None):
    if _STATE.recorder is None or _STATE.graph is None or not _STATE.graph.items:
        raise GraphCaptureError("graph_task_group_end without graph_task_group_begin")
    _STATE.recorder.target = _STATE.graph.items
    return _STATE.graph.items[-1]  # the handle is the task group


_UPDATING: list = []  # (recorder, handle) while an update is open


def _graph_task_update_begin(stream, handle):
    if not isinstance(handle, _TaskGroup):
        raise GraphCaptureError("graph_task_update_begin needs a handle from graph_task_group_end")
    if _STATE.recorder is not None or _UPDATING:
        raise GraphCaptureError("graph_task_update_begin inside a capture or another update")
    recorder = _Recorder([])
    _STATE.recorder = recorder
    recorder.__enter__()
    _UPDATING.append((recorder, handle))


def _graph_task_update_end(stream=None):
    if not _UPDATING:
        raise GraphCaptureError("graph_task_update_end without graph_task_update_begin")
    recorder, handle = _UPDATING.pop()
    recorder.__exit__(None, None, None)
    _STATE.recorder = None
    handle.records = recorder.target  # the re-issued task replaces the captured one


class Stream:
    """Host stand-in: work runs synchronously, so waits and queries are immediate."""

    def __init__(self, device=None, priority=0):
        self.device = device

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class NpuStandIn:
    """Installed as ``torch.npu`` (and ``torch_npu.npu``) by ``installed()``. It reports no NPU:
    is_available() is False and device_count() is 0. Memory figures default to the host's (the
    reference ops run there) and can be set for tests."""

    Stream = Stream
    Event = Event
    ExternalEvent = ExternalEvent
    NPUGraph = NPUGraph

    def __init__(self):
        self.memory: Optional[tuple[int, int]] = None
        self._current = Stream()

    def is_available(self) -> bool:
        return False

    def device_count(self) -> int:
        return 0

    def current_device(self) -> int:
        raise RuntimeError("no NPU: this is the host stand-in of torch.npu")

    def set_device(self, device) -> None:
        raise RuntimeError("no NPU: this is the host stand-in of torch.npu")

    def synchronize(self, device=None) -> None:
        pass

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.memory if self.memory is not None else _host_memory()

    def current_stream(self, device=None) -> Stream:
        return self._current

    @contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    graph = staticmethod(_graph)
    graph_task_group_begin = staticmethod(_graph_task_group_begin)
    graph_task_group_end = staticmethod(_graph_task_group_end)
    graph_task_update_begin = staticmethod(_graph_task_update_begin)
    graph_task_update_end = staticmethod(_graph_task_update_end)

    def graph_pool_handle(self):
        return object()


npu = NpuStandIn()


# ================================================================================================
# 8. Installation (tests only)
# ================================================================================================

_MISSING = object()


@contextmanager
def installed() -> Iterator[types.ModuleType]:
    """This module as ``torch_npu`` and the stand-in as ``torch.npu`` inside the block only."""
    global npu
    module = sys.modules[__name__]
    previous_module = sys.modules.get("torch_npu", _MISSING)
    previous_npu = getattr(torch, "npu", _MISSING)
    npu = NpuStandIn()
    sys.modules["torch_npu"] = module
    torch.npu = npu
    CALLS.clear()
    try:
        yield module
    finally:
        if previous_module is _MISSING:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous_module
        if previous_npu is _MISSING:
            delattr(torch, "npu")
        else:
            torch.npu = previous_npu
        CALLS.clear()
        _STATE.recorder, _STATE.graph = None, None
        _UPDATING.clear()
