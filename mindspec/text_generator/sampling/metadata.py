"""Per-step sampling metadata: every per-row parameter as a device tensor, built once on the host.

A row is one logits row. With speculative decoding one sequence owns several rows at consecutive
output positions; the caller repeats the sequence's params/prompt per row and gives each row the
output tokens that precede its position (accepted output + the draft tokens before it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from mindspec.modeling.packed_transfer import to_device_packed

from .noise import row_keys
from .params import SamplingParams


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    device: torch.device
    temperature: torch.Tensor  # [N] fp32; greedy rows hold 1.0 so division is always safe
    greedy_mask: torch.Tensor  # [N] bool
    top_k: torch.Tensor  # [N] int64 in [1, V]; V = off
    top_p: torch.Tensor  # [N] fp32; 1.0 = off
    min_p: torch.Tensor  # [N] fp32; 0.0 = off
    typical_p: torch.Tensor  # [N] fp32; 1.0 = off
    repetition_penalty: torch.Tensor  # [N] fp32
    presence_penalty: torch.Tensor  # [N] fp32
    frequency_penalty: torch.Tensor  # [N] fp32
    seeded: torch.Tensor  # [N] bool: the request set a seed
    noise_keys: torch.Tensor  # [N] int64 (noise.row_keys): seeded rows' from (seed, output position)
    # fast-path flags
    all_greedy: bool
    all_random: bool
    any_penalties: bool
    any_repetition: bool
    any_top_k: bool
    max_top_k: int  # the largest top_k below V among random rows (0: none)
    any_top_p: bool
    any_min_p: bool
    any_typical_p: bool
    any_seeded: bool  # some random row is seeded
    all_seeded: bool  # every random row is
    max_num_logprobs: int | None  # max requested top-n over rows; None = nobody asked
    # penalty history (None when no row has penalties)
    output_counts: torch.Tensor | None = None  # [N, V] int32, count of each token in the output
    prompt_mask: torch.Tensor | None = None  # [N, V] bool, token occurs in the prompt
    # min_tokens: (row, token) pairs to set to -inf (None when nothing is banned)
    banned_rows: torch.Tensor | None = None  # [M] int64
    banned_token_ids: torch.Tensor | None = None  # [M] int64
    # logit_bias: (row, token, value) triples added to the logits (None when no row has a bias)
    bias_rows: torch.Tensor | None = None  # [L] int64
    bias_token_ids: torch.Tensor | None = None  # [L] int64
    bias_values: torch.Tensor | None = None  # [L] fp32
    # structured output: the tokens each constrained row may take (None when no row is constrained)
    allowed_rows: torch.Tensor | None = None  # [M] int64
    allowed_bitmask: torch.Tensor | None = None  # [M, ceil(V / 32)] int32, bit t % 32 of word t // 32

    def constrain(self, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Limit ``rows`` to the tokens set in ``bitmask`` [len(rows), ceil(V / 32)] (host int32)."""
        self.allowed_rows = torch.as_tensor(list(rows), dtype=torch.int64).to(self.device)
        self.allowed_bitmask = bitmask.to(self.device)

    @property
    def any_filters(self) -> bool:
        return self.any_top_k or self.any_top_p or self.any_min_p or self.any_typical_p

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]] | None,
        output_ids: Sequence[Sequence[int]] | None,
        output_positions: Sequence[int] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: int | Sequence[int] | None = None,
    ) -> "SamplingMetadata":
        """Build the metadata for N rows.

        prompt_ids[i] feeds the repetition penalty only; output_ids[i] feeds all three penalties.
        output_positions[i] is the index in the output of the token row i samples (0 = first
        generated token); None means len(output_ids[i]). eos_token_ids are banned (with the row's
        stop_token_ids) while output_positions[i] < min_tokens, unless the row sets ignore_eos.
        """
        n = len(params)
        v = int(vocab_size)
        if v < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        device = torch.device(device)
        if prompt_ids is None:
            prompt_ids = [()] * n
        if output_ids is None:
            output_ids = [()] * n
        if output_positions is None:
            output_positions = [len(o) for o in output_ids]
        if not (len(prompt_ids) == len(output_ids) == len(output_positions) == n):
            raise ValueError(
                f"per-row inputs disagree: {n} params, {len(prompt_ids)} prompt_ids, "
                f"{len(output_ids)} output_ids, {len(output_positions)} output_positions"
            )
        if eos_token_ids is None:
            eos = []
        elif isinstance(eos_token_ids, int):
            eos = [eos_token_ids]
        else:
            eos = [int(t) for t in eos_token_ids]
        positions = [int(p) for p in output_positions]
        if any(p < 0 for p in positions):
            raise ValueError(f"output_positions must be >= 0, got {positions}")

        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [v if (p.top_k <= 0 or p.top_k >= v) else p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        typical_p = [p.typical_p for p in params]
        rep = [p.repetition_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        seeds = [-1 if p.seed is None else p.seed for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]

        # flags only count random rows for filters: greedy rows never look at them
        rand = [not g for g in greedy]
        any_rep = any(r != 1.0 for r in rep)
        any_fp = any(x != 0.0 for x in pres + freq)

        columns = [
            np.array(temperature, np.float32), np.array(greedy, np.bool_), np.array(top_k, np.int64),
            np.array(top_p, np.float32), np.array(min_p, np.float32), np.array(rep, np.float32),
            np.array(pres, np.float32), np.array(freq, np.float32), np.array([s >= 0 for s in seeds], np.bool_),
            row_keys(seeds, positions), np.array(typical_p, np.float32),
        ]
        # One host-to-device copy for all eleven on a GPU; on cpu the tensors share the arrays.
        tensors = to_device_packed(columns, device)
        temp_t, greedy_t, top_k_t, top_p_t, min_p_t, rep_t, pres_t, freq_t, seeded_t, keys_t, typical_t = tensors
        max_top_k = max((k for r, k in zip(rand, top_k) if r and k < v), default=0)
        md = cls(
            num_rows=n,
            vocab_size=v,
            device=device,
            temperature=temp_t,
            greedy_mask=greedy_t,
            top_k=top_k_t,
            top_p=top_p_t,
            min_p=min_p_t,
            typical_p=typical_t,
            repetition_penalty=rep_t,
            presence_penalty=pres_t,
            frequency_penalty=freq_t,
            seeded=seeded_t,
            noise_keys=keys_t,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            any_penalties=any_rep or any_fp,
            any_repetition=any_rep,
            any_top_k=max_top_k > 0,
            max_top_k=max_top_k,
            any_top_p=any(r and p < 1.0 for r, p in zip(rand, top_p)),
            any_min_p=any(r and p > 0.0 for r, p in zip(rand, min_p)),
            any_typical_p=any(r and p < 1.0 for r, p in zip(rand, typical_p)),
            any_seeded=any(r and s >= 0 for r, s in zip(rand, seeds)),
            all_seeded=all(s >= 0 for r, s in zip(rand, seeds) if r),
            max_num_logprobs=max(logprobs) if logprobs else None,
        )
        if md.any_penalties:
            md.output_counts, md.prompt_mask = _penalty_history(
                params, prompt_ids, output_ids, v, device, any_rep
            )
        md.banned_rows, md.banned_token_ids = _min_tokens_bans(params, positions, eos, v, device)
        md.bias_rows, md.bias_token_ids, md.bias_values = _logit_bias(params, v, device)
        return md


def _flat_indices(rows: list[int], seqs: Sequence[Sequence[int]], v: int, what: str) -> np.ndarray:
    """Flattened row * V + token indices for the token lists of `rows` (loop over rows only)."""
    if not rows:
        return np.zeros(0, dtype=np.int64)
    toks = [np.asarray(seqs[i], dtype=np.int64).reshape(-1) for i in rows]
    lens = np.fromiter((t.size for t in toks), dtype=np.int64, count=len(toks))
    flat_tok = np.concatenate(toks)
    if flat_tok.size and (flat_tok.min() < 0 or flat_tok.max() >= v):
        raise ValueError(
            f"{what} holds token ids outside [0, {v}): min {flat_tok.min()}, max {flat_tok.max()}"
        )
    flat_row = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    return flat_row * v + flat_tok


def _penalty_history(params, prompt_ids, output_ids, v, device, any_rep):
    n = len(params)
    # only rows that actually use a penalty pay for their history
    out_rows = [i for i, p in enumerate(params) if p.has_penalties]
    out_idx = torch.from_numpy(_flat_indices(out_rows, output_ids, v, "output_ids")).to(device)
    counts = torch.zeros(n * v, dtype=torch.int32, device=device)
    counts.scatter_add_(0, out_idx, torch.ones_like(out_idx, dtype=torch.int32))
    prompt_mask = torch.zeros(n * v, dtype=torch.bool, device=device)
    if any_rep:
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        p_idx = _flat_indices(rep_rows, prompt_ids, v, "prompt_ids")
        prompt_mask[torch.from_numpy(p_idx).to(device)] = True
    return counts.view(n, v), prompt_mask.view(n, v)


def _min_tokens_bans(params, positions, eos, v, device):
    rows, toks = [], []
    for i, (p, pos) in enumerate(zip(params, positions)):
        if pos >= p.min_tokens:
            continue
        ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)))
        rows.extend([i] * len(ids))
        toks.extend(ids)
    if not rows:
        return None, None
    if min(toks) < 0 or max(toks) >= v:
        raise ValueError(f"stop/eos token ids outside [0, {v}): {sorted(set(toks))}")
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(toks, dtype=torch.int64, device=device),
    )


def _logit_bias(params, v, device):
    """Every row's logit_bias as flat (row, token, value) arrays; None when no row has one. A
    row repeats its sequence's params, so speculative rows carry the same bias as the others."""
    rows, toks, vals = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            toks.extend(p.logit_bias.keys())
            vals.extend(p.logit_bias.values())
    if not rows:
        return None, None, None
    if min(toks) < 0 or max(toks) >= v:
        raise ValueError(f"logit_bias token ids outside [0, {v}): {sorted(t for t in set(toks) if not 0 <= t < v)}")
    row_t, tok_t, val_t = to_device_packed(
        [np.array(rows, np.int64), np.array(toks, np.int64), np.array(vals, np.float32)], device
    )
    return row_t, tok_t, val_t
