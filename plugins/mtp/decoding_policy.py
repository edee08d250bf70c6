"""Verification rules shared by all drafters: how many drafts each sequence keeps.

Glossary: the main model scores K+1 rows per sequence, [last token, d1..dK]; row j gives the
target for output position j. A draft d(j+1) is *accepted* when the rule says row j's target
agrees with it; accepted drafts form a prefix (the first rejection ends it). The *bonus* token is
the target at the first non-accepted row (row K when all K are accepted), so every step emits
accepted + 1 tokens and each sequence keeps its own count.

- strict: d(j+1) == target(j), where target is the greedy token (temperature 0) or the token the
  sampler drew for row j with that row's penalties, temperature, top-k/top-p ("sample the target
  at every position, then match"). With greedy drafts this keeps the output distribution exact:
  each emitted token is a draw from the target distribution given the tokens before it.
- relaxed (TensorRT-LLM, thinking span only): d(j+1) is accepted when it is among the target's
  top-N tokens with probability >= p(top-1) - delta; delta = 0 is strict (ties aside).
- typical (Medusa): accept when p(d) > min(epsilon, alpha * exp(-entropy(p))).
- simulated (benchmarks only): draft j is accepted in a given share of steps, whatever the
  target; step cost does not depend on the weights' values, so a random-weight model of a real
  shape then runs as fast as a trained one accepting at those rates.
"""
from __future__ import annotations

import numpy as np
import torch


def accepted_prefix(ok: np.ndarray) -> np.ndarray:
    """ok [B, K] bool per draft -> accepted drafts [B] (length of the all-True prefix)."""
    return np.cumprod(ok, axis=1).sum(axis=1).astype(np.int64)


def strict_accept(draft_tokens: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """draft_tokens [B, K], targets [B, K+1] -> accepted drafts [B]."""
    k = draft_tokens.shape[1]
    return accepted_prefix(draft_tokens == targets[:, :k])


def relaxed_ok(
    draft_tokens: np.ndarray,  # [B, K]
    targets: np.ndarray,  # [B, K] the target sampled where each draft stands
    probs: torch.Tensor,  # [B, K, V] target softmax there
    top_n: int,
    delta: np.ndarray,  # [B] per-sequence delta (0 outside the thinking span)
) -> np.ndarray:
    """[B, K] bool: each draft passes relaxed acceptance (whatever the drafts before it)."""
    top_p, top_ids = probs.topk(top_n, dim=-1)  # [B, K, N]
    threshold = top_p[..., :1] - torch.as_tensor(delta, dtype=top_p.dtype)[:, None, None]
    eligible = top_p >= threshold
    eligible[..., 0] = True  # the top-1 is always a candidate
    hit = (top_ids == torch.as_tensor(draft_tokens)[..., None]) & eligible
    relaxed = hit.any(dim=-1).numpy()
    strict = draft_tokens == targets
    return np.where(delta[:, None] > 0, relaxed | strict, strict)


def relaxed_accept(draft_tokens: np.ndarray, targets: np.ndarray, probs: torch.Tensor, top_n: int,
                   delta: np.ndarray) -> np.ndarray:
    """draft_tokens [B, K], targets [B, K+1], probs [B, K+1, V] -> accepted drafts [B]."""
    k = draft_tokens.shape[1]
    return accepted_prefix(relaxed_ok(draft_tokens, targets[:, :k], probs[:, :k], top_n, delta))


def typical_ok(
    draft_tokens: np.ndarray,  # [B, K]
    targets: np.ndarray,  # [B, K]
    probs: torch.Tensor,  # [B, K, V] temperature-scaled target softmax
    posterior_threshold: float,
    posterior_alpha: float,
) -> np.ndarray:
    """[B, K] bool: each draft passes typical acceptance (or equals the sampled target)."""
    p = probs.double()
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [B, K]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    p_draft = p.gather(-1, torch.as_tensor(draft_tokens)[..., None])[..., 0]
    return (p_draft > threshold).numpy() | (draft_tokens == targets)


def typical_accept(draft_tokens: np.ndarray, targets: np.ndarray, probs: torch.Tensor, posterior_threshold: float,
                   posterior_alpha: float) -> np.ndarray:
    """draft_tokens [B, K], targets [B, K+1], probs [B, K+1, V] -> accepted drafts [B]."""
    k = draft_tokens.shape[1]
    return accepted_prefix(typical_ok(draft_tokens, targets[:, :k], probs[:, :k], posterior_threshold, posterior_alpha))


def tree_paths(parents: np.ndarray, ok: np.ndarray) -> list[list[int]]:
    """parents [B, R] (row 0 the root, -1; parents before children), ok [B, R - 1] per node:
    its token passes the rule at its parent's row -> per sequence the rows of the longest path
    of passing nodes from the root (the first such path in row order). With strict acceptance
    siblings carry distinct tokens, so at most one child of a node passes: the path is unique."""
    num_seqs, rows = parents.shape
    reach = np.zeros((num_seqs, rows), dtype=bool)
    length = np.zeros((num_seqs, rows), dtype=np.int64)
    reach[:, 0] = True
    b = np.arange(num_seqs)
    for r in range(1, rows):
        p = parents[:, r]
        reach[:, r] = ok[:, r - 1] & reach[b, p]
        length[:, r] = np.where(reach[:, r], length[b, p] + 1, 0)
    best = length.argmax(axis=1)  # the first row of the greatest length
    paths = []
    for s in range(num_seqs):
        path, r = [], int(best[s])
        while r > 0:
            path.append(r)
            r = int(parents[s, r])
        paths.append(path[::-1])
    return paths


def emitted_tokens(draft_tokens: np.ndarray, targets: np.ndarray, accepted: np.ndarray) -> list[list[int]]:
    """Accepted drafts then the bonus token (the target at the first non-accepted row)."""
    return [
        draft_tokens[b, :c].tolist() + [int(targets[b, c])] for b, c in enumerate(accepted.tolist())
    ]


def update_think_state(in_think: np.ndarray, tokens: list[list[int]], start_id: int, end_id: int) -> np.ndarray:
    """The last think marker among a sequence's new tokens decides whether it is inside the span."""
    out = in_think.copy()
    for b, toks in enumerate(tokens):
        for t in reversed(toks):
            if t == start_id or t == end_id:
                out[b] = t == start_id
                break
    return out


def simulated_accept(rates: np.ndarray, rng: np.random.Generator, num_seqs: int) -> np.ndarray:
    """rates [K] non-increasing P(draft j accepted) -> accepted drafts [B]. One uniform draw u
    per sequence accepts every draft j with u < rates[j - 1]: a prefix, with P(count >= j) = rates[j - 1]."""
    u = rng.random(num_seqs)
    return (u[:, None] < np.asarray(rates)[None, :]).sum(axis=1).astype(np.int64)
