"""DeepSeek rope parameters: config normalisation, YaRN inverse frequencies and the softmax scale.

Reproduces transformers' ``_compute_yarn_parameters`` / default rope and DeepSeek's
``yarn_apply_mscale`` (see shared/reference/deepseek_model.md section 1.3).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from mindspec.backend import RotaryEmbedding

DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "yarn")


def rope_parameters(hf_config: dict) -> dict:
    """Normalise a HF config dict's rope settings into one flat dict.

    Accepts the legacy spelling (``rope_scaling`` dict + top-level ``rope_theta``) and the new one
    (``rope_parameters`` dict, which may also carry ``rope_theta``). Keys of the result:
    rope_type ("default" | "yarn"), rope_theta, factor (None = max_pos / original_max),
    original_max_position_embeddings (None = max_position_embeddings), beta_fast, beta_slow,
    mscale, mscale_all_dim, truncate, attention_factor (None = derived).

    ``mscale`` stays None when the config omits it: it then acts as 1 in ``yarn_get_mscale`` but,
    exactly as in transformers, the cos/sin attention factor is get_mscale(factor) rather than the
    mscale / mscale_all_dim ratio.
    """
    raw: dict[str, Any] = {}
    legacy = hf_config.get("rope_scaling")
    if isinstance(legacy, dict):
        raw.update(legacy)
    new = hf_config.get("rope_parameters")
    if isinstance(new, dict):
        raw.update(new)
    rope_type = raw.get("rope_type", raw.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; DeepSeek models use one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = raw.get("rope_theta")
    if theta is None:
        theta = hf_config.get("rope_theta")
    if theta is None:
        theta = DEFAULT_ROPE_THETA
    original_max = raw.get("original_max_position_embeddings")
    if original_max is None:
        original_max = hf_config.get("original_max_position_embeddings")
    return {
        "rope_type": rope_type,
        "rope_theta": float(theta),
        "factor": None if raw.get("factor") is None else float(raw["factor"]),
        "original_max_position_embeddings": original_max,
        # HF: `beta_fast or 32`, `beta_slow or 1`
        "beta_fast": raw.get("beta_fast") or 32,
        "beta_slow": raw.get("beta_slow") or 1,
        "mscale": raw.get("mscale"),
        "mscale_all_dim": raw.get("mscale_all_dim") or 0,
        "truncate": raw.get("truncate", True),
        "attention_factor": raw.get("attention_factor"),
    }


def yarn_get_mscale(scale: Optional[float], mscale: Optional[float] = 1) -> float:
    if scale is None or scale <= 1:
        return 1.0
    if mscale is None:
        mscale = 1
    return 0.1 * mscale * math.log(scale) + 1.0


def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def build_rotary(rope_dim: int, params: dict, max_position_embeddings: int) -> RotaryEmbedding:
    """inv_freq (float32) and cos/sin attention factor, exactly as transformers computes them."""
    base = params["rope_theta"]
    dim = rope_dim
    if params.get("rope_type", "default") == "default":
        return RotaryEmbedding(inv_freq=_default_inv_freq(dim, base), attention_factor=1.0)

    original_max = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = find_correction_dim(beta_fast)
    high = find_correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    return RotaryEmbedding(inv_freq=inv_freq.to(torch.float32), attention_factor=float(attention_factor))


def softmax_scale(qk_head_dim: int, params: dict) -> float:
    """qk_head_dim ** -0.5, times get_mscale(factor, mscale_all_dim) ** 2 for scaled rope (HF's
    yarn_apply_mscale: any rope_type other than default, with mscale_all_dim non-zero)."""
    scale = qk_head_dim ** (-0.5)
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_get_mscale(params.get("factor"), mscale_all_dim)
            scale = scale * m * m
    return scale
