"""Block-quantized FP8 weights as DeepSeek publishes them (V3, V3.1, R1).

config.json's ``quantization_config`` reads ``{"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``. Each quantized linear weight W
[N, K] is stored as ``<name>.weight`` in float8_e4m3fn next to ``<name>.weight_scale_inv``, float32
[ceil(N / bn), ceil(K / bk)]: W[i, j] = weight[i, j] * scale_inv[i // bn, j // bk]. Embeddings,
norms, the router and the lm_head stay bf16 (no scale). V3.1's ``scale_fmt: "ue8m0"`` only rounds
the scales to powers of two; they multiply the same way.

The loader dequantizes each weight as it streams in (``dequantize``), into the model's dtype,
except those the model asks to keep (``Fp8Weight``): the routed experts, most of a DeepSeek
model's bytes, on a backend that runs them from FP8 (cpu: each expert dequantized when a token is
routed to it). The npu backend dequantizes everything (Ascend has no FP8 matmul), as does cuda
for now, and the cpu backend when decode steps are compiled (the packages bake weights in).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .errors import (
    CheckpointError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedCheckpointError,
)

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" + this = its scale's name
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


@dataclass(frozen=True)
class BlockFp8Format:
    block: tuple[int, int]  # (rows, columns) of a weight that share one scale

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        n, k = shape
        return math.ceil(n / self.block[0]), math.ceil(k / self.block[1])


def checkpoint_quantization(config: dict, where: str) -> BlockFp8Format | None:
    """The checkpoint's FP8 format from config.json, None for an unquantized checkpoint; any other
    quantization is one UnsupportedCheckpointError naming the field."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise UnsupportedCheckpointError(f"{where}: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise UnsupportedCheckpointError(
            f"{where}: quantization_config.quant_method {method!r} is not supported (block FP8, \"fp8\", is)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedCheckpointError(f"{where}: quantization_config.fmt {fmt!r} is not supported (only \"e4m3\")")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedCheckpointError(
            f"{where}: quantization_config.weight_block_size must be two positive integers "
            f"(per-tensor FP8 is not supported), got {block!r}"
        )
    return BlockFp8Format((block[0], block[1]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFp8Format, dtype: torch.dtype) -> torch.Tensor:
    """weight float8_e4m3fn [..., N, K], scale_inv [..., ceil(N / bn), ceil(K / bk)] -> [..., N, K]
    in ``dtype``, computed in float32 (a scale times an e4m3 value is exact there)."""
    n, k = weight.shape[-2:]
    bn, bk = fmt.block
    lead = weight.shape[:-2]
    if n % bn == 0 and k % bk == 0:  # whole blocks: broadcast each scale over its block, no expanded copy
        blocks = weight.float().view(*lead, n // bn, bn, k // bk, bk)
        return (blocks * scale_inv.float()[..., :, None, :, None]).view(*lead, n, k).to(dtype)
    scales = scale_inv.float().repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return (weight.float() * scales).to(dtype)


@dataclass(eq=False)
class Fp8Weight:
    """A weight kept in FP8: e4m3 values [..., N, K] and their block scales; ``dtype`` is the
    model's, the one it dequantizes to."""

    weight: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale_inv: torch.Tensor  # float32 [..., ceil(N / bn), ceil(K / bk)]
    format: BlockFp8Format
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.weight, self.scale_inv, self.format, dtype or self.dtype)

    def __getitem__(self, index) -> "Fp8Weight":
        """Along the leading (expert) dimension only: weight[index] with its scales (rows of a
        2-D weight: ``slice_rows``)."""
        return Fp8Weight(self.weight[index], self.scale_inv[index], self.format, self.dtype)


def slice_rows(w: Fp8Weight, start: int, stop: int | None = None) -> Fp8Weight:
    """Rows start:stop of a 2-D FP8 weight; a start inside a block of rows gives each row its
    block's scales, a (1, bk) format."""
    bn, bk = w.format.block
    stop = w.shape[0] if stop is None else min(stop, w.shape[0])
    if start % bn == 0:
        return Fp8Weight(w.weight[start:stop], w.scale_inv[start // bn: math.ceil(stop / bn)], w.format, w.dtype)
    per_row = w.scale_inv.repeat_interleave(bn, 0)[: w.shape[0]]
    return Fp8Weight(w.weight[start:stop], per_row[start:stop], BlockFp8Format((1, bk)), w.dtype)


def cat_rows(parts: Sequence[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Row concatenation of 2-D weights. FP8 parts of one format stay FP8: their scales
    concatenate when every part but the last fills whole blocks of rows; otherwise (a gate of 96
    rows in 128-row blocks) each row takes its block's scales, a (1, bk) format. Mixed parts are
    dequantized."""
    if not any(isinstance(p, Fp8Weight) for p in parts):
        return torch.cat(list(parts))
    if not all(isinstance(p, Fp8Weight) for p in parts) or len({(p.format, p.dtype) for p in parts}) != 1:
        return torch.cat([p.dequantize() if isinstance(p, Fp8Weight) else p for p in parts])
    first = parts[0]
    if all(p.shape[0] % p.format.block[0] == 0 for p in parts[:-1]):
        scales, fmt = [p.scale_inv for p in parts], first.format
    else:
        bn, bk = first.format.block
        scales, fmt = [p.scale_inv.repeat_interleave(bn, 0)[: p.shape[0]] for p in parts], BlockFp8Format((1, bk))
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat(scales), fmt, first.dtype)


def stack(parts: Sequence[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """torch.stack of equal-shaped weights; all FP8 (one format) stays FP8."""
    if all(isinstance(p, Fp8Weight) for p in parts) and len({(p.format, p.dtype) for p in parts}) == 1:
        return Fp8Weight(torch.stack([p.weight for p in parts]), torch.stack([p.scale_inv for p in parts]),
                         parts[0].format, parts[0].dtype)
    return torch.stack([p.dequantize() if isinstance(p, Fp8Weight) else p for p in parts])


def quantize(weight: torch.Tensor, fmt: BlockFp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], float32 scale_inv): each block scaled so that its
    largest magnitude maps to e4m3's largest (DeepSeek's and vLLM's weight quantization)."""
    n, k = weight.shape
    bn, bk = fmt.block
    sn, sk = fmt.scale_shape((n, k))
    padded = torch.zeros(sn * bn, sk * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(sn, bn, sk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [sn, sk]
    scale_inv = amax / E4M3_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(sn * bn, sk * bk)
    return q[:n, :k].to(torch.float8_e4m3fn), scale_inv


class ScalePairing:
    """The loader's side of a block FP8 checkpoint: pairs each FP8 weight with its
    ``weight_scale_inv``, in whichever order and shard they come, and dequantizes the pair as soon
    as both are read (or keeps it as an Fp8Weight where ``keep`` matches its name). ``specs``: the
    loader's WeightSpecs by name."""

    def __init__(self, fmt: BlockFp8Format | None, dtype: torch.dtype, device: str, keep: re.Pattern | None):
        self.format, self.dtype, self.device, self.keep = fmt, dtype, device, keep
        self.weights: dict[str, tuple[torch.Tensor, Path]] = {}  # FP8 weights waiting for their scale
        self.scales: dict[str, tuple[torch.Tensor, Path]] = {}  # scales waiting for their weight, by weight name

    def is_scale(self, name: str) -> bool:
        return self.format is not None and name.endswith(".weight" + SCALE_SUFFIX)

    def add_scale(self, name: str, file: Path, tensor_slice, specs: dict, loaded: dict) -> None:
        weight = name[: -len(SCALE_SUFFIX)]
        if weight not in specs:
            raise UnexpectedTensorError(f"unexpected tensor {name!r} in {file.name}: the model has no weight {weight!r}")
        if weight in loaded or len(specs[weight].shape) != 2:
            raise CheckpointError(f"tensor {weight!r} is not FP8 but has a {name!r} in {file.name}")
        want = self.format.scale_shape(specs[weight].shape)
        shape = tuple(tensor_slice.get_shape())
        if shape != want:
            raise ShapeMismatchError(
                f"tensor {name!r} in {file.name} has shape {list(shape)}, expected {list(want)} for "
                f"{weight!r} {list(specs[weight].shape)} in {list(self.format.block)} blocks"
            )
        if weight in self.scales:
            raise CheckpointError(f"tensor {name!r} appears in both {self.scales[weight][1].name} and {file.name}")
        scale = tensor_slice[:]
        if weight in self.weights:
            loaded[weight] = self._pair(weight, self.weights.pop(weight)[0], scale)
        else:
            self.scales[weight] = (scale, file)

    def add_weight(self, name: str, file: Path, weight: torch.Tensor, loaded: dict) -> None:
        if name in self.scales:
            loaded[name] = self._pair(name, weight, self.scales.pop(name)[0])
        else:
            self.weights[name] = (weight, file)

    def check_unscaled(self, name: str, file: Path) -> None:
        if name in self.scales:
            raise CheckpointError(f"tensor {name!r} in {file.name} is not FP8 but has a {name + SCALE_SUFFIX!r}")

    def check_paired(self) -> None:
        """After the last tensor: an FP8 weight still waiting never had a scale."""
        if self.weights:
            name, (_, file) = next(iter(self.weights.items()))
            raise MissingTensorError(
                f"FP8 tensor {name!r} in {file.name} has no {name + SCALE_SUFFIX!r} in the checkpoint")

    def _pair(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | Fp8Weight:
        if self.keep is not None and self.keep.fullmatch(name):
            return Fp8Weight(weight.to(self.device), scale.float().to(self.device), self.format, self.dtype)
        return self._dequantize(weight, scale)

    def _dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # On a GPU (it has float8 arithmetic; Ascend does not) the host never holds more than the
        # FP8 bytes of a weight, and dequantizing takes microseconds there.
        where = self.device if torch.device(self.device).type == "cuda" else "cpu"
        return dequantize(weight.to(where), scale.to(where), self.format, self.dtype).to(self.device)
