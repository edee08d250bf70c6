"""Medusa heads (seed 002, Medusa-1 layout): extra decoding heads on the main model's last hidden state.

Head i predicts the token i + 2 positions after the row's own token (the main lm_head predicts the
next one): ``logits_i = lm_head_i(x + SiLU(W_ij x + b_ij)...)``, one or more residual SiLU blocks
and the head's own lm_head, or the model's when the head has none.

Weights come from ``medusa_lm_head.safetensors`` in the model directory, the name Medusa's
training code saves. Tensor names, with or without a ``medusa_head.`` prefix (Medusa-1 saves the
head ModuleList's state dict; checkpoints with heads merged into the model prefix them):

    {i}.{j}.linear.weight  [hidden, hidden]   block j of head i
    {i}.{j}.linear.bias    [hidden]
    {i}.{L}.weight         [vocab, hidden]    optional: head i's own lm_head after its L blocks

Medusa's published ``.pt`` heads load with ``safetensors.torch.save_file(torch.load(f), ...)``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from mindspec.backend import Backend, LinearWeight
from mindspec.modeling.loader import MEDUSA_HEADS_FILE

_KEY = re.compile(r"(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


class MedusaHeadsError(ValueError):
    """Missing or malformed Medusa head weights."""


@dataclass
class MedusaBlock:
    weight: LinearWeight  # [hidden, hidden]
    bias: torch.Tensor  # [hidden]


class MedusaHeads:
    def __init__(self, blocks: list[list[MedusaBlock]], lm_heads: list[Optional[LinearWeight]],
                 shared_lm_head: LinearWeight, backend: Backend):
        self.blocks = blocks
        self.lm_heads = [own or shared_lm_head for own in lm_heads]
        self.backend = backend

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @classmethod
    def load(cls, model_dir: str | Path, backend: Backend, dtype: torch.dtype, hidden_size: int, vocab_size: int,
             shared_lm_head: LinearWeight) -> "MedusaHeads":
        from safetensors.torch import load_file

        path = Path(model_dir) / MEDUSA_HEADS_FILE
        if not path.is_file():
            raise MedusaHeadsError(f"plugin_type 'medusa' needs Medusa heads: no {MEDUSA_HEADS_FILE} in {str(model_dir)!r}")
        parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for name, tensor in load_file(str(path)).items():
            m = _KEY.fullmatch(name)
            if m is None:
                raise MedusaHeadsError(f"{path.name}: unexpected tensor {name!r} (expected {{head}}.{{block}}.linear.weight, "
                                       f".linear.bias or {{head}}.{{blocks}}.weight)")
            parts.setdefault((int(m[1]), int(m[2])), {})[m[3]] = tensor
        heads = sorted({h for h, _ in parts})
        if not heads or heads != list(range(len(heads))):
            raise MedusaHeadsError(f"{path.name}: heads must be numbered 0..n-1, found {heads}")
        blocks, lm_heads = [], []
        for h in heads:
            own = [parts[(h, j)] for j in sorted(j for i, j in parts if i == h)]
            layers = [p for p in own if "linear.weight" in p]
            tail = [p for p in own if "weight" in p and "linear.weight" not in p]
            blocks.append([cls._block(path, h, j, p, hidden_size, backend, dtype) for j, p in enumerate(layers)])
            lm_heads.append(cls._lm_head(path, h, tail, hidden_size, vocab_size, backend, dtype))
        return cls(blocks, lm_heads, shared_lm_head, backend)

    @staticmethod
    def _block(path, h, j, p, hidden, backend, dtype) -> MedusaBlock:
        w, b = p.get("linear.weight"), p.get("linear.bias")
        if w is None or b is None or tuple(w.shape) != (hidden, hidden) or tuple(b.shape) != (hidden,):
            raise MedusaHeadsError(f"{path.name}: head {h} block {j} needs linear.weight [{hidden}, {hidden}] and "
                                   f"linear.bias [{hidden}]")
        device = backend.device
        return MedusaBlock(backend.linear_weight(w.to(device=device, dtype=dtype)), b.to(device=device, dtype=dtype))

    @staticmethod
    def _lm_head(path, h, tail, hidden, vocab, backend, dtype) -> Optional[LinearWeight]:
        if not tail:
            return None
        w = tail[0]["weight"]
        if tuple(w.shape) != (vocab, hidden):
            raise MedusaHeadsError(f"{path.name}: head {h}'s lm_head must be [{vocab}, {hidden}], got {list(w.shape)}")
        return backend.linear_weight(w.to(device=backend.device, dtype=dtype))

    def logits(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """hidden [B, H] (after the final norm) -> [B, num_heads, V] float32 logits of heads 0.."""
        out = []
        for blocks, lm_head in zip(self.blocks[:num_heads], self.lm_heads):
            x = hidden
            for block in blocks:
                x = x + F.silu(self.backend.linear(x, block.weight) + block.bias)
            out.append(self.backend.linear(x, lm_head).float())
        return torch.stack(out, dim=1)
