"""A Hugging Face-layout DeepSeek checkpoint -> DeepSeek's published block FP8 layout
(``mindspec convert SRC DST --to fp8``), so a fine-tune can be served with FP8 experts.

Every decoder-block projection (attention, dense MLP, routed and shared experts; the MTP blocks'
too) becomes float8_e4m3fn with a float32 ``weight_scale_inv`` per block (fp8.quantize);
embeddings, norms, routers, eh_proj and heads are copied unchanged. One shard is read, converted
and written at a time, under the source shard's name, so memory holds one shard.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CheckpointError
from .fp8 import SCALE_SUFFIX, BlockFp8Format, quantize
from .loader import INDEX_FILE, MEDUSA_HEADS_FILE, find_checkpoint_files, read_hf_config
from .random_checkpoint import MANIFEST

FP8_PROJECTIONS = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight"
)


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: BlockFp8Format) -> dict[str, torch.Tensor]:
    """The tensors with every projection quantized and its scale added beside it."""
    out = {}
    for name, t in tensors.items():
        if FP8_PROJECTIONS.fullmatch(name):
            out[name], out[name + SCALE_SUFFIX] = quantize(t, fmt)
        else:
            out[name] = t
    return out


def convert_to_block_fp8(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Write ``src`` (float32/bf16/fp16 safetensors) as a block FP8 checkpoint in ``dst``."""
    src, dst = Path(src), Path(dst)
    config = read_hf_config(src)
    if "quantization_config" in config:
        raise CheckpointError(f"{src} is already quantized (config.json has a quantization_config)")
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} is not empty; not overwriting it")
    files, weight_map = find_checkpoint_files(src)
    if files[0].name == MANIFEST:
        raise CheckpointError(f"{src} holds a random-weights manifest, not weights to convert")
    dst.mkdir(parents=True, exist_ok=True)
    fmt, new_map = BlockFp8Format(block), {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            shard = quantize_tensors({k: handle.get_tensor(k) for k in handle.keys()}, fmt)
        save_file({k: v.contiguous() for k, v in shard.items()}, str(dst / file.name), metadata={"format": "pt"})
        new_map.update({k: file.name for k in shard})
    if weight_map:
        index = {"metadata": {}, "weight_map": dict(sorted(new_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2))
    for f in src.iterdir():  # tokenizer, generation config, Medusa heads...
        weights = f.suffix == ".safetensors" and f.name != MEDUSA_HEADS_FILE
        if f.is_file() and not weights and f.name not in (INDEX_FILE, "config.json"):
            shutil.copy(f, dst / f.name)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
