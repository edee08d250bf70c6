"""GGUF files (llama.cpp's format) as mindspec reads them: one file or a split set
(``name-00001-of-00003.gguf``, as llama.cpp's ``gguf-split`` writes them), its metadata as plain
Python values and its tensors by name, memory-mapped through the ``gguf`` package's reader.

Shapes here are torch's order (ggml lists dimensions innermost first: ``ne`` [K, N] is a torch
[N, K]); a quantized tensor's data is its raw blocks, uint8 [..., N, K / block * block_bytes].
What the tensors mean for a model is its architecture's business (``GGUF_ARCHITECTURES``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from .errors import CheckpointError, NotACheckpointError, UnsupportedCheckpointError
from .model_path import GGUF_SUFFIX as SUFFIX, check_model_path

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# GGUF architecture -> the module that maps it onto a Hugging Face layout (hf_config, hf_tensors)
GGUF_ARCHITECTURES = {"deepseek2": "mindspec.models.deepseekv2.gguf_layout"}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # memory-mapped: values for float types, raw blocks (uint8) for quantized ones
    file: Path


@dataclass(frozen=True)
class JoinedTensor:
    """A tensor an architecture builds from several GGUF tensors (dequantized, float32)."""

    name: str  # what the error messages call it
    shape: tuple[int, ...]
    file: Path
    build: Callable[[], torch.Tensor]


class GgufCheckpoint:
    """Every shard of a GGUF model: ``metadata`` (the first shard's key/values, ``split.*``
    dropped) and ``tensors`` by name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = split_files(self.path)
        readers = [_read(f) for f in self.files]
        self.metadata = {k: v for k, v in read_metadata(readers[0]).items() if not k.startswith("split.")}
        self.tensors: dict[str, GgufTensor] = {}
        for file, reader in zip(self.files, readers):
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise CheckpointError(f"tensor {t.name!r} appears in both {self.tensors[t.name].file.name} and {file.name}")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self.tensors[t.name] = GgufTensor(t.name, GGMLQuantizationType(int(t.tensor_type)), shape, t.data, file)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise NotACheckpointError(f"{self.path} has no general.architecture in its metadata")
        return arch

    def layout(self):
        """The module mapping this file's architecture onto a Hugging Face layout."""
        import importlib

        module = GGUF_ARCHITECTURES.get(self.architecture)
        if module is None:
            raise UnsupportedCheckpointError(
                f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported "
                f"(mindspec reads {', '.join(sorted(GGUF_ARCHITECTURES))})"
            )
        return importlib.import_module(module)


def split_files(path: Path) -> list[Path]:
    """[path] for a single file; every shard, in order, for any shard of a split set."""
    check_model_path(path)
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}{SUFFIX}") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise NotACheckpointError(f"split GGUF {path.name} has {count} shards but {', '.join(missing)} "
                                  f"{'is' if len(missing) == 1 else 'are'} missing from {str(path.parent)!r}")
    return files


def _read(file: Path) -> GGUFReader:
    try:
        return GGUFReader(file)
    except (ValueError, OSError, EOFError, IndexError, KeyError) as exc:
        raise NotACheckpointError(f"{file} is not a readable GGUF file: {exc}") from None


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Key/values as Python values (strings, numbers, bools, lists), ``GGUF.*`` header fields
    left out."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def write_key_values(writer, metadata: dict[str, Any]) -> None:
    """Key/values onto a ``gguf.GGUFWriter`` with the types llama.cpp's converter writes: ints as
    uint32, floats as float32, bools, strings, lists as arrays (ints in them as int32)."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, (list, tuple)):
            writer.add_array(key, list(value))
        else:
            raise TypeError(f"GGUF metadata {key!r}: cannot write a {type(value).__name__}")
