"""DeepSeek-V2/V3 configuration, parsed from a Hugging Face ``config.json``.

One record for both families: V2 routes with softmax (``greedy`` or ``group_limited_greedy``), V3
with sigmoid plus ``e_score_correction_bias`` and top-2-sum group scores. As in transformers, a
layer is MoE exactly when ``layer_idx >= first_k_dense_replace`` (``moe_layer_freq`` is 1 in every
released model); MTP modules sit after the main layers and are therefore MoE too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mindspec.backend import RouterConfig
from mindspec.modeling.rotary import rope_parameters

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


class ModelConfigError(ValueError):
    """A config.json field has a value this model cannot run with."""


@dataclass(frozen=True)
class DeepseekV2Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: Optional[int]  # None: a plain q_proj (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int  # 0: every layer dense
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    max_position_embeddings: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    rope: dict = field(default_factory=dict)  # normalised by mindspec.modeling.rotary.rope_parameters
    eos_token_id: Any = None
    bos_token_id: Any = None

    # ---- derived ---------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scoring(self) -> str:
        return "sigmoid" if self.model_type == "deepseek_v3" else "softmax"

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(
            top_k=self.num_experts_per_tok,
            scoring=self.scoring,
            topk_method=self.topk_method,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: kv_lora_rank + qk_rope_head_dim (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ---- parsing ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, hf: dict) -> "DeepseekV2Config":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        v3 = model_type == "deepseek_v3"
        get = _getter(hf)
        n_routed = get("n_routed_experts", 0, aliases=("num_local_experts", "num_experts")) or 0
        cfg = cls(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            moe_intermediate_size=get("moe_intermediate_size", 0),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=get("num_attention_heads"),
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            n_routed_experts=n_routed,
            n_shared_experts=get("n_shared_experts", 0) or 0,
            num_experts_per_tok=get("num_experts_per_tok", 0) or 0,
            n_group=get("n_group", 1) or 1,
            topk_group=get("topk_group", 1) or 1,
            topk_method="noaux_tc" if v3 else get("topk_method", "greedy"),
            norm_topk_prob=bool(get("norm_topk_prob", v3)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=get("first_k_dense_replace", 3 if v3 else 0) or 0,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=get("max_position_embeddings", 4096),
            num_nextn_predict_layers=get("num_nextn_predict_layers", 0, aliases=("num_mtp_layers",)) or 0,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            rope=_rope(hf),
            eos_token_id=hf.get("eos_token_id"),
            bos_token_id=hf.get("bos_token_id"),
        )
        cfg._validate(hf)
        return cfg

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "DeepseekV2Config":
        from mindspec.modeling.loader import read_hf_config

        return cls.from_dict(read_hf_config(model_dir))

    def _validate(self, hf: dict) -> None:
        heads = self.num_attention_heads
        kv_heads = hf.get("num_key_value_heads", heads)
        if kv_heads not in (None, heads):
            raise ModelConfigError(f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA")
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.n_routed_experts == 0:
            return
        if self.num_experts_per_tok < 1:
            raise ModelConfigError("num_experts_per_tok must be set (>= 1) for a MoE model")
        if self.n_routed_experts % self.n_group:
            raise ModelConfigError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ModelConfigError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.scoring == "sigmoid" and self.n_group > 1 and per_group < 2:
            raise ModelConfigError(f"n_group={self.n_group} leaves fewer than 2 experts per group (top-2 group scores)")
        allowed = self.n_routed_experts if self.topk_method == "greedy" else per_group * self.topk_group
        if self.num_experts_per_tok > allowed:
            raise ModelConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {allowed} experts its groups allow"
            )
        if self.scoring == "softmax" and self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ModelConfigError(f"topk_method {self.topk_method!r} is not a DeepSeek-V2 routing method")


def _getter(hf: dict):
    def get(key: str, default: Any = ..., aliases: tuple[str, ...] = ()):
        for name in (key, *aliases):
            if name in hf:
                return hf[name]
        if default is ...:
            raise ModelConfigError(f"config.json has no {key!r}")
        return default

    return get


def _rope(hf: dict) -> dict:
    try:
        rope = rope_parameters(hf)
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from exc
    if rope.get("rope_type") == "yarn" and rope.get("factor") is None:
        # As transformers does: the factor follows from the two context lengths.
        original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096)
        rope["factor"] = hf.get("max_position_embeddings", 4096) / original
    return rope


def load_config(model_dir: str | Path) -> DeepseekV2Config:
    return DeepseekV2Config.from_model_dir(model_dir)


def config_from_json(path: str | Path) -> DeepseekV2Config:
    return DeepseekV2Config.from_dict(json.loads(Path(path).read_text()))
