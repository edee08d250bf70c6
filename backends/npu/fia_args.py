"""Host-side arguments of npu_fused_infer_attention_score(_v2), derived once per forward.

FIA takes sequence lengths as Python int lists (SymInt[]): with the TND layout, actual_seq_qlen are
cumulative query ends and, for the paged MLA path, actual_seq_kvlen are per-sequence cache lengths.
One query token per sequence runs without a mask (sparse_mode 0); more than one (MTP verification,
K + 1 tokens) runs causal with the fixed 2048 x 2048 int8 mask (1 = masked) and sparse_mode 3,
which aligns the causal triangle to the end of each sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from mindspec.backend import AttentionMetadata

from .limits import MASK_SIZE

SCRATCH_KEY = "npu.fia_lengths"


@dataclass(frozen=True)
class FiaLengths:
    actual_seq_qlen: list[int]  # cumulative query ends, one per sequence
    actual_seq_kvlen: list[int]  # tokens in the cache per sequence (not cumulative)
    sparse_mode: int  # 0: no mask (one query per sequence), 3: right-down causal with the 2048 mask

    @property
    def needs_mask(self) -> bool:
        return self.sparse_mode == 3


def fia_lengths(meta: AttentionMetadata) -> FiaLengths:
    """Memoised in meta.scratch: every layer of a forward passes the same lists."""
    lengths = meta.scratch.get(SCRATCH_KEY)
    if lengths is None:
        q_lens = [int(q) for q in meta.q_lens_host]
        lengths = FiaLengths(
            actual_seq_qlen=list(accumulate(q_lens)),
            actual_seq_kvlen=[int(s) for s in meta.seq_lens_host],
            sparse_mode=3 if q_lens and max(q_lens) > 1 else 0,
        )
        meta.scratch[SCRATCH_KEY] = lengths
    return lengths


_MASKS: dict[str, torch.Tensor] = {}


def causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048 x 2048 int8 mask sparse_modes 2-4 take: 1 above the diagonal (masked)."""
    key = str(device)
    if key not in _MASKS:
        _MASKS[key] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device), diagonal=1)
    return _MASKS[key]
