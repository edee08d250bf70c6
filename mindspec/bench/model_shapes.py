"""Published DeepSeek model shapes with random weights, for measuring step cost at real sizes.

``mindspec bench --model-shape deepseek-v2-lite`` writes a random-weights checkpoint
(mindspec/modeling/random_checkpoint.py) of that shape, with the shipped model's tokenizer, and
measures it like any checkpoint. Random weights make random drafts, so speculative
configurations run with simulated acceptance (the MTP plugin's ``simulated_acceptance``, as
SGLang's SGLANG_SIMULATE_ACC_LEN): drafts are accepted at given per-position rates, and the
tokens/s read off is what a real model accepting at those rates would reach, since a step costs
the same whatever its weights' values.

Shapes (shared/reference/deepseek_model.md section 5.1) keep every width; ``num_layers`` may cut
the depth to fit a machine (a layer slice: the first dense layers are kept first). Each shape
gets one MTP module (DeepSeek-V3's; V2-Lite has none, so it gets one of its own width), drafting
K tokens MTP-Eagle style as V3 deployments do.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from mindspec.modeling.random_checkpoint import write_manifest

_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}

SHAPES: dict[str, dict] = {
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
        "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1, "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3, "rope_interleave": True,
        "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
}
_COMMON = {
    "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "initializer_range": 0.02, "attention_bias": False, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def shape_config(name: str, num_layers: Optional[int] = None, bos: int = 0, eos: int = 1) -> dict:
    """config.json of shape ``name``, cut to ``num_layers`` decoder layers when given."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)}")
    config = {**_COMMON, **SHAPES[name], "bos_token_id": bos, "eos_token_id": eos}
    if num_layers is not None:
        if not 1 <= num_layers <= config["num_hidden_layers"]:
            raise ValueError(f"--shape-layers must be in 1..{config['num_hidden_layers']} for {name}, got {num_layers}")
        config["num_hidden_layers"] = num_layers
        config["first_k_dense_replace"] = min(config["first_k_dense_replace"], num_layers)
    config["architectures"] = ["DeepseekV3ForCausalLM" if config["model_type"] == "deepseek_v3" else "DeepseekV2ForCausalLM"]
    return config


def write_shape_checkpoint(name: str, out_dir: str | Path, tokenizer_dir: str | Path,
                           num_layers: Optional[int] = None, seed: int = 0) -> Path:
    """A random-weights checkpoint of shape ``name`` in ``out_dir`` (config.json, the weights'
    manifest, ``tokenizer_dir``'s tokenizer): loadable wherever a checkpoint directory is."""
    from mindspec.models.deepseekv2.config import DeepseekV2Config
    from mindspec.models.deepseekv2.weights import model_specs

    tokenizer_dir, out = Path(tokenizer_dir), Path(out_dir)
    source = json.loads((tokenizer_dir / "config.json").read_text())  # the tokenizer's special ids
    config = shape_config(name, num_layers, source.get("bos_token_id", 0), source.get("eos_token_id", 1))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / f, out / f)
    cfg = DeepseekV2Config.from_model_dir(out)
    specs = model_specs(cfg, cfg.num_nextn_predict_layers)
    write_manifest(out, {n: s.shape for n, s in specs.items()}, seed)
    return out


def parameter_count(model_dir: str | Path) -> int:
    """Parameters in a random-weights checkpoint (its manifest)."""
    from math import prod

    from mindspec.modeling.random_checkpoint import manifest_path

    tensors = json.loads(manifest_path(model_dir).read_text())["tensors"]
    return sum(prod(s) for s in tensors.values())
