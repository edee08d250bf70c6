"""Repetition / frequency / presence penalties with vLLM semantics (out of place)."""
from __future__ import annotations

import torch

from .metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Return penalised fp32 logits [N, V]; the input is not modified.

    repetition (HF rule): for tokens in the prompt or the output, logit > 0 is divided by the
    penalty, otherwise multiplied. frequency: logit -= freq * count(output). presence:
    logit -= pres * (count(output) > 0).
    """
    logits = logits.float()
    if not metadata.any_penalties:
        return logits
    counts = metadata.output_counts
    seen_in_output = counts > 0
    if metadata.any_repetition:
        rep = metadata.repetition_penalty.unsqueeze(1)
        seen = seen_in_output | metadata.prompt_mask
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - metadata.frequency_penalty.unsqueeze(1) * counts.to(logits.dtype)
    logits = logits - metadata.presence_penalty.unsqueeze(1) * seen_in_output.to(logits.dtype)
    return logits
