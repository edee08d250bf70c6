"""DeepSeek checkpoints between Hugging Face safetensors and GGUF (``mindspec convert``).

To GGUF: llama.cpp's ``deepseek2`` layout and metadata (models/deepseekv2/gguf_layout.py), its
tokenizer keys (gguf_tokenizer.py), and, unlike llama.cpp's own converter today, the MTP modules
as ``nextn`` layers. Weights of two or more dimensions take the requested type where their rows
split into its blocks; others fall back as llama.cpp's quantizer does (Q4_K to Q5_0, Q5_K to
Q5_1, Q6_K to Q8_0, then F16); norms, biases and the router stay F32. The source is read whole
(in its own precision; a block FP8 source dequantized to bf16), so converting needs the model's
bytes in memory.

From GGUF: config.json, the tokenizer and dequantized safetensors in the dtype asked for.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from safetensors.torch import save_file

from . import gguf_quants
from .errors import CheckpointError
from .gguf_file import JoinedTensor, write_key_values
from .gguf_loader import gguf_hf_config, open_gguf
from .loader import checkpoint_keys, load_checkpoint, read_hf_config

GGUF_TYPES = {t.name.lower(): t for t in (
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
)}
_FILE_TYPE = {
    "f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_1": LlamaFileType.MOSTLY_Q4_1,
    "q5_0": LlamaFileType.MOSTLY_Q5_0, "q5_1": LlamaFileType.MOSTLY_Q5_1, "q4_k": LlamaFileType.MOSTLY_Q4_K_M,
    "q5_k": LlamaFileType.MOSTLY_Q5_K_M, "q6_k": LlamaFileType.MOSTLY_Q6_K,
}
_KEEP_F32 = re.compile(r".*(norm\.weight|\.bias|ffn_gate_inp\.weight)")
# llama.cpp's quantizer (llama-quant.cpp tensor_type_fallback): a k-quant's 256-wide blocks that do
# not divide a row fall back to the 32-wide type of about its size.
_FALLBACK = {
    GGMLQuantizationType.Q4_K: GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_K: GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q6_K: GGMLQuantizationType.Q8_0,
}


def _layout():
    from mindspec.models.deepseekv2 import gguf_layout

    return gguf_layout


def tensor_type(name: str, shape: tuple[int, ...], want: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type one tensor is written in when the file's type is ``want``."""
    if len(shape) == 1 or _KEEP_F32.fullmatch(name):
        return GGMLQuantizationType.F32
    for qtype in (want, _FALLBACK[want]) if want in _FALLBACK else (want,):
        if shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:
            return qtype
    return GGMLQuantizationType.F16


def convert_to_gguf(src: str | Path, dst: str | Path, qtype: str = "q8_0", split_max_size: int = 0) -> list[Path]:
    """Write the checkpoint directory ``src`` as GGUF at ``dst`` (``name.gguf``; with
    ``split_max_size`` bytes, shards ``name-00001-of-0000N.gguf``). Returns the files written."""
    from mindspec.models.deepseekv2.config import DeepseekV2Config
    from mindspec.models.deepseekv2.weights import ignored_patterns, model_specs, mtp_modules_in
    from mindspec.text_generator.gguf_tokenizer import tokenizer_metadata
    from mindspec.text_generator.tokenizer import load_tokenizer

    src, dst = Path(src), Path(dst)
    if qtype not in GGUF_TYPES:
        raise CheckpointError(f"GGUF type {qtype!r} is not one mindspec writes; choose from {', '.join(GGUF_TYPES)}")
    if dst.suffix != ".gguf":
        raise CheckpointError(f"{dst} must end in .gguf")
    config = read_hf_config(src)
    cfg = DeepseekV2Config.from_dict(config)
    keys = checkpoint_keys(src)
    n_mtp = min(cfg.num_nextn_predict_layers, mtp_modules_in(cfg, keys))
    config = {**config, "num_nextn_predict_layers": n_mtp}
    # bf16 sources (and block FP8 ones, dequantized) are read as bf16, exactly; anything else as float32
    source_dtype = config.get("torch_dtype", config.get("dtype"))
    dtype = torch.bfloat16 if source_dtype == "bfloat16" or "quantization_config" in config else torch.float32
    tensors = load_checkpoint(src, model_specs(cfg, n_mtp), dtype, ignore=ignored_patterns(cfg, n_mtp, keys),
                              progress=False)
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(dst, _layout().ARCH, split_max_size=split_max_size)
    _write_metadata(writer, config, src.name, qtype)
    write_key_values(writer, tokenizer_metadata(load_tokenizer(src).hf_tokenizer, vocab_size=config["vocab_size"]))
    want = GGUF_TYPES[qtype]
    for name, t in _layout().gguf_tensors(tensors, config):
        kind = tensor_type(name, tuple(t.shape), want)
        writer.add_tensor(name, gguf_quants.quantize(t, kind), raw_dtype=kind)
    files = writer.format_shard_names(dst) if len(writer.tensors) > 1 else [dst]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return files


def _write_metadata(writer: GGUFWriter, config: dict[str, Any], name: str, qtype: str) -> None:
    writer.add_name(name)
    writer.add_file_type(int(_FILE_TYPE[qtype]))
    writer.add_quantization_version(2)
    write_key_values(writer, {f"{writer.arch}.{k}": v for k, v in _layout().gguf_metadata(config).items()})


def convert_from_gguf(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the GGUF file ``src`` (any shard of a split set) as a safetensors checkpoint
    directory ``dst``: config.json, the tokenizer and one ``model.safetensors``."""
    from mindspec.text_generator.tokenizer import load_tokenizer

    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} is not empty; not overwriting it")
    ckpt = open_gguf(src)
    config = gguf_hf_config(src)
    tensors = {}
    for name, source in ckpt.layout().hf_tensors(ckpt):
        if isinstance(source, JoinedTensor):
            value = source.build()
        else:
            value = gguf_quants.dequantize_raw(source.data, source.qtype, source.shape, torch.float32)
        keep_f32 = name.endswith("e_score_correction_bias")
        tensors[name] = value.to(torch.float32 if keep_f32 else dtype).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    load_tokenizer(src).hf_tokenizer.save_pretrained(str(dst))
    return dst
