"""Model registry: Hugging Face ``model_type`` -> model class, imported on first use.

Packages add architectures through the ``mindspec.models`` entry-point group.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from mindspec.modeling.errors import UnsupportedCheckpointError

MODELS: dict[str, str] = {
    "deepseek_v2": "mindspec.models.deepseekv2.flash_causal_deepseekv2:FlashCausalDeepseekV2",
    "deepseek_v3": "mindspec.models.deepseekv2.flash_causal_deepseekv2:FlashCausalDeepseekV2",
}


def _entry_point_models() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="mindspec.models")}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(set(MODELS) | set(_entry_point_models())))


def model_class(model_type: str):
    target = MODELS.get(model_type) or _entry_point_models().get(model_type)
    if target is None:
        raise UnsupportedCheckpointError(
            f"model_type {model_type!r} is not supported; mindspec runs {', '.join(supported_model_types())}"
        )
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
