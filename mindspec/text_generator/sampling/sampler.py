"""Batched token sampler: penalties -> temperature -> top-k -> top-p -> min-p -> exponential race.

Pipeline per row (all fp32, vectorised over rows):
  1. penalised logits = penalties(raw logits) + logit_bias, min_tokens bans set to -inf.
  2. greedy rows: argmax of the penalised logits (ties -> lowest id).
  3. random rows: divide by temperature; top-k keeps tokens >= the k-th largest logit; top-p keeps
     tokens whose strictly-larger mass (under the top-k renormalised distribution) is < top_p;
     min-p keeps tokens with p >= min_p * p_max; typical-p keeps the tokens whose surprisal is
     closest to the entropy of what is left, up to typical_p mass. Every filter is threshold based, so tokens tied
     with the last kept token are kept too, whatever the sort order. Softmax gives the target p.
  4. sample argmax(p / E), E ~ Exp(1) (the exponential race, exact for categorical p).
     E is counter-based noise (noise.py): a seeded row's is a function of (seed, output position),
     so a seeded request's tokens depend on neither the batch nor the other rows; unseeded rows
     take theirs from one host draw per step.

Reported logprobs are vLLM's "raw" logprobs: log_softmax of the penalised logits (step 1), before
temperature and the filters, so they do not depend on temperature/top-k/top-p/min-p.
`processed_probs` returns the step-3 distribution (greedy rows one-hot) for speculative verification.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .metadata import SamplingMetadata
from .noise import exponential_noise, keyed_for_step
from .penalties import apply_penalties

RANK_CANDIDATES = 256  # largest logits per row that top-k / top-p look at first (_rank_threshold)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] fp32, log_softmax(penalised logits) at the chosen token; None: nobody asked
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # (ids [N, n] int64, values [N, n] fp32)


def penalised_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """fp32 logits after penalties, logit_bias and min_tokens bans (a new tensor; the input is
    untouched). Every choice (greedy argmax, sampling, speculative verification) starts here, so
    a bias or ban changes drafts' targets exactly as it changes plain decoding's tokens."""
    out = apply_penalties(logits, md)
    if out is logits and (md.bias_rows is not None or md.banned_rows is not None or md.allowed_rows is not None):
        out = out.clone()
    if md.bias_rows is not None:
        out.index_put_((md.bias_rows, md.bias_token_ids), md.bias_values, accumulate=True)
    if md.allowed_rows is not None:  # a structured output format: what it does not allow next is out
        mask_rows_(out, md.allowed_rows, md.allowed_bitmask)
    if md.banned_rows is not None:  # after the bias: a ban stays a ban whatever the bias
        formatted = out.clone() if md.allowed_rows is not None else None
        out[md.banned_rows, md.banned_token_ids] = float("-inf")
        if formatted is not None:  # min_tokens banned all the format allows (its end): the format wins
            out = torch.where(torch.isneginf(out).all(dim=-1, keepdim=True), formatted, out)
    return out


def mask_rows_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: rows ``rows`` [M] of ``logits`` [N, V] keep only the tokens set in ``bitmask``
    [M, ceil(V / 32)] (on the logits' device); the others become -inf."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M, ceil(V / 32)] int32 token bitmask (xgrammar's layout) -> [M, V] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def filter_logits(scaled: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Apply top-k, top-p and min-p to temperature-scaled logits; removed tokens become -inf."""
    if not md.any_filters:
        return scaled
    neg_inf = torch.tensor(float("-inf"), device=scaled.device)
    keep = None
    if md.any_top_k or md.any_top_p:
        keep = scaled >= _rank_threshold(scaled, md)
    if md.any_min_p:
        masked = scaled if keep is None else scaled.masked_fill(~keep, neg_inf)
        probs = masked.softmax(dim=-1)
        p_max = probs.amax(dim=-1, keepdim=True)
        keep_p = probs >= md.min_p.unsqueeze(1) * p_max
        keep = keep_p if keep is None else keep & keep_p
    if md.any_typical_p:
        masked = scaled if keep is None else scaled.masked_fill(~keep, neg_inf)
        keep_t = _typical_keep(masked, md.typical_p)
        keep = keep_t if keep is None else keep & keep_t
    return scaled.masked_fill(~keep, neg_inf)


def _rank_threshold(scaled: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[N, 1] the smallest logit top-k and top-p keep. Both keep a prefix of the descending
    order, so the ``RANK_CANDIDATES`` largest logits (``topk``, not a sort of the vocabulary:
    ~10x cheaper on a cpu at V = 4096, ~25x at 102400) decide it unless a row's top-p mass needs
    more of them; those rows are done again over their whole row (a value read)."""
    v = scaled.shape[1]
    width = min(v, max(RANK_CANDIDATES, md.max_top_k))
    thr, short = threshold_over_head(scaled, md.top_k, md.top_p, width, md.any_top_k, md.any_top_p)
    if width < v and md.any_top_p and bool(short.any()):
        rows = short.nonzero().squeeze(1)
        whole, _ = threshold_over_head(scaled[rows], md.top_k[rows], md.top_p[rows], v, md.any_top_k, md.any_top_p)
        thr = thr.index_copy(0, rows, whole)
    return thr


def threshold_over_head(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int,
                        any_top_k: bool = True, any_top_p: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """From the ``width`` largest logits of each row: (threshold [N, 1], short [N] bool: the
    row's top-p set may reach past them). ``any_top_k`` / ``any_top_p`` False skip a filter no
    row uses (the same threshold as computing it: top_k = V and top_p = 1 set none)."""
    head = scaled.topk(width, dim=-1).values  # [N, width] descending
    neg_inf = float("-inf")  # Python scalars, not tensor constants: a torch.cond branch may run this
    thr = torch.full_like(head[:, :1], neg_inf)
    short = torch.zeros(head.shape[0], dtype=torch.bool, device=scaled.device)
    if any_top_k:  # rows without top-k hold V: no threshold
        kth = head.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
        thr = torch.where((top_k < scaled.shape[1]).unsqueeze(1), kth, thr)
        head = head.masked_fill(head < thr, neg_inf)
    if any_top_p:
        # probabilities under the top-k-limited distribution: the denominator over the whole row
        lse = scaled.masked_fill(scaled < thr, neg_inf).logsumexp(dim=-1, keepdim=True)
        csum = torch.cumsum((head - lse).exp(), dim=-1)
        # mass of the tokens ranked strictly before each position (exactly monotone)
        excl = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=1)
        # the kept tokens are a prefix of the ranking, the first always among them
        n_keep = (excl < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)
        p_thr = head.gather(1, n_keep - 1)
        on = (top_p < 1.0).unsqueeze(1)
        thr = torch.maximum(thr, torch.where(on, p_thr, neg_inf))
        # the head's mass below top_p and more of the row left: the threshold may lie past the head
        short = (on & (head[:, -1:] > neg_inf)).squeeze(1) & (csum[:, -1] < top_p)
    return thr, short


def _typical_keep(masked: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: locally typical sampling's kept set (HF's TypicalLogitsWarper rule, threshold
    based like the other filters: ties with the last kept token stay). Rows at 1.0 keep all."""
    logp = masked.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum(dim=-1, keepdim=True)
    shift = (-logp - entropy).abs()  # removed tokens: inf, ranked last
    sorted_shift, order = shift.sort(dim=-1)
    csum = p.gather(1, order).cumsum(dim=-1)
    last = (csum < typical_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(max=shift.shape[1] - 1)
    keep = shift <= sorted_shift.gather(1, last)
    return keep | (typical_p >= 1.0).unsqueeze(1)


def probs_from_penalised(pen: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Target distribution [N, V] fp32 from penalised logits; greedy rows one-hot at argmax."""
    v = pen.shape[1]
    if md.all_greedy:
        return _one_hot(pen.argmax(dim=-1), v)
    scaled = pen / md.temperature.unsqueeze(1)  # greedy rows hold temperature 1
    probs = filter_logits(scaled, md).softmax(dim=-1)
    if not md.all_random:
        one_hot = _one_hot(pen.argmax(dim=-1), v)
        probs = torch.where(md.greedy_mask.unsqueeze(1), one_hot, probs)
    return probs


def processed_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Target distribution after penalties, temperature, top-k, top-p and min-p ([N, V] fp32)."""
    return probs_from_penalised(penalised_logits(logits, md), md)


def _one_hot(ids: torch.Tensor, v: int) -> torch.Tensor:
    out = torch.zeros(ids.shape[0], v, dtype=torch.float32, device=ids.device)
    out.scatter_(1, ids.unsqueeze(1), 1.0)
    return out


class Sampler:
    """Stateless apart from the host draws that key unseeded rows, seeded by ``generator``'s
    initial seed, else torch's (``torch.manual_seed``), or later by ``seed``: dp ranks seed it
    alike (spmd_engine.py), as their steps must draw alike."""

    def __init__(self, generator: torch.Generator | None = None):
        self.seed(torch.initial_seed() if generator is None else generator.initial_seed())

    def seed(self, value: int) -> None:
        """Restart the host draws that key unseeded rows from ``value``."""
        self.step_keys = random.Random(value)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (md.num_rows, md.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != ({md.num_rows}, {md.vocab_size})"
            )
        pen = penalised_logits(logits, md)
        greedy_ids = None if md.all_random else pen.argmax(dim=-1)
        if md.all_greedy:
            token_ids = greedy_ids
        else:
            probs = probs_from_penalised(pen, md)
            token_ids = self.sample_from_probs(probs, md)
            if greedy_ids is not None:
                token_ids = torch.where(md.greedy_mask, greedy_ids, token_ids)
        return self._logprobs(pen, token_ids, md)

    def processed_probs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        return processed_probs(logits, md)

    def step_key(self) -> int:
        """This step's host draw for the unseeded rows' noise keys (noise.keyed_for_step)."""
        return self.step_keys.getrandbits(64)

    def exponential_noise(self, md: SamplingMetadata) -> torch.Tensor:
        """Exp(1) noise [N, V]: seeded rows' from (seed, output position), the others' from
        this step's host draw."""
        keys = md.noise_keys
        if not md.all_seeded:  # a Python int from the host: no copy, no synchronisation
            keys = keyed_for_step(keys, md.seeded if md.any_seeded else None, self.step_key())
        return exponential_noise(keys, md.vocab_size)

    def sample_from_probs(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Exponential race: argmax(p / E) is distributed as Categorical(p)."""
        return (probs / self.exponential_noise(md)).argmax(dim=-1)

    @staticmethod
    def _logprobs(pen: torch.Tensor, token_ids: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if md.max_num_logprobs is None:  # no row asked: a greedy step is then one argmax, nothing more
            return SamplerOutput(token_ids, None, None)
        lp = pen.log_softmax(dim=-1)
        chosen = lp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        n = min(md.max_num_logprobs, md.vocab_size)
        values, ids = lp.topk(n, dim=-1)
        return SamplerOutput(token_ids, chosen, (ids, values))
