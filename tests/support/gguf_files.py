"""GGUF files for tests: a tiny DeepSeek-V3 whose every GEMM input width is a multiple of 256
(so the k-quants apply to it, not only their fallbacks), and ``rewrite_gguf``, which copies a
GGUF file with tensors dropped, renamed or reshaped and metadata changed (the broken files the
loader must reject), through the ``gguf`` package's own reader and writer."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from mindspec.modeling.gguf_file import write_key_values
from tests.support.checkpoints import make_checkpoint, tiny_v3_config
from tests.support.tokenizers import make_tokenizer


def k_quant_config(**overrides):
    """Every weight's input width (hidden, q_lora, heads x v, intermediate, moe_intermediate) 256."""
    kw = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, q_lora_rank=256,
              kv_lora_rank=64, num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=32,
              qk_rope_head_dim=16, v_head_dim=128, n_routed_experts=4, n_group=2, topk_group=1,
              num_hidden_layers=2, first_k_dense_replace=1, initializer_range=0.1)
    kw.update(overrides)
    return tiny_v3_config(**kw)


def make_model_with_tokenizer(path: Path, config, seed: int = 0) -> Path:
    """A random safetensors checkpoint (MTP modules included) with the tests' byte-level BPE tokenizer."""
    make_checkpoint(path, config, seed=seed)
    make_tokenizer(path, vocab_size=config.vocab_size)
    return path


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    keep: Callable[[str], bool] = lambda name: True,
    rename: Optional[Callable[[str], str]] = None,
    reshape: Optional[dict[str, tuple[int, ...]]] = None,
    metadata: Optional[dict[str, Any]] = None,
    arch: Optional[str] = None,
    extra: Optional[dict[str, np.ndarray]] = None,
) -> Path:
    """Copy ``src`` to ``dst`` with only the tensors ``keep`` accepts (renamed by ``rename``, the
    named ones given a new torch-order shape of the same size), the float32 tensors in ``extra``
    added, and the key/values in ``metadata`` set (string, bool, float or uint32; None removes a
    key)."""
    reader = GGUFReader(src)
    arch = arch or str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(dst, arch)
    changes = dict(metadata or {})
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in changes:
            value = changes.pop(name)
            if value is not None:
                write_key_values(writer, {name: value})
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, field.types[0])
    write_key_values(writer, {k: v for k, v in changes.items() if v is not None})
    for t in reader.tensors:
        if not keep(t.name):
            continue
        data = np.asarray(t.data)
        if reshape and t.name in reshape:
            data = data.reshape(_byte_shape(reshape[t.name], GGMLQuantizationType(int(t.tensor_type)), data))
        raw = None if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else t.tensor_type
        writer.add_tensor(rename(t.name) if rename else t.name, data, raw_dtype=raw)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _byte_shape(shape: tuple[int, ...], qtype: GGMLQuantizationType, data: np.ndarray) -> tuple[int, ...]:
    if data.dtype != np.uint8:
        return shape
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * size)


def with_whole_kv_b(src: Path, dst: Path) -> Path:
    """``src`` with each layer's attn_k_b / attn_v_b pair replaced by one F32 attn_kv_b, as GGUF
    files written before llama.cpp split it (for its absorbed MLA) carry it."""
    from mindspec.models.deepseekv2.gguf_layout import _join_kv_b
    from mindspec.modeling.gguf_file import GgufCheckpoint

    ckpt = GgufCheckpoint(src)
    whole = {}
    for name, t in ckpt.tensors.items():
        if name.endswith("attn_k_b.weight"):
            v_b = ckpt.tensors[name.replace("attn_k_b", "attn_v_b")]
            whole[name.replace("attn_k_b", "attn_kv_b")] = _join_kv_b(t, v_b).numpy()
    keep = lambda n: not n.endswith(("attn_k_b.weight", "attn_v_b.weight"))  # noqa: E731
    return rewrite_gguf(src, dst, keep=keep, extra=whole)
