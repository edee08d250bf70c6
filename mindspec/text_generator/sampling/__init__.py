"""Sampling: per-request params, per-step metadata, penalties and the batched sampler."""
from .metadata import SamplingMetadata
from .params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from .penalties import apply_penalties
from .sampler import (
    Sampler,
    SamplerOutput,
    filter_logits,
    penalised_logits,
    probs_from_penalised,
    processed_probs,
)

__all__ = [
    "MAX_LOGPROBS",
    "SamplingParams",
    "SamplingParamsError",
    "SamplingMetadata",
    "apply_penalties",
    "Sampler",
    "SamplerOutput",
    "filter_logits",
    "penalised_logits",
    "probs_from_penalised",
    "processed_probs",
]
