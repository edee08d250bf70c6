"""llama.cpp's ``deepseek2`` GGUF layout, mapped onto the Hugging Face layout the model loads.

Metadata: the ``deepseek2.*`` keys llama.cpp's converter writes (conversion/deepseek.py) give
config.json's fields. Two are not stored and are inferred: ``mscale`` equals ``mscale_all_dim``
(recovered from ``rope.scaling.yarn_log_multiplier`` = 0.1 * mscale_all_dim; DeepSeek's published
configs have them equal, 0.707 for V2 and 1.0 for V3), and the router follows
``expert_gating_func`` (2, sigmoid: V3's ``noaux_tc``; else V2's softmax routing).

Tensors: ``blk.{i}.*`` names map one to one onto ``model.layers.{i}.*``, except
- ``ffn_{gate,up,down}_exps`` [E, N, K]: every routed expert in one tensor, split into HF's
  per-expert weights;
- ``attn_k_b`` [H, R, nope] and ``attn_v_b`` [H, v, R]: kv_b_proj split per head for llama.cpp's
  absorbed MLA (k_b transposed), joined back into ``kv_b_proj`` [H * (nope + v), R] (older files
  carry ``attn_kv_b`` whole);
- ``blk.{L + j}.nextn.*``: MTP module j (``deepseek2.nextn_predict_layers`` of them, counted in
  ``block_count``), as llama.cpp names DeepSeek's and GLM's NextN layers.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Iterator

import numpy as np
import torch

from mindspec.modeling import gguf_quants
from mindspec.modeling.errors import (
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedCheckpointError,
)
from mindspec.modeling.gguf_file import GgufCheckpoint, GgufTensor, JoinedTensor

ARCH = "deepseek2"
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}
EXPERTS = {f"ffn_{p}_exps.weight": f"{p}_proj.weight" for p in ("gate", "up", "down")}
SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


# ---- metadata -> config.json --------------------------------------------------------------------
def hf_config(meta: dict[str, Any], tensor_names: set[str], where: str) -> dict[str, Any]:
    """config.json's fields from the file's metadata (and whether it has an output tensor)."""
    get = _getter(meta, where)
    nextn = get("nextn_predict_layers", 0)
    rope_dim = get("rope.dimension_count")
    mla_k, mla_v = get("attention.key_length_mla", None), get("attention.value_length_mla", None)
    nope = (mla_k if mla_k is not None else get("attention.key_length")) - rope_dim
    experts = get("expert_count", 0)
    sigmoid = get("expert_gating_func", 1) == GATING_SIGMOID
    n_group = get("expert_group_count", 1) or 1
    config = {
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "vocab_size": get("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens") or []),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "moe_intermediate_size": get("expert_feed_forward_length", 0),
        "num_hidden_layers": get("block_count") - nextn,
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count"),  # MLA: head_count_kv 1 is llama.cpp's MQA view
        "q_lora_rank": get("attention.q_lora_rank", None) or None,
        "kv_lora_rank": get("attention.kv_lora_rank"),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": mla_v if mla_v is not None else get("attention.value_length"),
        "n_routed_experts": experts or None,
        "n_shared_experts": get("expert_shared_count", 0),
        "num_experts_per_tok": get("expert_used_count", 0),
        "n_group": n_group,
        "topk_group": get("expert_group_used_count", 1) or 1,
        "topk_method": "noaux_tc" if sigmoid else ("group_limited_greedy" if n_group > 1 else "greedy"),
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "routed_scaling_factor": _decimal(get("expert_weights_scale", 1.0)),
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "rms_norm_eps": _decimal(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": get("context_length"),
        "num_nextn_predict_layers": nextn,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_theta": _decimal(get("rope.freq_base", 10000.0)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if get("rope.scaling.type", "none") == "yarn":
        config["rope_scaling"] = _yarn(get)
    return config


def _yarn(get) -> dict[str, Any]:
    mscale_all_dim = _decimal(_decimal(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1)
    return {
        "type": "yarn",
        "factor": _decimal(get("rope.scaling.factor")),
        "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        "beta_fast": _decimal(get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": _decimal(get("rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale_all_dim,
        "mscale_all_dim": mscale_all_dim,
    }


def _getter(meta: dict[str, Any], where: str):
    def get(key: str, default: Any = ...):
        value = meta.get(f"{ARCH}.{key}", default)
        if value is ...:
            raise UnsupportedCheckpointError(f"{where}: GGUF metadata has no '{ARCH}.{key}'")
        return value

    return get


def _decimal(value: float) -> float:
    """GGUF stores float32: 1e-06 comes back as 9.99999997e-07; the shortest decimal that rounds
    to the same float32 is what config.json had."""
    return float(str(np.float32(value)))


# ---- tensors -----------------------------------------------------------------------------------
def hf_tensors(ckpt: GgufCheckpoint) -> Iterator[tuple[str, GgufTensor | JoinedTensor]]:
    """(HF name, the GGUF tensor or one joined from several) for every tensor of the file."""
    pending: dict[int, dict[str, GgufTensor]] = {}
    for name, t in ckpt.tensors.items():
        if name in GLOBAL_NAMES:
            yield GLOBAL_NAMES[name], t
            continue
        m = _BLOCK.fullmatch(name)
        if m is None:
            raise UnexpectedTensorError(f"unexpected tensor {name!r} in {t.file.name}: not a {ARCH} tensor")
        layer, local = int(m.group(1)), m.group(2)
        prefix = f"model.layers.{layer}."
        if local in BLOCK_NAMES:
            yield prefix + BLOCK_NAMES[local], t
        elif local in EXPERTS:
            yield from _split_experts(t, prefix + "mlp.experts.{}." + EXPERTS[local])
        elif local in SPLIT_KV_B:
            pending.setdefault(layer, {})[local] = t
            if len(pending[layer]) == 2:
                yield prefix + "self_attn.kv_b_proj.weight", _kv_b(pending.pop(layer))
        else:
            raise UnexpectedTensorError(f"unexpected tensor {name!r} in {t.file.name}: not a {ARCH} tensor")
    for layer, half in pending.items():
        have = next(iter(half))
        missing = next(n for n in SPLIT_KV_B if n != have)
        raise MissingTensorError(f"{ckpt.path.name} has blk.{layer}.{have} but not blk.{layer}.{missing}")


def _split_experts(t: GgufTensor, name: str) -> Iterator[tuple[str, GgufTensor]]:
    for e in range(t.shape[0]):
        yield name.format(e), GgufTensor(t.name, t.qtype, t.shape[1:], t.data[e], t.file)


def _kv_b(half: dict[str, GgufTensor]) -> JoinedTensor:
    k_b, v_b = (half[n] for n in SPLIT_KV_B)
    if len(k_b.shape) != 3 or len(v_b.shape) != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ShapeMismatchError(
            f"{k_b.file.name}: {k_b.name} {list(k_b.shape)} and {v_b.name} {list(v_b.shape)} do not pair "
            "as [heads, kv_lora_rank, nope] and [heads, v, kv_lora_rank]"
        )
    heads, rank, nope = k_b.shape
    shape = (heads * (nope + v_b.shape[1]), rank)
    return JoinedTensor(f"{k_b.name} + {v_b.name}", shape, k_b.file, functools.partial(_join_kv_b, k_b, v_b))


def _join_kv_b(k_b: GgufTensor, v_b: GgufTensor) -> torch.Tensor:
    """k_b [H, R, nope] and v_b [H, v, R] -> kv_b_proj [H * (nope + v), R], rows per head [k | v]."""
    k = gguf_quants.dequantize_raw(k_b.data, k_b.qtype, k_b.shape, torch.float32).transpose(1, 2)  # [H, nope, R]
    v = gguf_quants.dequantize_raw(v_b.data, v_b.qtype, v_b.shape, torch.float32)  # [H, v, R]
    return torch.cat([k, v], dim=1).reshape(-1, k.shape[2])


# ---- the other way: a Hugging Face checkpoint -> GGUF (mindspec convert --to gguf) ---------------
_TO_GGUF_GLOBAL = {hf: g for g, hf in GLOBAL_NAMES.items()}
_TO_GGUF_BLOCK = {hf: g for g, hf in BLOCK_NAMES.items() if g != "attn_kv_b.weight"}
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def gguf_metadata(config: dict[str, Any]) -> dict[str, Any]:
    """The ``deepseek2.*`` keys llama.cpp's converter writes for this config.json (the MTP
    modules counted in block_count, as nextn layers), keyed without the architecture prefix."""
    from mindspec.modeling.rotary import rope_parameters

    layers, nextn = config["num_hidden_layers"], config.get("num_nextn_predict_layers", 0) or 0
    rope_dim, experts = config["qk_rope_head_dim"], config.get("n_routed_experts") or 0
    sigmoid = config.get("model_type") == "deepseek_v3" or config.get("scoring_func") == "sigmoid"
    meta = {
        "block_count": layers + nextn,
        "context_length": config.get("max_position_embeddings", 4096),
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": 1,  # MLA as llama.cpp runs it: one latent "head" shared (MQA)
        "rope.freq_base": float(rope_parameters(config)["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "leading_dense_block_count": config.get("first_k_dense_replace", 0) if experts else layers,
        "vocab_size": config["vocab_size"],
        "attention.kv_lora_rank": config["kv_lora_rank"],
        "attention.key_length": config["kv_lora_rank"] + rope_dim,
        "attention.value_length": config["kv_lora_rank"],
        "attention.key_length_mla": config["qk_nope_head_dim"] + rope_dim,
        "attention.value_length_mla": config["v_head_dim"],
        "expert_feed_forward_length": config.get("moe_intermediate_size") or config["intermediate_size"],
        "expert_shared_count": config.get("n_shared_experts") or 0,
        "rope.dimension_count": rope_dim,
        "nextn_predict_layers": nextn,
    }
    if config.get("q_lora_rank"):
        meta["attention.q_lora_rank"] = config["q_lora_rank"]
    if experts:
        meta.update({
            "expert_count": experts,
            "expert_used_count": config["num_experts_per_tok"],
            "expert_group_count": config.get("n_group") or 1,
            "expert_group_used_count": config.get("topk_group") or 1,
            "expert_gating_func": GATING_SIGMOID if sigmoid else 1,
            "expert_weights_scale": float(config.get("routed_scaling_factor", 1.0)),
            "expert_weights_norm": bool(config.get("norm_topk_prob", sigmoid)),
        })
    meta.update(_yarn_metadata(config))
    return meta


def _yarn_metadata(config: dict[str, Any]) -> dict[str, Any]:
    from mindspec.modeling.rotary import rope_parameters

    rope = rope_parameters(config)
    if rope["rope_type"] != "yarn":
        return {}
    original = rope.get("original_max_position_embeddings") or config.get("max_position_embeddings", 4096)
    factor = rope.get("factor") or config.get("max_position_embeddings", 4096) / original
    return {
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(factor),
        "rope.scaling.original_context_length": int(original),
        "rope.scaling.yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope.scaling.yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope.scaling.yarn_log_multiplier": 0.1 * float(rope.get("mscale_all_dim") or 0.0),
    }


def gguf_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors -> (GGUF name, tensor): experts stacked per layer, kv_b_proj split into
    attn_k_b (transposed) and attn_v_b, an MTP module's own tensors under ``nextn.``."""
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name in _TO_GGUF_GLOBAL:
            yield _TO_GGUF_GLOBAL[name], t
            continue
        m = _HF_BLOCK.fullmatch(name)
        if m is None or (m.group(2) not in _TO_GGUF_BLOCK and m.group(2) != "self_attn.kv_b_proj.weight"
                         and not _HF_EXPERT.fullmatch(m.group(2))):
            raise UnexpectedTensorError(f"tensor {name!r} has no GGUF name in llama.cpp's {ARCH} layout")
        layer, local = int(m.group(1)), m.group(2)
        if (e := _HF_EXPERT.fullmatch(local)) is not None:
            experts.setdefault((layer, e.group(2)), {})[int(e.group(1))] = t
        elif local == "self_attn.kv_b_proj.weight":
            per_head = t.reshape(heads, nope + v, t.shape[-1])  # [H, nope + v, R]
            yield f"blk.{layer}.attn_k_b.weight", per_head[:, :nope].transpose(1, 2).contiguous()  # [H, R, nope]
            yield f"blk.{layer}.attn_v_b.weight", per_head[:, nope:].contiguous()  # [H, v, R]
        else:
            yield f"blk.{layer}.{_TO_GGUF_BLOCK[local]}", t
    for (layer, proj), by_id in sorted(experts.items()):
        if sorted(by_id) != list(range(len(by_id))):
            raise MissingTensorError(f"layer {layer}'s routed experts {proj}_proj are not 0..{len(by_id) - 1}")
        yield f"blk.{layer}.ffn_{proj}_exps.weight", torch.stack([by_id[i] for i in range(len(by_id))])
