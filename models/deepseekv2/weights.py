"""Checkpoint tensor names and shapes of a DeepSeek-V2/V3 model in Hugging Face's layout.

Experts are stored one by one (``mlp.experts.{e}.gate_proj.weight``), as ``save_pretrained`` and
DeepSeek's own checkpoints write them. MTP module j lives at ``model.layers.{num_hidden_layers + j}``
with its own embed_tokens and shared_head.head copies, which are optional: the main model's are
used where a module has none.
"""
from __future__ import annotations

import re

from mindspec.modeling.loader import WeightSpec

from .config import DeepseekV2Config


ROUTED_EXPERTS = r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight"  # regex, full match
# What a backend that runs quantized weights keeps quantized (regex, full match): the embedding,
# every GEMM weight but kv_b_proj (the model splits it per head into absorbed matrices), the head.
QUANTIZED_WEIGHTS = (
    r"(model\.|model\.layers\.\d+\.)embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\."
    r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)|mlp\.(experts\.\d+\.|shared_experts\.)?"
    r"(gate|up|down)_proj|eh_proj|shared_head\.head)\.weight"
)


def layer_prefix(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}."


def decoder_block_specs(cfg: DeepseekV2Config, layer_idx: int) -> dict[str, WeightSpec]:
    """Attention + MLP of one decoder block (main layer or MTP block), keyed by full name."""
    p = layer_prefix(layer_idx)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    specs = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden),
        "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (hidden, heads * cfg.v_head_dim),
    }
    q_out = heads * cfg.qk_head_dim
    if cfg.q_lora_rank is None:
        specs["self_attn.q_proj.weight"] = (q_out, hidden)
    else:
        specs["self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, hidden)
        specs["self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        specs["self_attn.q_b_proj.weight"] = (q_out, cfg.q_lora_rank)
    if cfg.is_moe_layer(layer_idx):
        specs.update(_moe_specs(cfg))
    else:
        specs.update(_mlp_specs("mlp.", hidden, cfg.intermediate_size))
    out = {p + name: WeightSpec(tuple(shape)) for name, shape in specs.items()}
    if cfg.is_moe_layer(layer_idx) and cfg.scoring == "sigmoid":
        # The router bias stays float32 whatever the model dtype (transformers does the same).
        out[p + "mlp.gate.e_score_correction_bias"] = WeightSpec((cfg.n_routed_experts,), keep_dtype=True)
    return out


def _mlp_specs(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def _moe_specs(cfg: DeepseekV2Config) -> dict[str, tuple[int, ...]]:
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    specs: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (cfg.n_routed_experts, hidden)}
    for e in range(cfg.n_routed_experts):
        specs.update(_mlp_specs(f"mlp.experts.{e}.", hidden, inter))
    if cfg.n_shared_experts:
        specs.update(_mlp_specs("mlp.shared_experts.", hidden, inter * cfg.n_shared_experts))
    return specs


def mtp_module_specs(cfg: DeepseekV2Config, module_idx: int) -> dict[str, WeightSpec]:
    layer_idx = cfg.num_hidden_layers + module_idx
    p = layer_prefix(layer_idx)
    hidden = cfg.hidden_size
    specs = decoder_block_specs(cfg, layer_idx)
    specs.update(
        {
            p + "enorm.weight": WeightSpec((hidden,)),
            p + "hnorm.weight": WeightSpec((hidden,)),
            p + "eh_proj.weight": WeightSpec((hidden, 2 * hidden)),
            p + "shared_head.norm.weight": WeightSpec((hidden,)),
            p + "embed_tokens.weight": WeightSpec((cfg.vocab_size, hidden), optional=True),
            p + "shared_head.head.weight": WeightSpec((cfg.vocab_size, hidden), optional=True),
        }
    )
    return specs


def model_specs(cfg: DeepseekV2Config, num_mtp_modules: int) -> dict[str, WeightSpec]:
    """Every tensor the main model and its first ``num_mtp_modules`` MTP modules need."""
    hidden = cfg.hidden_size
    specs = {
        "model.embed_tokens.weight": WeightSpec((cfg.vocab_size, hidden)),
        "model.norm.weight": WeightSpec((hidden,)),
        "lm_head.weight": WeightSpec((cfg.vocab_size, hidden), optional=cfg.tie_word_embeddings),
    }
    for i in range(cfg.num_hidden_layers):
        specs.update(decoder_block_specs(cfg, i))
    for j in range(num_mtp_modules):
        specs.update(mtp_module_specs(cfg, j))
    return specs


def mtp_modules_in(cfg: DeepseekV2Config, keys: set[str]) -> int:
    """How many consecutive MTP modules the checkpoint holds (save_pretrained drops them)."""
    count = 0
    while layer_prefix(cfg.num_hidden_layers + count) + "eh_proj.weight" in keys:
        count += 1
    return count


def ignored_patterns(cfg: DeepseekV2Config, num_mtp_modules: int, keys: set[str]) -> tuple[str, ...]:
    """Checkpoint keys to skip: MTP modules beyond those loaded, rotary caches some exports carry."""
    first_unused = cfg.num_hidden_layers + num_mtp_modules
    layer_ids = {int(m.group(1)) for k in keys if (m := _LAYER.match(k))}
    unused = "|".join(str(i) for i in sorted(layer_ids) if i >= first_unused)
    patterns = [r".*rotary_emb\.inv_freq"]
    if unused:
        patterns.append(rf"model\.layers\.({unused})\..*")
    return tuple(patterns)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
