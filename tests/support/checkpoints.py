"""Tiny random DeepSeek-V2/V3 checkpoints for tests.

``tiny_v3_config`` / ``tiny_v2_config`` build small ``transformers`` configs (3 layers, hidden 64, MLA,
8 routed experts, YaRN RoPE). ``make_checkpoint`` instantiates the Hugging Face model with random
weights (HF init std 0.02, plus randomised RMSNorm weights ``1 + 0.1*randn`` and a small random
``e_score_correction_bias``), writes it with ``save_pretrained`` (DeepSeek's per-expert key layout)
and appends DeepSeek-V3-style MTP module tensors under ``model.layers.{num_hidden_layers + j}.``.
``load_hf_model`` loads the checkpoint back in ``transformers`` (eager attention and eager experts).
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MTP_SHARD_NAME = "model-mtp.safetensors"

_SMALL_DIMS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=163840,
    tie_word_embeddings=False,
)


def _yarn(mscale: float, mscale_all_dim: float) -> dict:
    return dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )


def tiny_v3_config(**overrides) -> DeepseekV3Config:
    """DeepSeek-V3-shaped tiny config: sigmoid routing with bias, 8 experts top-2 in 2 groups (1 kept),
    1 shared expert, q_lora 48, YaRN factor 40 (mscale 1.0), interleaved RoPE, 1 MTP module."""
    kw = dict(_SMALL_DIMS)
    kw.update(
        q_lora_rank=48,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=_yarn(1.0, 1.0),
        rope_interleave=True,
        num_nextn_predict_layers=1,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def tiny_v2_config(**overrides) -> DeepseekV2Config:
    """DeepSeek-V2-Lite-shaped tiny config: no q LoRA (``q_proj``), softmax greedy routing without
    renormalisation, 2 shared experts, YaRN factor 40 with mscale = mscale_all_dim = 0.707."""
    kw = dict(_SMALL_DIMS)
    kw.update(
        q_lora_rank=None,
        topk_method="greedy",
        n_group=None,
        topk_group=None,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_parameters=_yarn(0.707, 0.707),
    )
    kw.update(overrides)
    return DeepseekV2Config(**kw)


# ----------------------------------------------------------------------------------------------
# randomisation helpers


def _is_norm(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and "norm" in parts[-2]


def _randomise_like(name: str, t: torch.Tensor, gen: torch.Generator, std: float, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):
        return (0.05 * torch.randn(t.shape, generator=gen)).to(torch.float32)
    if _is_norm(name):
        return (1.0 + 0.1 * torch.randn(t.shape, generator=gen)).to(dtype)
    return (std * torch.randn(t.shape, generator=gen)).to(dtype)


@torch.no_grad()
def _randomise_model(model: torch.nn.Module) -> None:
    """Norm weights -> 1 + 0.1*randn; e_score_correction_bias -> 0.05*randn (global RNG)."""
    for name, p in model.named_parameters():
        if _is_norm(name):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn_like(b))


# ----------------------------------------------------------------------------------------------
# safetensors file helpers


def checkpoint_files(path) -> list[Path]:
    """The safetensors files of a checkpoint directory (index order if sharded)."""
    path = Path(path)
    index = path / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    return [path / SINGLE_NAME]


def read_tensors(path, predicate=None) -> dict[str, torch.Tensor]:
    """All tensors (or those whose key satisfies ``predicate``) from a checkpoint directory."""
    out = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if predicate is None or predicate(k):
                    out[k] = sf.get_tensor(k)
    return out


def checkpoint_shapes(path) -> dict[str, tuple[int, ...]]:
    """key -> shape for every tensor in the checkpoint directory (no tensor data read)."""
    out = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                out[k] = tuple(sf.get_slice(k).get_shape())
    return out


def _moe_layer_template(path: Path, config) -> dict[str, torch.Tensor]:
    """Suffix -> tensor of a MoE decoder layer exactly as save_pretrained writes it."""
    n = config.num_hidden_layers
    first_dense = config.first_k_dense_replace or 0
    if n > first_dense:
        prefix = f"model.layers.{n - 1}."
        return {k[len(prefix):]: v for k, v in read_tensors(path, lambda k: k.startswith(prefix)).items()}
    # No MoE layer in the main model: save a 1-layer all-MoE model to learn the layout.
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.first_k_dense_replace = 0
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp, safe_serialization=True)
        prefix = "model.layers.0."
        return {k[len(prefix):]: v for k, v in read_tensors(tmp, lambda k: k.startswith(prefix)).items()}


def _mtp_tensors(config, module: int, gen: torch.Generator, dtype: torch.dtype, with_embed_and_head: bool,
                 template: dict[str, torch.Tensor], main: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    h = config.hidden_size
    std = config.initializer_range
    prefix = f"model.layers.{config.num_hidden_layers + module}."
    out: dict[str, torch.Tensor] = {}
    out[prefix + "enorm.weight"] = (1.0 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    out[prefix + "hnorm.weight"] = (1.0 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    out[prefix + "eh_proj.weight"] = (std * torch.randn(h, 2 * h, generator=gen)).to(dtype)
    out[prefix + "shared_head.norm.weight"] = (1.0 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    if with_embed_and_head:
        embed = main["model.embed_tokens.weight"]
        head = main.get("lm_head.weight", embed)
        out[prefix + "embed_tokens.weight"] = embed.clone().contiguous()
        out[prefix + "shared_head.head.weight"] = head.clone().contiguous()
    for suffix in sorted(template):
        out[prefix + suffix] = _randomise_like(suffix, template[suffix], gen, std, dtype).contiguous()
    return out


def make_checkpoint(path, config, *, seed: int = 0, dtype: torch.dtype = torch.float32, num_mtp_modules: int | None = None,
                    mtp_with_embed_and_head: bool = True, max_shard_size=None) -> Path:
    """Write a random HF checkpoint of ``config`` to ``path`` (created) and return it as a Path.

    The main model comes from ``AutoModelForCausalLM.from_config`` under ``torch.manual_seed(seed)``
    (the global RNG state is restored afterwards), with norms and the V3 router bias randomised, cast
    to ``dtype`` (``e_score_correction_bias`` stays float32, as in the released V3 checkpoint) and
    saved with ``save_pretrained(safe_serialization=True)``. Then ``num_mtp_modules`` (default:
    ``config.num_nextn_predict_layers``, 0 when absent) MTP modules are appended under
    ``model.layers.{num_hidden_layers + j}.``: enorm, hnorm, eh_proj [H, 2H], shared_head.norm,
    optionally embed_tokens / shared_head.head (copies of the main ones), and a full MoE decoder
    block with the same key names/shapes as the main model's MoE layers, randomly initialised.
    Sharded checkpoints (``max_shard_size`` given and exceeded) get the MTP tensors in a new shard
    ``model-mtp.safetensors`` listed in ``model.safetensors.index.json``; a single-file checkpoint is
    rewritten with them.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if num_mtp_modules is None:
        num_mtp_modules = getattr(config, "num_nextn_predict_layers", None) or 0

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        _randomise_model(model)
        model.eval()
        if dtype != torch.float32:
            model.to(dtype)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.data = b.data.to(torch.float32)
        kwargs = {"safe_serialization": True}
        if max_shard_size is not None:
            kwargs["max_shard_size"] = max_shard_size
        model.save_pretrained(path, **kwargs)
    del model

    if num_mtp_modules <= 0:
        return path

    template = _moe_layer_template(path, config)
    main = read_tensors(path, lambda k: k in ("model.embed_tokens.weight", "lm_head.weight"))
    gen = torch.Generator().manual_seed(seed * 7919 + 12345)
    mtp: dict[str, torch.Tensor] = {}
    for j in range(num_mtp_modules):
        mtp.update(_mtp_tensors(config, j, gen, dtype, mtp_with_embed_and_head, template, main))

    index_path = path / INDEX_NAME
    if index_path.exists():
        index = json.loads(index_path.read_text())
        save_file(mtp, str(path / MTP_SHARD_NAME), metadata={"format": "pt"})
        for k in mtp:
            index["weight_map"][k] = MTP_SHARD_NAME
        meta = index.setdefault("metadata", {})
        if "total_size" in meta:
            meta["total_size"] = int(meta["total_size"]) + sum(t.numel() * t.element_size() for t in mtp.values())
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    else:
        single = path / SINGLE_NAME
        tensors = load_file(str(single))
        tensors.update(mtp)
        save_file(tensors, str(single), metadata={"format": "pt"})
    return path


def load_hf_model(path, dtype: torch.dtype = torch.float32):
    """The checkpoint as a transformers model: eager attention, eager (per-expert loop) experts, eval mode.

    MTP tensors (``model.layers.{num_hidden_layers}.*``) are reported as unexpected keys and ignored."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval()


def make_self_predicting_checkpoint(path, config, *, seed: int = 0, residual_scale: float = 0.05,
                                    dtype: torch.dtype = torch.float32) -> Path:
    """A checkpoint whose MTP modules predict what the main model will say, most of the time.

    Every block's output projections (o_proj, down_proj of MLPs and experts) are scaled by
    ``residual_scale``, so the main model's next token is mostly a function g of the current token,
    slightly bent by context. Each MTP module keeps only the embedding path (eh_proj = [I | 0]),
    norms set to the main model's, the same head and scaled blocks, so it predicts g(t(i+1)) =
    t(i+2): drafts are usually accepted (the full-hit path) and sometimes rejected.
    ``dtype``: the checkpoint's weights' dtype.
    """
    path = make_checkpoint(path, config, seed=seed, dtype=dtype)
    tensors = read_tensors(path)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = t * residual_scale
    modules = getattr(config, "num_nextn_predict_layers", 0) or 0
    for j in range(modules):
        p = f"model.layers.{layers + j}."
        tensors[p + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(dtype)
        tensors[p + "enorm.weight"] = torch.ones(hidden, dtype=dtype)
        tensors[p + "hnorm.weight"] = torch.ones(hidden, dtype=dtype)
        tensors[p + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        if p + "shared_head.head.weight" in tensors:
            tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / SINGLE_NAME), metadata={"format": "pt"})
    return path


def write_medusa_heads(path, config, *, num_heads: int = 3, seed: int = 0, scale: float = 0.05,
                       own_lm_head: bool = False, prefix: str = "medusa_head.") -> Path:
    """Random Medusa-1 heads (one residual block each; ``own_lm_head``: each with its lm_head)
    in ``path/medusa_lm_head.safetensors``, the layout mindspec.modeling.medusa_heads reads."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config.hidden_size, config.vocab_size
    tensors = {}
    for i in range(num_heads):
        tensors[f"{prefix}{i}.0.linear.weight"] = torch.randn(hidden, hidden, generator=gen) * scale
        tensors[f"{prefix}{i}.0.linear.bias"] = torch.randn(hidden, generator=gen) * scale
        if own_lm_head:
            tensors[f"{prefix}{i}.1.weight"] = torch.randn(vocab, hidden, generator=gen) * 0.2
    save_file(tensors, str(Path(path) / "medusa_lm_head.safetensors"))
    return Path(path)


def make_block_fp8_checkpoint(src, dst, block: tuple[int, int] = (128, 128)) -> tuple[Path, Path]:
    """DeepSeek's published FP8 layout of checkpoint ``src``: every decoder-block projection (the
    MTP blocks' too) in float8_e4m3fn with a float32 ``weight_scale_inv`` per ``block``; embeddings,
    norms, routers, eh_proj and heads unquantized. Written to ``dst`` in two shards with an index,
    the scales in the other shard from their weights. Also writes ``dst``-dequantized, the same
    weights dequantized to float32 (the reference the FP8 checkpoint must reproduce exactly).
    Returns (fp8 dir, dequantized dir)."""
    from mindspec.modeling.fp8 import SCALE_SUFFIX, BlockFp8Format, dequantize
    from mindspec.modeling.fp8_convert import quantize_tensors

    src, dst = Path(src), Path(dst)
    ref = dst.with_name(dst.name + "-dequantized")
    fmt = BlockFp8Format(block)
    quantized = quantize_tensors(read_tensors(src), fmt)
    scales = {k: v for k, v in quantized.items() if k.endswith(SCALE_SUFFIX)}
    weights = {k: v for k, v in quantized.items() if k not in scales}
    plain = {k: dequantize(v, scales[k + SCALE_SUFFIX], fmt, torch.float32) if k + SCALE_SUFFIX in scales else v
             for k, v in weights.items()}
    for out in (dst, ref):
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("model") and f.suffix != ".safetensors":
                shutil.copy(f, out / f.name)
    save_file(plain, str(ref / SINGLE_NAME), metadata={"format": "pt"})
    shards = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    for file, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ts in shards.items() for k in ts}}
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst, ref
