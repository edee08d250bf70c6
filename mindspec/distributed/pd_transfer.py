"""A PrefillHandoff (PD disaggregation) as bytes and back: the safetensors format, one tensor
per cache layer (``kv.<layer>``: [num_prompt_tokens, kv_lora_rank + qk_rope_head_dim]) and the
prompt, the first token and any request fields in the header's ``__metadata__`` (JSON strings).

safetensors holds only raw tensors and a JSON header (nothing is unpickled), so a decode node can
read what a peer sends without trusting it; every inconsistency is one HandoffError.
"""
from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from mindspec.engine.outputs import PrefillHandoff

from .errors import HandoffError

_HEADER = "mindspec.handoff"


def encode_handoff(handoff: PrefillHandoff, extra: dict[str, Any] | None = None) -> bytes:
    tensors = {f"kv.{i}": t.contiguous() for i, t in enumerate(handoff.kv)}
    meta = {"prompt_token_ids": list(handoff.prompt_token_ids), "first_token_id": int(handoff.first_token_id),
            "num_layers": len(handoff.kv), "extra": extra or {}}
    return save_tensors(tensors, metadata={_HEADER: json.dumps(meta)})


def decode_handoff(data: bytes) -> tuple[PrefillHandoff, dict[str, Any]]:
    """-> (the hand-off, the ``extra`` fields it was sent with)."""
    meta = _metadata(data)
    try:
        tensors = load_tensors(data)
    except Exception as exc:  # safetensors raises its own error types on malformed input
        raise HandoffError(f"the hand-off's tensors cannot be read: {exc}") from None
    prompt, first, num_layers = meta.get("prompt_token_ids"), meta.get("first_token_id"), meta.get("num_layers")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise HandoffError("the hand-off carries no prompt token ids")
    if not isinstance(first, int) or not isinstance(num_layers, int) or num_layers < 1:
        raise HandoffError("the hand-off's first token or layer count is missing")
    kv = []
    for i in range(num_layers):
        t = tensors.get(f"kv.{i}")
        if t is None or t.dim() != 2 or t.shape[0] != len(prompt):
            raise HandoffError(f"the hand-off's cache layer {i} is missing or not [{len(prompt)}, latent]")
        kv.append(t)
    if len({t.shape[1] for t in kv}) != 1:
        raise HandoffError("the hand-off's cache layers differ in width")
    return PrefillHandoff(prompt, first, kv), meta.get("extra") or {}


def check_fits(handoff: PrefillHandoff, num_layers: int, latent_dim: int, vocab_size: int) -> None:
    """A decode node accepts only KV shaped for its own model."""
    if len(handoff.kv) != num_layers:
        raise HandoffError(f"the hand-off carries {len(handoff.kv)} cache layers, this model has {num_layers} "
                           f"(same checkpoint and MTP settings on both nodes?)")
    if handoff.kv[0].shape[1] != latent_dim:
        raise HandoffError(f"the hand-off's latent width is {handoff.kv[0].shape[1]}, this model's is {latent_dim}")
    bad = [t for t in [*handoff.prompt_token_ids, handoff.first_token_id] if not 0 <= t < vocab_size]
    if bad:
        raise HandoffError(f"the hand-off's token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if not all(t.is_floating_point() and torch.isfinite(t).all() for t in handoff.kv):
        raise HandoffError("the hand-off's KV holds non-finite values")


def _metadata(data: bytes) -> dict[str, Any]:
    # safetensors layout: u64 little-endian header length, then the JSON header
    if len(data) < 8:
        raise HandoffError("the hand-off is empty or truncated")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise HandoffError("the hand-off is truncated")
    try:
        header = json.loads(data[8:8 + length])
        return json.loads(header["__metadata__"][_HEADER])
    except (ValueError, KeyError, TypeError):
        raise HandoffError("the body is not a mindspec hand-off (safetensors with mindspec metadata)") from None
