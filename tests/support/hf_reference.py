"""Reference computations from Hugging Face transformers for the tiny DeepSeek checkpoints.

- ``hf_logits``: full causal forward of one sequence (no cache), logits at every position.
- ``main_hidden_reference``: the main model's ``last_hidden_state`` (after the final ``model.norm``).
- ``mtp_reference``: DeepSeek-V3's MTP formula for one sequence, computed independently of HF's
  ``MtpModel``: e = embed(t); x = eh_proj(cat[enorm(e), hnorm(h)]) (embedding first); x goes through
  an HF MoE decoder layer loaded with the module's block weights (full causal attention, no cache);
  logits = head(shared_head.norm(x)).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoConfig

from tests.support.checkpoints import read_tensors


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[L, V] float32 logits of a full causal forward of ``token_ids`` (positions 0..L-1, no cache)."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    out = model(input_ids=ids, use_cache=False)
    return out.logits[0].float().cpu()


@torch.no_grad()
def main_hidden_reference(model, token_ids: list[int]) -> torch.Tensor:
    """[L, H] float32 ``last_hidden_state`` (after the final norm) of the HF model."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    out = model.model(input_ids=ids, use_cache=False)
    return out.last_hidden_state[0].float().cpu()


def _modeling(config):
    if config.model_type == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        return m.DeepseekV3DecoderLayer, m.DeepseekV3RotaryEmbedding
    if config.model_type == "deepseek_v2":
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

        return m.DeepseekV2DecoderLayer, m.DeepseekV2RotaryEmbedding
    raise ValueError(f"unsupported model_type {config.model_type!r}")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF DeepSeek RMSNorm: normalise in fp32, cast back, multiply by the weight."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)


def _block_state_dict(block: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Checkpoint (per-expert) block keys -> the HF layer's in-memory keys (fused experts)."""
    sd = {}
    n = config.n_routed_experts
    for k, v in block.items():
        if ".experts." in k and not k.startswith("mlp.shared_experts"):
            continue
        sd[k] = v
    gate_up = [torch.cat([block[f"mlp.experts.{e}.gate_proj.weight"], block[f"mlp.experts.{e}.up_proj.weight"]], 0) for e in range(n)]
    sd["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    sd["mlp.experts.down_proj"] = torch.stack([block[f"mlp.experts.{e}.down_proj.weight"] for e in range(n)])
    return sd


def load_mtp_block(path, module_index: int = 0, dtype: torch.dtype = torch.float32):
    """(HF decoder layer with MTP module ``module_index``'s block weights, rotary embedding, config, tensors)

    ``tensors`` holds the module's own tensors keyed by suffix (``enorm.weight`` ...) plus the main
    ``model.embed_tokens.weight`` / ``lm_head.weight`` under the keys ``main.embed`` / ``main.head``."""
    config = AutoConfig.from_pretrained(str(path))
    layer_cls, rope_cls = _modeling(config)
    prefix = f"model.layers.{config.num_hidden_layers + module_index}."
    raw = read_tensors(path, lambda k: k.startswith(prefix) or k in ("model.embed_tokens.weight", "lm_head.weight"))
    if not any(k.startswith(prefix) for k in raw):
        raise KeyError(f"no MTP tensors under {prefix!r} in {path}")
    mod = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
    mod["main.embed"] = raw["model.embed_tokens.weight"]
    mod["main.head"] = raw.get("lm_head.weight", raw["model.embed_tokens.weight"])

    cfg = copy.deepcopy(config)
    cfg.first_k_dense_replace = 0  # the MTP block is always MoE
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    layer = layer_cls(cfg, layer_idx=0)
    skip = ("enorm.", "hnorm.", "eh_proj.", "embed_tokens.", "shared_head.", "main.")
    block = {k: v for k, v in mod.items() if not k.startswith(skip)}
    sd = _block_state_dict(block, cfg)
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("e_score_correction_bias")]
    if missing or unexpected:
        raise KeyError(f"MTP block state mismatch: missing={missing} unexpected={unexpected}")
    layer.to(dtype)
    if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    layer.eval()
    rope = rope_cls(cfg)
    return layer, rope, cfg, mod


@torch.no_grad()
def mtp_reference(path, module_index: int, token_ids_shifted: list[int], prev_hidden: torch.Tensor, positions: list[int],
                  *, dtype: torch.dtype = torch.float32, hidden_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek MTP module ``module_index`` over one sequence, full causal attention, no cache.

    token_ids_shifted[i] is t_{i+1} (the token embedded at row i), prev_hidden[i] the main model's
    (final-normed) hidden state h_i [L, H], positions[i] the RoPE position of row i.
    Returns (logits [L, V] float32, block_out [L, H] float32) where block_out is the decoder block's
    output before ``shared_head.norm``. ``hidden_first=True`` swaps the concat order (a negative
    control only; DeepSeek puts the embedding first).
    """
    layer, rope, cfg, w = load_mtp_block(path, module_index, dtype)
    eps = cfg.rms_norm_eps
    ids = torch.tensor(list(token_ids_shifted), dtype=torch.long)
    L = ids.numel()
    h = prev_hidden.to(dtype).reshape(L, cfg.hidden_size)
    if len(positions) != L:
        raise ValueError("positions and token_ids_shifted must have the same length")

    embed = w.get("embed_tokens.weight", w["main.embed"]).to(dtype)
    e = embed[ids]
    en = _rms_norm(e, w["enorm.weight"].to(dtype), eps)
    hn = _rms_norm(h, w["hnorm.weight"].to(dtype), eps)
    cat = torch.cat([hn, en] if hidden_first else [en, hn], dim=-1)
    x = torch.nn.functional.linear(cat, w["eh_proj.weight"].to(dtype)).unsqueeze(0)  # [1, L, H]

    pos = torch.tensor([list(positions)], dtype=torch.long)
    position_embeddings = rope(x, pos)
    mask = torch.full((L, L), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]  # causal by row order
    out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=position_embeddings, use_cache=False)
    block_out = out[0] if isinstance(out, tuple) else out
    block_out = block_out[0]  # [L, H]

    head = w.get("shared_head.head.weight", w["main.head"]).to(dtype)
    logits = torch.nn.functional.linear(_rms_norm(block_out, w["shared_head.norm.weight"].to(dtype), eps), head)
    return logits.float(), block_out.float()
