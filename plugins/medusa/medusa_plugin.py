"""MedusaPlugin: speculative decoding with Medusa heads (seed 002; ``"plugin_type": "medusa"``).

The heads read the main model's hidden state at the row that produced a sequence's newest token
(kept after every step), so a step's drafts exist before it runs: head i's top-k tokens are the
candidates for the (i+1)-th position after the fed token, arranged as the static tree of
``tree_choices`` (a node at depth d with rank r is head d-1's r-th token, whatever its parent).
The main model verifies [fed token, nodes...] per sequence with the ancestor mask in one forward
and plugins/tree_verify.py keeps the longest accepted path (``strict``: output identical to no
speculation; ``typical``: Medusa's typical acceptance).

Options (``plugin_params``): ``tree_choices`` (default: DEFAULT_TREE cut to the heads used),
``num_speculative_tokens`` (heads used, default all; the tree's depth when both are given),
``decoding_policy`` (strict | typical), ``posterior_threshold``, ``posterior_alpha``.
Heads: mindspec/modeling/medusa_heads.py. Under async scheduling a decode step's tree is built
when the running step's results are known (fill_in_model_result). With dp each rank verifies its
own sequences' trees (with moe_ep > 1 padded to the same rows on every rank); on a PD decode
node an adopted sequence's first drafts come from a zero hidden state (the hand-off carries KV,
not hidden states): they are verified like any others, so the output is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mindspec.config.plugin_params import PluginParamsError
from mindspec.modeling.draft_tree import TreeShape, TreeShapeError
from mindspec.modeling.medusa_heads import MedusaHeads, MedusaHeadsError
from mindspec.modeling.tree_speculation import ancestor_mask
from mindspec.plugins.mtp import decode_inputs as di
from mindspec.plugins.plugin import Plugin
from mindspec.plugins.tree_verify import TreeVerifier, verification_inputs
from mindspec.text_generator.step import StepBatch, StepInputs, StepOutputs

KNOWN_KEYS = {"num_speculative_tokens", "tree_choices", "decoding_policy", "posterior_threshold", "posterior_alpha"}
# A sparse tree for a few heads (a chain of first choices with second choices near the root),
# measured on the shipped model's heads (benchmarks/README.md, "Draft trees").
DEFAULT_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]


@dataclass(frozen=True)
class MedusaParams:
    tree_choices: tuple[tuple[int, ...], ...]
    decoding_policy: str = "strict"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3


def parse_medusa_params(options: dict, num_heads: int) -> MedusaParams:
    unknown = sorted(set(options) - KNOWN_KEYS)
    if unknown:
        raise PluginParamsError(f"plugin_params.{unknown[0]} is not a medusa option (known: {', '.join(sorted(KNOWN_KEYS))})")
    k = options.get("num_speculative_tokens", num_heads)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_heads:
        raise PluginParamsError(f"plugin_params.num_speculative_tokens must be in 1..{num_heads} (the checkpoint's "
                                f"Medusa heads), got {k!r}")
    choices = options.get("tree_choices", [c for c in DEFAULT_TREE if len(c) <= k])
    try:
        depth = TreeShape.static(choices).depth
    except TreeShapeError as exc:
        raise PluginParamsError(f"plugin_params.{exc}") from None
    if depth > k:
        raise PluginParamsError(f"plugin_params.tree_choices is {depth} deep but {k} Medusa head(s) are used "
                                f"(num_speculative_tokens / the checkpoint's heads)")
    policy = options.get("decoding_policy", "strict")
    if policy not in ("strict", "typical"):
        raise PluginParamsError(f"plugin_params.decoding_policy must be one of strict, typical for plugin_type "
                                f"'medusa', got {policy!r}")
    floats = {}
    for key, default in (("posterior_threshold", 0.09), ("posterior_alpha", 0.3)):
        value = options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise PluginParamsError(f"plugin_params.{key} must be a number in [0, 1], got {value!r}")
        floats[key] = float(value)
    return MedusaParams(tuple(tuple(c) for c in choices), policy, **floats)


class MedusaPlugin(Plugin):
    name = "medusa"

    def __init__(self, generator, cache_config, **options):
        wrapper = self.model_wrapper = generator.model_wrapper
        cfg = wrapper.config
        try:
            self.heads = MedusaHeads.load(wrapper.model_dir, wrapper.backend, wrapper.dtype, cfg.hidden_size,
                                          cfg.vocab_size, wrapper.model.lm_head)
        except MedusaHeadsError as exc:
            raise PluginParamsError(str(exc)) from None
        self.params = parse_medusa_params(options, self.heads.num_heads)
        self.shape = TreeShape.static(self.params.tree_choices)
        self.verifier = TreeVerifier(self.shape, cache_config.block_size)
        self.num_lookahead_tokens = self.shape.num_nodes
        self.draft_positions = self.shape.depth
        self.needs_sampling_metadata = self.params.decoding_policy != "strict"
        self.block_size = cache_config.block_size
        self.depth, self.rank, self.parents = self.shape.static_rows()  # row 0: the fed token
        self.mask = ancestor_mask(torch.from_numpy(self.parents)[None], self.shape.depth)[0]  # [N + 1, N + 1]
        self.top_k = int(self.rank.max()) + 1
        self.hidden: dict[int, torch.Tensor] = {}  # seq_id -> [hidden] at the row of its newest token

    # ---- hooks ---------------------------------------------------------------------------------
    def model_inputs_update(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        if batch.is_prefill or batch.is_mixed:
            return inputs
        seqs = batch.seqs
        hidden = torch.stack([self.hidden[s.seq_id] for s in seqs])  # [B, H]
        top = self.heads.logits(hidden, self.shape.depth).topk(self.top_k, dim=-1).indices  # [B, D, k]
        nodes = top[:, self.depth[1:] - 1, self.rank].cpu().numpy()  # [B, N]
        num_tokens = np.array([s.num_tokens for s in seqs], dtype=np.int64)
        tables = di.block_tables([s.block_table for s in seqs])
        main = verification_inputs(np.array([s.last_token_id for s in seqs]), num_tokens, tables, self.block_size,
                                   self.shape.num_nodes)
        tokens = np.concatenate([main.input_ids.reshape(len(seqs), -1)[:, :1], nodes], axis=1)  # [B, N + 1]
        main.input_ids = tokens.reshape(-1)
        main.positions = main.positions + np.tile(self.depth, len(seqs))
        inputs.model_inputs, inputs.q_lens = main, main.q_lens
        inputs.extra["tree"] = np.stack([tokens, np.broadcast_to(self.parents, tokens.shape),
                                         np.broadcast_to(self.depth, tokens.shape)])
        self.verifier.keep_layout(inputs, num_tokens, tables)
        inputs.extra["tree_mask"] = self.mask.expand(len(seqs), -1, -1)
        return inputs

    def prepare_masks_for_filling(self, batch: StepBatch, inputs: StepInputs, pending: np.ndarray) -> StepInputs:
        """Async scheduling: the drafts come from the hidden state of the running step's last
        accepted row, so a decode step's tree is built at fill time."""
        if not batch.is_prefill:
            inputs.extra["tree_deferred"] = True
        return inputs

    def fill_in_model_result(self, batch: StepBatch, inputs: StepInputs, pending: np.ndarray,
                             accepted: list[list[int]]) -> None:
        if inputs.extra.pop("tree_deferred", False):
            self.model_inputs_update(batch, inputs)

    def forward(self, batch: StepBatch, inputs: StepInputs, generator):
        return generator.forward(inputs.model_inputs, tree_mask=inputs.extra.get("tree_mask"),
                                 targets=inputs.extra.get("targets"))

    def sample_preprocess(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        if "tree" not in inputs.extra:
            return inputs
        history = self.needs_sampling_metadata or not all(s.sampling_params.plain_greedy for s in batch.seqs)
        return self.verifier.sample_rows(inputs, batch, history)

    def plugin_verify(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> StepOutputs:
        if "tree" not in inputs.extra:
            return outputs
        return self.verifier.verify(inputs, outputs, self.params, in_think=None)

    def plugin_cache_update(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> None:
        if "tree" in inputs.extra:
            self.verifier.compact(inputs, self.model_wrapper)
        lm_rows = inputs.model_inputs.lm_head_indices
        for seq, rows in zip(batch.seqs, outputs.accepted_rows):
            if rows:  # the hidden state that produced its newest token drafts its next step
                self.hidden[seq.seq_id] = outputs.hidden_states[int(lm_rows[rows[-1]])].clone()

    def adopt_prefilled(self, seq, hidden_size: int, dtype: torch.dtype, device) -> None:
        """A sequence prefilled on another node: no hidden state came with it."""
        self.hidden[seq.seq_id] = torch.zeros(hidden_size, dtype=dtype, device=device)

    def plugin_cache_clear(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.hidden.pop(seq_id, None)
