"""Generator (MindIE's generator_torch): host inputs -> device tensors -> ModelWrapper -> outputs.

It is the one place that knows about data-parallel attention: with dp > 1 the batch is split over
ranks and every rank padded to the same token count (MoE collectives need equal shapes). This
build runs dp = 1, so the split is the identity, but the hook and its bookkeeping live here so the
plugin manager and the model never change when dp arrives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mindspec.modeling.forward_metadata import ModelInputs, to_device
from mindspec.modeling.model_wrapper import ModelWrapper


@dataclass
class GeneratorOutput:
    logits: torch.Tensor  # [N, vocab] float32, rows at lm_head_indices
    hidden_states: torch.Tensor  # [T, hidden] (after the final norm)
    draft_tokens: Optional[torch.Tensor] = None  # [bs, K] when a drafter ran in the same forward


class Generator:
    def __init__(self, model_wrapper: ModelWrapper, dp_size: int = 1):
        if dp_size != 1:
            raise ValueError(f"dp={dp_size}: attention data parallelism is not available in this build (dp must be 1)")
        self.model_wrapper = model_wrapper
        self.dp_size = dp_size

    @property
    def device(self) -> torch.device:
        return self.model_wrapper.device

    def dp_partition(self, model_inputs: ModelInputs) -> ModelInputs:
        """This rank's share of the batch (dp = 1: all of it)."""
        return model_inputs

    @torch.inference_mode()
    def forward(
        self,
        model_inputs: ModelInputs,
        sub_model_inputs: Optional[list[ModelInputs]] = None,
        q_lens: Optional[np.ndarray] = None,
        hidden_states: Optional[torch.Tensor] = None,
        mtp_modules: Optional[list[int]] = None,
    ) -> GeneratorOutput:
        """Plain forward; with ``mtp_modules`` a prefill that also fills the MTP caches; with
        ``sub_model_inputs`` (one per draft step) an MTP decode: draft, then verify in one call.
        ``q_lens`` are the per-sequence row counts the dp split will need."""
        local = self.dp_partition(model_inputs)
        inputs = to_device(local, self.device)
        if sub_model_inputs is not None:
            subs = [to_device(self.dp_partition(s), self.device) for s in sub_model_inputs]
            # The drafter's lm_head rows rebased to this rank's share of the batch (dp = 1: as is).
            lm_head_local_dp = subs[0].lm_head_indices
            out = self.model_wrapper.forward_speculative(
                inputs, subs, mtp_modules, hidden_states.to(self.device), lm_head_local_dp
            )
        elif mtp_modules:
            out = self.model_wrapper.forward_prefill_mtp(inputs, mtp_modules)
        else:
            out = self.model_wrapper.forward(inputs)
        return GeneratorOutput(logits=out.logits, hidden_states=out.hidden_states, draft_tokens=out.draft_tokens)
