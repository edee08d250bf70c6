"""Loading a GGUF file (single or split) into the Hugging Face-named tensors a model asks for.

The file's architecture module (gguf_file.GGUF_ARCHITECTURES) maps its metadata onto a
config.json and its tensors onto HF names; the checks are the safetensors loader's (an
unexpected, missing, duplicated or mis-shaped tensor is one CheckpointError naming it). Weights
whose HF name fully matches ``keep`` stay quantized (gguf_quants.GgufWeight) when their type is
one the torch dequantizers run; every other tensor is dequantized into the model dtype.
"""
from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import gguf_quants
from .errors import (
    CheckpointError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedCheckpointError,
)
from .gguf_file import GgufCheckpoint, GgufTensor, JoinedTensor, split_files

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _open(files: tuple[tuple[str, int, int], ...]) -> GgufCheckpoint:
    return GgufCheckpoint(files[0][0])


def open_gguf(path: str | Path) -> GgufCheckpoint:
    """The file's header and tensor index (memory-mapped), read once per version of its files."""
    files = split_files(Path(path))
    return _open(tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files))


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    ckpt = open_gguf(path)
    try:
        return ckpt.layout().hf_config(ckpt.metadata, set(ckpt.tensors), ckpt.path.name)
    except (TypeError, ValueError) as exc:  # a key of the wrong type
        raise UnsupportedCheckpointError(f"{ckpt.path.name}: unusable GGUF metadata: {exc}") from None


def gguf_keys(path: str | Path) -> set[str]:
    """Every HF tensor name the file provides (nothing is dequantized)."""
    ckpt = open_gguf(path)
    return {name for name, _ in ckpt.layout().hf_tensors(ckpt)}


def load_gguf(
    path: str | Path,
    specs: dict,
    dtype: torch.dtype,
    *,
    ignore: tuple[str, ...] = (),
    device: str = "cpu",
    progress: bool = True,
    keep: str | None = None,
) -> dict[str, torch.Tensor | gguf_quants.GgufWeight]:
    ckpt = open_gguf(path)
    ignored = [re.compile(p) for p in ignore]
    kept = re.compile(keep) if keep else None
    loaded: dict[str, Any] = {}
    for name, source in tqdm(list(ckpt.layout().hf_tensors(ckpt)), desc=f"Loading {ckpt.path.name}",
                             unit="tensor", disable=not progress):
        if any(p.fullmatch(name) for p in ignored):
            continue
        if name not in specs:
            raise UnexpectedTensorError(f"unexpected tensor {name!r} ({_origin(source)}): the model has no such weight")
        if name in loaded:
            raise CheckpointError(f"tensor {name!r} appears twice in {ckpt.path.name}")
        _check_shape(name, source, specs[name].shape)
        target = torch.float32 if specs[name].keep_dtype else dtype
        loaded[name] = _materialize(source, target, device, keep=kept is not None and kept.fullmatch(name) is not None)
    return loaded  # load_checkpoint checks that nothing the model needs is missing


def _origin(source: GgufTensor | JoinedTensor) -> str:
    return f"{source.name} in {source.file.name}"


def _check_shape(name: str, source, want: tuple[int, ...]) -> None:
    shape = tuple(source.shape)
    if shape != tuple(want):
        raise ShapeMismatchError(f"tensor {name!r} ({_origin(source)}) has shape {list(shape)}, expected {list(want)}")


def _materialize(source, dtype: torch.dtype, device: str, keep: bool):
    if isinstance(source, JoinedTensor):
        return source.build().to(device=device, dtype=dtype)
    if keep and source.qtype in gguf_quants.KEPT_TYPES:
        return gguf_quants.from_raw(source.data, source.qtype, source.shape, dtype).to(device)
    return gguf_quants.dequantize_raw(source.data, source.qtype, source.shape, dtype).to(device)
