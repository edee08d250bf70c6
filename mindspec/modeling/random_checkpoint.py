"""A checkpoint whose weights are drawn at load time: config.json plus ``random_weights.json``
(seed and every tensor's name and shape) in place of safetensors files.

It stands in for a published model of the same shape when step cost is what is measured
(``mindspec bench --model-shape``): nothing is downloaded or stored, and a 16B-parameter model
is drawn on the GPU in seconds. The loader reads the manifest as it reads a safetensors header,
so shapes are checked against the model as for a real checkpoint. Its outputs are noise.

Values: norm weights 1, the V3 router bias 0, everything else normal with config.json's
``initializer_range`` (0.02 by default), as transformers initialises these models. Each tensor
has its own generator seeded from the seed and its name, so a tensor's values do not depend on
which others are loaded.

Where the generator runs is the manifest's ``generator``: ``"device"`` (the default) draws on the
device the model loads to, fast but device-specific (torch's CPU and CUDA generators give different
streams for one seed); ``"cpu"`` draws on the CPU and copies, so every backend and device gets the
same values, as a comparison between backends needs.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from .errors import NotACheckpointError

MANIFEST = "random_weights.json"
GENERATORS = ("device", "cpu")


def _checked_generator(generator: str) -> str:
    if generator not in GENERATORS:
        raise ValueError(f"generator must be one of {GENERATORS}, got {generator!r}")
    return generator


def write_manifest(model_dir: str | Path, shapes: dict[str, tuple[int, ...]], seed: int = 0,
                   generator: str = "device") -> Path:
    _checked_generator(generator)
    path = Path(model_dir) / MANIFEST
    manifest = {"seed": seed, "generator": generator, "tensors": {n: list(s) for n, s in shapes.items()}}
    path.write_text(json.dumps(manifest, indent=0) + "\n")
    return path


def manifest_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / MANIFEST


class _Slice:
    """What the loader asks of a tensor before reading it (safetensors' get_slice)."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape

    def get_dtype(self) -> str:
        return "F32"

    def get_shape(self) -> list[int]:
        return list(self.shape)


class RandomWeights:
    """A manifest opened like a safetensors file: ``keys``, ``get_slice``, ``get_tensor``."""

    def __init__(self, path: Path, device: str = "cpu"):
        try:
            manifest = json.loads(Path(path).read_text())
            self.seed = int(manifest["seed"])
            self.shapes = {str(n): tuple(int(d) for d in s) for n, s in manifest["tensors"].items()}
            self.std = float(_config(Path(path).parent).get("initializer_range", 0.02))
            generator = _checked_generator(manifest.get("generator", "device"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise NotACheckpointError(f"{path} is not a random-weights manifest: {exc}") from None
        self.device = torch.device(device)
        self.draw_device = self.device if generator == "device" else torch.device("cpu")

    def __enter__(self) -> "RandomWeights":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.shapes)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.shapes[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device)
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape, device=self.device)
        gen = torch.Generator(self.draw_device).manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        return torch.randn(shape, generator=gen, device=self.draw_device).mul_(self.std).to(self.device)


def _config(model_dir: Path) -> dict:
    config = model_dir / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}
