"""The cpu backend: the pure-torch reference every other backend is tested against.

Every op is vectorised over tokens and heads, and written for a CPU where per-op overhead, not
FLOPs, dominates small models: what every layer of a forward would recompute (the padded token
grid, the causal/tree mask, the cache gather index) is derived once per forward into an
AttentionPlan (attention_plan.py: on the host, or inside an exported step), and attention runs
as two batched GEMMs over the gathered latent rows.
Numerics follow transformers' DeepSeek-V2/V3 eager code (RMSNorm and routers in fp32, cos/sin cast
to the activation dtype, softmax in fp32, expert outputs weighted in fp32 and cast back before the
sum).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from mindspec.backend import (
    AttentionMetadata,
    Backend,
    ExpertWeights,
    HeadWeight,
    LatentCache,
    LinearWeight,
    RotaryEmbedding,
    RouterConfig,
)
from mindspec.modeling import quantized
from mindspec.modeling.quantized import is_quantized

from . import linear as packed_linear
from . import moe, rows_gemm
from .attention_plan import PLAN_KEY, ROWS_KEY, attention_groups, attention_plan, cache_rows, grid_indices, traced_plan

logger = logging.getLogger(__name__)


@dataclass
class CpuLatentCache(LatentCache):
    """The cpu layout: one flat buffer of [c_kv | k_pe] rows, one row per slot, plus a spill row
    at the end where writes for slot -1 land, so a write never needs to filter its rows (no
    host synchronisation, nothing data-dependent for a compiled forward)."""

    rows: Optional[torch.Tensor] = None  # [num_blocks * block_size + 1, R + P]
    rows_per_block: int = 0  # block_size, kept as an int so ops need not read the views


def _cache_over(rows: torch.Tensor, block_size: int, kv_lora_rank: int) -> CpuLatentCache:
    """The cache whose storage is ``rows`` [num_blocks * block_size + 1, R + P] (last: spill row)."""
    latent = rows[:-1].view(-1, block_size, rows.shape[1])
    return CpuLatentCache(c_kv=latent[..., :kv_lora_rank], k_pe=latent[..., kv_lora_rank:], latent=latent,
                          rows=rows, rows_per_block=block_size)


def _take_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """table[rows] for a 2-D table: [*rows.shape, table.shape[1]]. Eagerly, index_select copies
    whole rows, 2-6x faster than advanced indexing on CPU; a compiled graph keeps the indexing
    (Inductor generates the gather, and the reshapes would only cost symbolic-shape work)."""
    if torch.compiler.is_compiling():
        return table[rows]
    return table.index_select(0, rows.reshape(-1)).view(*rows.shape, table.shape[1])


_ROPE_TABLE = "cpu_interleaved_cos_sin"


def _rope_pairs(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    """The pair formula as written (x [T, H, P])."""
    cos, sin = rotary.cos_sin(positions.to(x.device))  # [T, P/2] float32 each
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def _interleaved(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos, sin [N, P/2] -> [N, 2P] rows (c0, c0, c1, c1, ... | -s0, s0, -s1, s1, ...)."""
    return torch.cat([cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)], dim=-1)


def _interleaved_rows(rotary: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
    """[T, 2P] interleaved cos/sin rows of ``positions``; with a cos/sin cache, looked up in its
    interleaved copy (built once, kept in ``rotary.backend_tables``)."""
    if rotary.cos_sin_cache is None:
        return _interleaved(*rotary.cos_sin(positions))
    table = rotary.backend_tables.get(_ROPE_TABLE)
    if table is None:
        cache = rotary.cos_sin_cache.to(positions.device)
        table = rotary.backend_tables[_ROPE_TABLE] = _interleaved(*cache.chunk(2, dim=-1))
    return table.index_select(0, positions)


class _LastCall:
    """A one-entry memo keyed on the identity of its arguments (ints and devices by value).
    Every layer of a forward passes the same positions and slots tensors (the model never writes
    them in place), so what is derived from them is computed by the first layer and reused by the
    others; holding the key keeps its id from being reused by another tensor. (The per-forward
    ``meta.scratch`` cannot hold these: ``rope`` and ``write_latent_cache`` receive no metadata.)
    ``prepare`` clears it: a static buffer (graph_runner.py) is the same tensor in every forward
    with new values."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.key: Optional[tuple] = None
        self.value = None

    def get(self, *key):
        if self.key is None:
            return None
        hit = all(a is b or (type(a) in (int, torch.device) and a == b) for a, b in zip(self.key, key))
        return self.value if hit else None

    def put(self, value, *key):
        self.key, self.value = key, value
        return value


def _spill(slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    flat = slots.to(device=rows.device, dtype=torch.int64)
    return torch.where(flat >= 0, flat, rows.shape[0] - 1)  # the last row takes writes for slot -1


def _swap_pairs(P: int, device: torch.device) -> torch.Tensor:
    """[P] int64 column order (1, 0, 3, 2, ...): x.index_select(-1, it) swaps each pair."""
    return torch.arange(P, device=device).view(-1, 2).flip(-1).reshape(-1)


# ---- threads --------------------------------------------------------------------------------------
# Thread policy (measurements: benchmarks/README.md, "CPU threads"). OpenMP's default wait policy
# spins at every barrier; when another process holds one of the cores, the spinning threads burn the
# core the descheduled thread needs, at each of the thousands of parallel regions a step runs, and
# decoding slows down many times over. mindspec/__init__.py therefore sets OMP_WAIT_POLICY=PASSIVE
# unless the environment sets it (OpenMP reads it once, when torch loads: mindspec must be imported
# first). Passive waiting costs a wake-up per parallel region, which only a small model notices:
# a model below SMALL_MODEL_HIDDEN gets one thread; larger ones keep torch's count (OMP_NUM_THREADS,
# torch.set_num_threads, else one per usable core), dp ranks on one host splitting the usable cores.
# An explicit count (LLM(cpu_threads=), --threads, $MINDSPEC_CPU_THREADS, cpuThreads) replaces it.
THREADS_ENV = "MINDSPEC_CPU_THREADS"


def check_cpu_threads(value, where: str) -> int:
    """A thread count: an integer >= 1 (a bool is not one), else a ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: must be an integer >= 1 (cpu threads), got {value!r}")
    return value


def cpu_threads_from_env() -> Optional[int]:
    """$MINDSPEC_CPU_THREADS as a count, None when unset or empty."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${THREADS_ENV}: must be an integer >= 1 (cpu threads), got {raw!r}") from None
    return check_cpu_threads(value, f"${THREADS_ENV}")


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (a container's or taskset's cpuset), which
    os.cpu_count() ignores."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


# Below this hidden size a parallel region's work (an [h, h] GEMV: h*h multiply-adds, ~10 us at
# h = 192) is no larger than waking a thread for it: one thread is as fast as two on an idle machine
# and much faster beside a busy process (the shipped model, hidden 192; benchmarks/README.md).
SMALL_MODEL_HIDDEN = 1024


def default_cpu_threads(ranks_on_host: int = 1, hidden_size: Optional[int] = None) -> int:
    """A small model (hidden_size < SMALL_MODEL_HIDDEN): 1. Otherwise, one process: torch's own
    count, kept (OMP_NUM_THREADS, a torch.set_num_threads call made before, else one per usable
    core); dp ranks sharing a host: the usable cores split among them."""
    if hidden_size is not None and hidden_size < SMALL_MODEL_HIDDEN:
        return 1
    if ranks_on_host <= 1:
        return torch.get_num_threads()
    return max(1, usable_cores() // ranks_on_host)


def set_cpu_threads(requested: Optional[int] = None, ranks_on_host: int = 1, source: str = "requested",
                    hidden_size: Optional[int] = None) -> int:
    """Set torch's intra-op threads for this process: ``requested``, else $MINDSPEC_CPU_THREADS,
    else the default (above: the model's ``hidden_size``, ``ranks_on_host`` dp ranks). Returns the
    count; ``source`` names where ``requested`` came from in the INFO log line."""
    from_env = cpu_threads_from_env() if requested is None else None
    if requested is not None:
        threads = check_cpu_threads(requested, "cpu_threads")
    elif from_env is not None:
        threads, source = from_env, f"${THREADS_ENV}"
    else:
        threads = default_cpu_threads(ranks_on_host, hidden_size)
        if hidden_size is not None and hidden_size < SMALL_MODEL_HIDDEN:
            source = f"default: a small model (hidden size {hidden_size})"
        else:
            source = (f"default: {usable_cores()} usable cores / {ranks_on_host} ranks" if ranks_on_host > 1
                      else "default: torch's count")
        if threads > 1:
            _note_spinning_threads()
    torch.set_num_threads(threads)
    logger.info("cpu threads: %d (%s; OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s%s)", threads, source,
                os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"),
                " set after torch loaded, not in effect" if _wait_policy_source() == "too late" else "")
    return threads


_warned_spinning = False


def _wait_policy_source() -> str:
    import mindspec

    return mindspec.WAIT_POLICY_SOURCE


def _note_spinning_threads() -> None:
    """Once per process: torch loaded before mindspec could make OpenMP's threads passive."""
    global _warned_spinning
    if _wait_policy_source() == "too late" and not _warned_spinning:
        _warned_spinning = True
        logger.warning("torch was imported before mindspec, so OpenMP keeps its spinning wait policy: with "
                       "another process busy on these cores, set OMP_WAIT_POLICY=PASSIVE before starting Python "
                       "(or import mindspec first), or %s=1", THREADS_ENV)


class CpuBackend(Backend):
    name = "cpu"
    dist_backend = "gloo"

    def __init__(self, device: Optional[str] = None):
        super().__init__(device)
        self._rope_memo, self._spill_memo = _LastCall(), _LastCall()
        self.pack_weights = packed_linear.packing_enabled()
        self._key_range = torch.arange(0)  # step_tensors' key indices are prefixes of it

    def default_device(self) -> str:
        return "cpu"

    def mem_get_info(self) -> tuple[int, int]:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            return super().mem_get_info()

    def prepare(self, meta: AttentionMetadata) -> None:
        """A new forward: clear the per-call memos (its positions and slots may be old tensors with
        new values). The attention plans are memoised on first use (attention_plan), so a step
        that runs as an exported package, which computes them inside, builds none on the host."""
        self._rope_memo.clear()
        self._spill_memo.clear()

    # ---- cache ---------------------------------------------------------------------------
    def allocate_latent_cache(
        self, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype
    ) -> CpuLatentCache:
        rows = torch.zeros(num_blocks * block_size + 1, kv_lora_rank + rope_dim, dtype=dtype, device=self.device)
        return _cache_over(rows, block_size, kv_lora_rank)

    # ---- whole-step export -------------------------------------------------------------------
    # A decode step's ops read, besides the model inputs, the slots and the attention plan, which
    # the exported step computes from the lengths and block tables (attention_plan.traced_plan):
    # the context length S, the size of key_index, is its one dynamic size.
    @property
    def supports_step_export(self) -> bool:
        return True

    def step_kernels(self) -> dict:
        return rows_gemm.c_shims()

    def step_tensors(self, meta: AttentionMetadata, name: str) -> list[tuple[torch.Tensor, dict[int, str]]]:
        key_index = self._key_index(meta.max_seq_len, meta.seq_lens.device)
        tensors = [(meta.slots, {}), (meta.seq_lens, {}), (meta.q_lens, {}), (meta.block_tables, {}),
                   (key_index, {0: f"{name}_context"})]
        tok_seq, tok_pos = grid_indices(meta, self.device)
        if tok_seq is not None:  # sequences with different q_lens: the grid scatter's indices
            tensors += [(tok_seq, {}), (tok_pos, {})]
        return tensors

    def _key_index(self, n: int, device: torch.device) -> torch.Tensor:
        """arange(n) as a prefix of one cached range: a compiled step's stages take it every step,
        and a view costs no allocation."""
        if self._key_range.numel() < n or self._key_range.device != device:
            self._key_range = torch.arange(max(n, 2 * self._key_range.numel(), 256), device=device)
        return self._key_range[:n]

    def bind_step_tensors(self, meta: AttentionMetadata, tensors: list[torch.Tensor]) -> AttentionMetadata:
        slots, seq_lens, q_lens, block_tables, key_index, *grid = tensors
        bound = replace(meta, slots=slots, seq_lens=seq_lens, q_lens=q_lens, block_tables=block_tables, scratch={})
        plan, rows = traced_plan(bound, key_index, *grid)
        bound.scratch[PLAN_KEY] = plan
        bound.scratch[(ROWS_KEY, meta.block_size)] = rows
        return bound

    def cache_tensors(self, caches: list[LatentCache]) -> list[tuple[torch.Tensor, dict[int, str]]]:
        return [(c.rows, {}) for c in caches]

    def bind_cache_tensors(self, caches: list[LatentCache], tensors: list[torch.Tensor]) -> list[LatentCache]:
        return [_cache_over(t, c.rows_per_block, c.c_kv.shape[-1]) for c, t in zip(caches, tensors)]

    def write_latent_cache(
        self, cache: LatentCache, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor
    ) -> None:
        rows = getattr(cache, "rows", None)
        if rows is not None:  # touches only `rows`: a compiled forward must not see aliased views
            new = torch.cat([c_kv, k_pe], dim=-1)
            rows.index_copy_(0, self._spill_rows(slots, rows), new if new.dtype == rows.dtype else new.to(rows.dtype))
            return
        slots = slots.to(device=cache.c_kv.device, dtype=torch.int64)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, c_kv, k_pe = slots[keep], c_kv[keep], k_pe[keep]
        if cache.latent is not None:  # one row per token: [c_kv | k_pe]
            rows = torch.cat([c_kv, k_pe], dim=-1).to(cache.latent.dtype)
            cache.latent.view(-1, rows.shape[-1]).index_copy_(0, slots, rows)
            return
        block, offset = slots // cache.block_size, slots % cache.block_size
        cache.c_kv[block, offset] = c_kv.to(cache.c_kv.dtype)
        cache.k_pe[block, offset] = k_pe.to(cache.k_pe.dtype)

    def _spill_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[T] int64 row of each slot, -1 sent to the spill row; once per forward (every layer
        writes the same slots), except inside a compiled graph, which keeps no host state."""
        if torch.compiler.is_compiling():
            return _spill(slots, rows)
        spill = self._spill_memo.get(slots, rows.shape[0])
        return spill if spill is not None else self._spill_memo.put(_spill(slots, rows), slots, rows.shape[0])

    def _gather_latent(self, cache: LatentCache, meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor:
        """The latent rows of every key of every sequence -> [B, S, R + P] in ``dtype``."""
        flat = getattr(cache, "rows", None)
        if flat is not None:
            kv = _take_rows(flat, cache_rows(meta, cache.rows_per_block, flat.device))
            return kv if kv.dtype == dtype else kv.to(dtype)
        rows = cache_rows(meta, cache.block_size, cache.c_kv.device)
        if cache.latent is not None:
            return _take_rows(cache.latent.view(-1, cache.latent.shape[-1]), rows).to(dtype)
        c = _take_rows(cache.c_kv.reshape(-1, cache.c_kv.shape[-1]), rows)
        k = _take_rows(cache.k_pe.reshape(-1, cache.k_pe.shape[-1]), rows)
        return torch.cat([c, k], dim=-1).to(dtype)

    # ---- GEMMs against weights ---------------------------------------------------------------
    def keeps_quantized(self, checkpoint_format: str) -> bool:
        """Block FP8 and GGUF weights stay quantized: each GEMM, expert and embedding lookup
        dequantizes what it reads for that call only (linear.py, moe.QuantizedExpertWeights)."""
        return True

    def embedding(self, input_ids: torch.Tensor, weight) -> torch.Tensor:
        if is_quantized(weight):
            return weight.rows(input_ids)
        return super().embedding(input_ids, weight)

    def linear_weight(self, weight: torch.Tensor) -> LinearWeight:
        if is_quantized(weight):
            return LinearWeight(weight)
        w = self._linear_weight(weight, self._narrow(weight))
        if w.narrow is not None and rows_gemm.supported():  # compiled steps' few-row GEMMs read it instead
            return replace(w, narrow=None, blocked=rows_gemm.block(w.narrow))
        return w

    def head_weight(self, weight: torch.Tensor) -> HeadWeight:
        half = self._narrow(weight) if rows_gemm.supported() else None
        return HeadWeight(weight, None if half is None else rows_gemm.block_heads(half))

    def head_linear(self, x: torch.Tensor, w: HeadWeight) -> torch.Tensor:
        if (torch.compiler.is_compiling() and w.blocked is not None and x.shape[0] <= rows_gemm.HEAD_MAX_TOKENS
                and rows_gemm.available()):
            return rows_gemm.rows_heads(x, w.blocked, w.weight.shape[-1])
        return super().head_linear(x, w)

    def _linear_weight(self, weight: torch.Tensor, narrow: Optional[torch.Tensor]) -> LinearWeight:
        return LinearWeight(weight, packed_linear.pack(weight, self.pack_weights and self._room_for(weight)), narrow)

    def _narrow(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """``weight`` (any shape) as linear.narrow keeps it, or None."""
        if not self._room_for(weight):
            return None
        half = packed_linear.narrow(weight.reshape(-1, weight.shape[-1]))
        return None if half is None else half.view(weight.shape)

    def _room_for(self, weight: torch.Tensor) -> bool:
        """A packed copy doubles a weight's memory: a big checkpoint stops packing while a quarter
        of the machine's memory is still free (for the KV cache); what is left runs F.linear."""
        free, total = self.mem_get_info()
        return free - weight.numel() * weight.element_size() >= total // 4

    def linear(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        return packed_linear.linear(x, w)

    def expert_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        if is_quantized(w13) and is_quantized(w2):
            return moe.QuantizedExpertWeights(w13=w13, w2=w2)
        # One side quantized alone (its blocks did not allow keeping gate and up together): both dense.
        w13, w2 = (quantized.dense(w) for w in (w13, w2))
        E, two_i, H = w13.shape
        # One bfloat16 copy per tensor; the per-expert and side-by-side weights take views of it.
        # Where the cpu runs rows_gemm that copy is blocked for it instead.
        w13_narrow, w2_narrow = self._narrow(w13), self._narrow(w2)
        w13_blocked = w2_blocked = None
        if w13_narrow is not None and w2_narrow is not None and rows_gemm.supported():
            w13_blocked, w2_blocked = rows_gemm.block_experts(w13_narrow), rows_gemm.block_experts(w2_narrow)
            w13_narrow = w2_narrow = None

        def expert(copy: Optional[torch.Tensor], e: int) -> Optional[torch.Tensor]:
            return None if copy is None else copy[e]

        def each(w: torch.Tensor, narrow: Optional[torch.Tensor], blocked: Optional[torch.Tensor], e: int):
            return replace(self._linear_weight(w[e], expert(narrow, e)), blocked=expert(blocked, e))

        return moe.CpuExpertWeights(
            w13=w13, w2=w2,
            w13_all=self._linear_weight(w13.reshape(E * two_i, H),
                                        None if w13_narrow is None else w13_narrow.view(E * two_i, H)),
            # Only experts few enough to run dense need it (DeepSeek-V2/V3's 64/256 never do).
            w2_all=self._linear_weight(moe._down_side_by_side(w2).contiguous(), None) if E <= moe.DENSE_MAX_EXPERTS else None,
            w13_each=[each(w13, w13_narrow, w13_blocked, e) for e in range(E)],
            w2_each=[each(w2, w2_narrow, w2_blocked, e) for e in range(E)],
            w13_narrow=w13_narrow, w2_narrow=w2_narrow, w13_blocked=w13_blocked, w2_blocked=w2_blocked,
        )

    # ---- norms and activations -------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # One fused op; in float32 it is transformers' formula exactly (no casts in between).
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(input_dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]

    # ---- rope ----------------------------------------------------------------------------
    def rope(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """Interleaved pairs (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), written as
        x * cos2 + swap(x) * sin2 with per-pair rows cos2 = (c, c), sin2 = (-s, s): the same
        products and sums bit for bit (negation is exact), in four kernels."""
        if torch.compiler.is_compiling():  # Inductor fuses either form; this one compiles fastest
            return _rope_pairs(x, positions, rotary)
        cos2, sin2, swap = self._rope_rows(rotary, positions, x)  # [T, 1, P] each, [P]
        return x * cos2 + x.index_select(-1, swap) * sin2

    def _rope_rows(self, rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor):
        """(cos2, sin2 [T, 1, P], pair swap [P]) for ``positions``, in x's dtype and on x's device
        (the npu backend composes this op on its tensors); once per forward."""
        rows = self._rope_memo.get(positions, rotary, x.dtype, x.device)
        if rows is None:
            cs = _interleaved_rows(rotary, positions.to(x.device).reshape(-1)).to(x.dtype)[:, None, :]  # [T, 1, 2P]
            P = cs.shape[-1] // 2
            rows = (cs[..., :P], cs[..., P:], _swap_pairs(P, x.device))
            self._rope_memo.put(rows, positions, rotary, x.dtype, x.device)
        return rows

    # ---- attention -------------------------------------------------------------------------
    def mla_attention(
        self,
        q_lat: torch.Tensor,  # [T, H, R]
        q_pe: torch.Tensor,  # [T, H, P]
        cache: LatentCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        T, H, R = q_lat.shape
        if T == 0:
            return q_lat.new_zeros((0, H, R))
        groups = None if torch.compiler.is_compiling() else attention_groups(meta, q_lat.device)
        if groups is not None:  # prefill chunks beside decode rows: each attends over its own grid
            out = q_lat.new_empty((T, H, R))
            for g in groups:
                out[g.tokens] = self.mla_attention(q_lat[g.tokens], q_pe[g.tokens], cache, g.meta, scale)
            return out
        plan = attention_plan(meta, q_lat.device)
        B, Q, _, S = plan.bias.shape
        kv = self._gather_latent(cache, meta, q_lat.dtype)  # [B, S, R+P]
        q = plan.to_grid(torch.cat([q_lat, q_pe], dim=-1)).view(B, Q * H, -1)  # [B, Q*H, R+P]
        if torch.compiler.is_compiling():
            scores = torch.bmm(q, kv.transpose(1, 2)).view(B, Q, H, S) * scale
            probs = torch.softmax(scores.float() + plan.bias, dim=-1).to(q_lat.dtype).view(B, Q * H, S)
        else:  # scale, product and mask in one kernel
            scores = torch.baddbmm(plan.head_bias(H, q.dtype), q, kv.transpose(1, 2), alpha=scale)  # [B, Q*H, S]
            probs = scores.softmax(-1) if scores.dtype == torch.float32 else scores.softmax(-1, torch.float32).to(q.dtype)
        out = torch.bmm(probs, kv[..., :R])  # [B, Q*H, R]
        return plan.from_grid(out.view(B, Q, H, R))

    def mla_prefill(
        self,
        q_nope: torch.Tensor,  # [T, H, Dn]
        q_pe: torch.Tensor,  # [T, H, P]
        k_nope: torch.Tensor,  # [T, H, Dn]
        k_pe: torch.Tensor,  # [T, P]
        v: torch.Tensor,  # [T, H, Dv]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        T, H, _ = q_nope.shape
        if T == 0:
            return v.new_zeros((0, H, v.shape[-1]))
        plan = attention_plan(meta, q_nope.device)  # no cached context: keys are the new tokens
        q = plan.to_grid(torch.cat([q_nope, q_pe], dim=-1)).transpose(1, 2)  # [B, H, Q, Dn+P]
        k = torch.cat([k_nope, k_pe[:, None, :].expand(T, H, -1)], dim=-1)
        k = plan.to_grid(k).permute(0, 2, 3, 1)  # [B, H, Dn+P, Q]
        scores = torch.matmul(q, k) * scale  # [B, H, Q, Q]
        probs = torch.softmax(scores.float() + plan.bias.transpose(1, 2), dim=-1).to(v.dtype)
        out = torch.matmul(probs, plan.to_grid(v).transpose(1, 2))  # [B, H, Q, Dv]
        return plan.from_grid(out.transpose(1, 2))

    # ---- MoE -------------------------------------------------------------------------------
    def moe_gate(
        self,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        correction_bias: Optional[torch.Tensor],
        router: RouterConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return moe.moe_gate(x, gate_weight, correction_bias, router)

    def moe_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: ExpertWeights,
        shared: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        out = moe.moe_experts(x, topk_weights, topk_ids, experts)
        return out if shared is None else out + shared
