"""Safetensors checkpoint loading in Hugging Face layout (single file or sharded with an index),
or a random-weights manifest in their place (random_checkpoint.py); a path ending in ``.gguf`` is
a llama.cpp GGUF file, read by gguf_loader.py into the same names.

Tensors stream one at a time into the requested dtype. Every problem is a CheckpointError that
names the tensor and the file: a checkpoint that does not fit the model never half-loads.
"""
from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from .fp8 import BlockFp8Format, Fp8Weight, ScalePairing, checkpoint_quantization
from .gguf_loader import gguf_hf_config, gguf_keys, load_gguf
from .gguf_quants import GgufWeight
from .model_path import check_model_dir, is_gguf
from .random_checkpoint import MANIFEST, RandomWeights
from .errors import (
    CheckpointError,
    MissingTensorError,
    NotACheckpointError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedCheckpointError,
)

INDEX_FILE = "model.safetensors.index.json"
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class WeightSpec:
    shape: tuple[int, ...]
    optional: bool = False
    keep_dtype: bool = False  # load as float32 whatever the model dtype (e.g. the V3 router bias)


def read_hf_config(model_dir: str | Path, supported_model_types: Iterable[str] = ("deepseek_v2", "deepseek_v3")) -> dict:
    """config.json of a checkpoint directory, or its equivalent from a GGUF file's metadata."""
    if is_gguf(model_dir):
        return gguf_hf_config(Path(model_dir))
    path = check_model_dir(model_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise NotACheckpointError(f"{str(path)!r} is not a model checkpoint: it has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NotACheckpointError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise NotACheckpointError(f"{config_file} must hold a JSON object")
    supported = tuple(supported_model_types)
    model_type = config.get("model_type")
    if model_type not in supported:
        raise NotACheckpointError(
            f"{str(path)!r} is not a DeepSeek checkpoint: config.json has model_type {model_type!r}, "
            f"expected one of {', '.join(supported)}"
        )
    return config


MEDUSA_HEADS_FILE = "medusa_lm_head.safetensors"  # Medusa's own name for its heads


def find_checkpoint_files(model_dir: str | Path) -> tuple[list[Path], dict[str, Path]]:
    """(files, weight_map); weight_map is empty for unindexed checkpoints."""
    path = check_model_dir(model_dir)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            mapped = {str(name): path / str(file) for name, file in weight_map.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise NotACheckpointError(f"{index} is not a safetensors index (no valid weight_map): {exc}") from None
        files = sorted(set(mapped.values()))
        for f in files:
            if not f.is_file():
                raise NotACheckpointError(f"{INDEX_FILE} lists shard {f.name!r}, which is missing from {str(path)!r}")
        return files, mapped
    # Medusa heads beside a model are a drafter's weights, loaded by that plugin (medusa_heads.py)
    files = sorted(f for f in path.glob("*.safetensors") if f.name != MEDUSA_HEADS_FILE)
    if not files and (path / MANIFEST).is_file():
        return [path / MANIFEST], {}
    if not files:
        legacy = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(legacy[:3])}: only safetensors checkpoints are supported)" if legacy else ""
        raise NotACheckpointError(f"{str(path)!r} has no *.safetensors weight files{hint}")
    return files, {}


def load_checkpoint(
    model_dir: str | Path,
    specs: dict[str, WeightSpec],
    dtype: torch.dtype,
    *,
    ignore: tuple[str, ...] = (),
    device: str = "cpu",
    progress: bool = True,
    keep_quantized: str | None = None,
) -> dict[str, torch.Tensor | Fp8Weight | GgufWeight]:
    """Load exactly the tensors in ``specs`` (optional ones may be absent) as ``dtype``. A block
    FP8 checkpoint (fp8.py) has each FP8 weight dequantized into ``dtype`` once its scale is read,
    and a GGUF file each quantized tensor, except those whose name fully matches the regex
    ``keep_quantized``: they stay quantized (Fp8Weight, GgufWeight)."""
    if dtype not in LOADABLE_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    if is_gguf(model_dir):
        loaded = load_gguf(model_dir, specs, dtype, ignore=ignore, device=device, progress=progress, keep=keep_quantized)
        _check_complete(model_dir, specs, loaded)
        return loaded
    files, _ = find_checkpoint_files(model_dir)
    fmt = checkpoint_quantization(_config(model_dir), f"{Path(model_dir) / 'config.json'}")
    fp8 = ScalePairing(fmt, dtype, device, re.compile(keep_quantized) if keep_quantized else None)
    ignored = [re.compile(p) for p in ignore]
    loaded: dict[str, torch.Tensor] = {}
    source: dict[str, Path] = {}
    with ExitStack() as stack:
        # Opening reads headers only (the data is memory-mapped), so counting keys up front is cheap.
        handles = [(f, stack.enter_context(_open(f, device))) for f in files]
        total = sum(len(h.keys()) for _, h in handles)
        bar = stack.enter_context(
            tqdm(total=total, desc=f"Loading {Path(model_dir).name}", unit="tensor", disable=not progress)
        )
        for file, handle in handles:
            for name in handle.keys():
                bar.update(1)
                if any(p.fullmatch(name) for p in ignored):
                    continue
                if fp8.is_scale(name):
                    fp8.add_scale(name, file, handle.get_slice(name), specs, loaded)
                    continue
                _check_key(name, file, specs, source)
                tensor = handle.get_slice(name)
                _check_tensor(name, file, specs[name], tensor, fp8.format)
                source[name] = file
                if tensor.get_dtype().startswith("F8"):
                    fp8.add_weight(name, file, handle.get_tensor(name), loaded)
                    continue
                fp8.check_unscaled(name, file)
                target = torch.float32 if specs[name].keep_dtype else dtype
                loaded[name] = handle.get_tensor(name).to(device=device, dtype=target)
    fp8.check_paired()
    _check_complete(model_dir, specs, loaded)
    return loaded


def _config(model_dir: str | Path) -> dict:
    """config.json as a dict ({} where there is none or it is not an object: read_hf_config
    reports those)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _open(file: Path, device: str = "cpu"):
    if file.name == MANIFEST:
        return RandomWeights(file, device)
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise NotACheckpointError(f"{file} is not a readable safetensors file: {exc}") from None


def _check_key(name: str, file: Path, specs: dict[str, WeightSpec], source: dict[str, Path]) -> None:
    if name.endswith("weight_scale_inv") or (name.endswith("_scale") and name not in specs):
        raise UnsupportedCheckpointError(
            f"tensor {name!r} in {file.name} is a quantization scale, but config.json has no block FP8 "
            "quantization_config (only weight_scale_inv scales of block FP8 checkpoints are supported)"
        )
    if name not in specs:
        raise UnexpectedTensorError(f"unexpected tensor {name!r} in {file.name}: the model has no such weight")
    if name in source:
        raise CheckpointError(f"tensor {name!r} appears in both {source[name].name} and {file.name}")


def _check_tensor(name: str, file: Path, spec: WeightSpec, tensor_slice, fp8: BlockFp8Format | None = None) -> None:
    dtype = tensor_slice.get_dtype()
    if dtype.startswith("F8") and fp8 is None:
        raise UnsupportedCheckpointError(
            f"tensor {name!r} in {file.name} is {dtype} but config.json has no FP8 quantization_config"
        )
    if dtype.startswith("F8") and dtype != "F8_E4M3":
        raise UnsupportedCheckpointError(f"tensor {name!r} in {file.name} is {dtype}: only F8_E4M3 weights are supported")
    shape = tuple(tensor_slice.get_shape())
    if shape != tuple(spec.shape):
        raise ShapeMismatchError(
            f"tensor {name!r} in {file.name} has shape {list(shape)}, expected {list(spec.shape)}"
        )


def _check_complete(model_dir, specs: dict[str, WeightSpec], loaded: dict[str, torch.Tensor]) -> None:
    missing = [n for n, s in specs.items() if not s.optional and n not in loaded]
    if missing:
        more = f" and {len(missing) - 1} more ({', '.join(missing[1:6])}{', ...' if len(missing) > 6 else ''})" if len(missing) > 1 else ""
        raise MissingTensorError(f"checkpoint {str(model_dir)!r} lacks tensor {missing[0]!r}{more}")


def checkpoint_keys(model_dir: str | Path) -> set[str]:
    """Every tensor name in the checkpoint, read from headers only."""
    if is_gguf(model_dir):
        return gguf_keys(model_dir)
    files, weight_map = find_checkpoint_files(model_dir)
    if weight_map:
        return set(weight_map)
    keys: set[str] = set()
    for f in files:
        with _open(f) as h:
            keys.update(h.keys())
    return keys
