"""Sampling: per-request params, per-step metadata, penalties and the batched sampler.

The torch-backed names load on first use, so ``sampling.params`` (a request's parameters and
their errors) imports without torch: the command line checks them before the engine loads."""
from importlib import import_module

from .params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

_LAZY = {
    "SamplingMetadata": ".metadata",
    "apply_penalties": ".penalties",
    "Sampler": ".sampler",
    "SamplerOutput": ".sampler",
    "filter_logits": ".sampler",
    "penalised_logits": ".sampler",
    "probs_from_penalised": ".sampler",
    "processed_probs": ".sampler",
}

__all__ = ["MAX_LOGPROBS", "SamplingParams", "SamplingParamsError", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
