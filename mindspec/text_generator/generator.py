"""Generator (MindIE's generator_torch): host inputs -> device tensors -> ModelWrapper -> outputs.

It is the one place that knows about attention data parallelism. With dp > 1 every rank gets the
whole batch (every rank runs the same engine), keeps only its own sequences (dp_plan: a sequence
stays on the rank that holds its KV), pads its share to the token count of the largest share with
dummy sequences on the reserved block (a rank with no sequences runs only a dummy), re-bases the
lm_head rows (``lm_head_local_dp`` for the drafter), runs the model, and gathers logits, hidden
states and draft tokens back in request order (dp_gather), so every rank samples and verifies
the same tokens. The plugin manager and the model never know dp happened.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mindspec.distributed import dp_plan, parallel_state
from mindspec.distributed.dp_gather import OutputGather
from mindspec.distributed.parallel_state import ParallelContext
from mindspec.modeling.draft_rows import lm_rows_only_steps
from mindspec.modeling.forward_metadata import ModelInputs, to_device
from mindspec.modeling.graph_runner import PadSpec, pad_inputs
from mindspec.modeling.hidden_cache import HiddenCacheRows, HiddenKeep
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.modeling.draft_tree import TreeShape
from mindspec.modeling.tree_padding import TreePad, draft_rows, pad_tree_step, real_outputs
from mindspec.modeling.tree_speculation import DraftTree, TreeStepHost
from mindspec.text_generator.sampling.step_targets import TargetRows

PLAIN, PREFILL_MTP, SPECULATIVE, TREE, TREE_VERIFY = 0, 1, 2, 3, 4  # forward kinds, compared across ranks every step
DIGEST_MODULUS = 2**31 - 1  # the step's token digest, compared with its signature


@dataclass
class GeneratorOutput:
    logits: torch.Tensor  # [N, vocab] float32, rows at lm_head_indices
    hidden_states: torch.Tensor  # [T, hidden] (after the final norm)
    draft_tokens: Optional[torch.Tensor] = None  # [bs, K] when a drafter ran in the same forward
    greedy_tokens: Optional[torch.Tensor] = None  # [N] argmax of logits, or sampled targets, where the step computed them
    accepted_drafts: Optional[torch.Tensor] = None  # [B] where the step accepted greedily (modeling/hidden_cache.py)
    tree: Optional[DraftTree] = None  # a tree speculation step's trees


@dataclass
class DpStats:
    """This rank's share of the steps it ran (tests and logs)."""

    steps: int = 0
    idle_steps: int = 0  # steps where this rank had no sequence and ran only a dummy
    padded_tokens: int = 0
    sequences: int = 0


class Generator:
    def __init__(self, model_wrapper: ModelWrapper, parallel: Optional[ParallelContext] = None):
        self.model_wrapper = model_wrapper
        self.parallel = parallel or parallel_state.current()
        self.dp_size = self.parallel.dp_size
        self.dp_rank = self.parallel.dp_rank
        self.assigner = dp_plan.DpAssigner(self.dp_size)
        self.gather = OutputGather(self.parallel.world_group, self.parallel.world_size)
        self.dp_stats = DpStats()

    @property
    def device(self) -> torch.device:
        return self.model_wrapper.device

    @torch.inference_mode()
    def forward(
        self,
        model_inputs: ModelInputs,
        sub_model_inputs: Optional[list[ModelInputs]] = None,
        q_lens: Optional[np.ndarray] = None,
        hidden_states: Optional[torch.Tensor] = None,
        mtp_modules: Optional[list[int]] = None,
        mtp_next_tokens: Optional[np.ndarray] = None,
        tree_mask: Optional[torch.Tensor] = None,
        draft_logits=None,
        hidden_cache: Optional[HiddenCacheRows] = None,
        targets: Optional[TargetRows] = None,
        keep: Optional[HiddenKeep] = None,
    ) -> GeneratorOutput:
        """Plain forward; with ``mtp_modules`` a prefill that also fills the MTP caches
        (``mtp_next_tokens`` [B, modules]: prompt tokens after a prefill chunk, -1 unknown); with
        ``sub_model_inputs`` (one per draft step) an MTP decode: draft, then verify in one call;
        with ``tree_mask`` [B, q, q] the rows of each sequence attend by it (tree verification).
        ``q_lens`` are the per-sequence row counts (the dp split reads them from the inputs).
        ``draft_logits`` rewrites the draft steps' logits (structured output's ``DraftMasks``;
        with dp > 1 each rank's share of them, ``local``). ``hidden_cache`` instead of
        ``hidden_states``: the step reads the drafter's hidden states from that cache itself (and
        may accept and keep rows inside: modeling/hidden_cache.py); with dp > 1 they are gathered
        first and acceptance stays on the host (each rank keeps every sequence's rows).
        ``targets``: a plain step (one rank) samples each logits row's token inside too
        (``greedy_tokens``; all -1 where it could not decide them: sampling/step_targets.py).
        ``keep``: a plain decode step (one rank) writes its hidden states into the drafter's
        hidden cache inside too."""
        if tree_mask is not None:  # a verification of trees drafted on the host side (Medusa)
            if self.dp_size > 1:
                return self._verify_tree_dp(model_inputs, tree_mask.to(self.device))
            out = self.model_wrapper.forward_host(model_inputs, tree_mask=tree_mask.to(self.device))
            return GeneratorOutput(logits=out.logits, hidden_states=out.hidden_states)
        if self.dp_size == 1:
            lm_head_local_dp = None if sub_model_inputs is None else sub_model_inputs[0].lm_head_indices
            return self._run(model_inputs, sub_model_inputs, hidden_states, mtp_modules, lm_head_local_dp,
                             next_tokens=mtp_next_tokens, draft_logits=draft_logits, hidden_cache=hidden_cache,
                             targets=targets, keep=keep)
        if keep is not None:
            raise ValueError("with dp > 1 the drafter keeps the gathered hidden states itself")
        if hidden_cache is not None:
            hidden_states = hidden_cache.gathered()
        if mtp_next_tokens is not None:
            raise ValueError("prefill chunks (SplitFuse) are not split over dp ranks")
        return self._forward_dp(model_inputs, sub_model_inputs, hidden_states, mtp_modules, draft_logits)

    @torch.inference_mode()
    def forward_tree(self, model_inputs: ModelInputs, steps: list[TreeStepHost], hidden_states: torch.Tensor,
                     shape: TreeShape, eagle: bool) -> GeneratorOutput:
        """A tree speculation step: draft a tree per sequence, verify it in one forward. With dp,
        each rank drafts and verifies its own sequences' trees and the results are gathered."""
        if self.dp_size > 1:
            return self._forward_tree_dp(model_inputs, steps, hidden_states, shape, eagle)
        out, tree = self.model_wrapper.forward_tree_host(model_inputs, steps, hidden_states.to(self.device), shape, eagle)
        return GeneratorOutput(logits=out.logits, hidden_states=out.hidden_states, tree=tree)

    def _forward_tree_dp(self, inputs: ModelInputs, steps: list[TreeStepHost], hidden_states: torch.Tensor,
                         shape: TreeShape, eagle: bool) -> GeneratorOutput:
        owners, rows = self._tree_rows(inputs, TREE, len(steps))
        me, width = rows[self.dp_rank], shape.num_nodes + 1
        parts = []
        expert_parallel = self.parallel.ep_size > 1  # every rank runs the same shape, with or without sequences
        if len(me.seqs) or expert_parallel:
            local_steps, hidden_rows = dp_plan.tree_shard(steps, owners, self.dp_rank)
            hidden = hidden_states[torch.from_numpy(hidden_rows).to(hidden_states.device)].to(self.device)
            local = dp_plan.local_inputs(inputs, me)
            if expert_parallel:
                out, tree = self._equal_tree_step(local, local_steps, hidden, inputs, steps, rows, shape, eagle)
            else:
                out, tree = self.model_wrapper.forward_tree_host(local, local_steps, hidden, shape, eagle)
            parts = [out.logits, out.hidden_states, torch.stack([tree.tokens, tree.parents, tree.depths], dim=1)]
        logits, states, trees = self._gather_tree_rows(inputs, rows, parts, width)
        tree = DraftTree(tokens=trees[:, 0], parents=trees[:, 1], depths=trees[:, 2])
        return GeneratorOutput(logits=logits, hidden_states=states, tree=tree)

    def _verify_tree_dp(self, inputs: ModelInputs, tree_mask: torch.Tensor) -> GeneratorOutput:
        """A verification of host-drafted trees (Medusa) with dp: each rank verifies its own
        sequences' trees; the results are gathered."""
        _, rows = self._tree_rows(inputs, TREE_VERIFY, 0)
        me = rows[self.dp_rank]
        parts = []
        local = dp_plan.local_inputs(inputs, me)
        mask = tree_mask[torch.from_numpy(me.seqs).to(self.device)]
        if self.parallel.ep_size > 1:  # every rank runs the same shape: padded to the most sequences of a rank
            out = self._equal_verification(local, mask, inputs, rows)
            parts = [out.logits[: local.num_tokens], out.hidden_states[: local.num_tokens]]
        elif len(me.seqs):
            out = self.model_wrapper.forward_host(local, tree_mask=mask)
            parts = [out.logits, out.hidden_states]
        logits, states, _ = self._gather_tree_rows(inputs, rows, parts, None)
        return GeneratorOutput(logits=logits, hidden_states=states)

    def _equal_tree_step(self, local: ModelInputs, local_steps: list[TreeStepHost], hidden: torch.Tensor,
                         inputs: ModelInputs, steps: list[TreeStepHost], rows: list[dp_plan.RankRows],
                         shape: TreeShape, eagle: bool):
        """With expert parallelism the MoE collectives need the same rows on every rank: the rank's
        trees padded to the most sequences any rank has, each draft step to rows per sequence
        taken from the whole batch (tree_padding.py), so every rank runs the same shape -> the
        rank's own rows of (ModelOutput, DraftTree)."""
        pad = TreePad(max(1, max(len(r.seqs) for r in rows)), draft_rows(steps, shape.depth, eagle), shape.num_nodes + 1,
                      self._table_width(inputs, [s.inputs for s in steps]), *self._dummy())
        main, padded, hidden_map = pad_tree_step(local, local_steps, pad)
        first = hidden.new_zeros((padded[0].inputs.num_tokens, hidden.shape[1]))
        first.index_copy_(0, torch.from_numpy(hidden_map).to(first.device), hidden)
        out, tree = self.model_wrapper.forward_tree(to_device(main, self.device), [s.to_device(self.device) for s in padded],
                                                    first, shape, eagle)
        return real_outputs(out, tree, local.num_tokens, local.num_seqs)

    def _equal_verification(self, local: ModelInputs, mask: torch.Tensor, inputs: ModelInputs,
                            rows: list[dp_plan.RankRows]):
        """A verification of host-drafted trees padded, as ``_equal_tree_step``, to the most
        sequences any rank has (padding sequences attend causally, in the dummy block)."""
        q, most = int(inputs.q_lens[0]), max(1, max(len(r.seqs) for r in rows))
        spec = PadSpec(most, q, most * q, self._table_width(inputs, []), *self._dummy())
        full = torch.ones(most, q, q, dtype=torch.bool, device=self.device).tril()
        full[: local.num_seqs] = mask
        return self.model_wrapper.forward(to_device(pad_inputs(local, spec, q), self.device, full))

    def _table_width(self, inputs: ModelInputs, others: list[ModelInputs]) -> int:
        return max([1, inputs.block_tables.shape[1]] + [o.block_tables.shape[1] for o in others])

    def _dummy(self) -> tuple[int, int]:
        cc = self.model_wrapper.cache_config
        return cc.dummy_block_id, cc.block_size

    def _tree_rows(self, inputs: ModelInputs, kind: int, num_steps: int) -> tuple[np.ndarray, list[dp_plan.RankRows]]:
        """The owner rank of each sequence and each rank's rows of a tree step (sequences whole)."""
        owners = self.assigner.assign(inputs)
        self.gather.check_same([kind, inputs.num_seqs, inputs.num_tokens, num_steps,
                                int(np.dot(owners + 1, np.arange(1, len(owners) + 1)))],
                               "kind, sequences, tokens, draft steps, owners", self.device)
        return owners, [dp_plan.rank_rows(inputs, owners, r) for r in range(self.dp_size)]

    def _gather_tree_rows(self, inputs: ModelInputs, rows: list[dp_plan.RankRows], parts: list[torch.Tensor],
                          width: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Every rank's (logits, hidden states[, trees [seqs, 3, width]]) in the batch's order."""
        vocab, hidden_size = self.model_wrapper.config.vocab_size, self.model_wrapper.config.hidden_size
        shapes = [[(len(r.lm_rows), vocab), (len(r.token_rows), hidden_size)] +
                  ([(len(r.seqs), 3, width)] if width else []) for r in rows]
        every = self.gather.all_gather(parts, shapes, self.device)
        logits = torch.empty(len(inputs.lm_head_indices), vocab, device=self.device)
        states = torch.empty(inputs.num_tokens, hidden_size, dtype=self.model_wrapper.dtype, device=self.device)
        trees = torch.empty(inputs.num_seqs, 3, width, dtype=torch.long, device=self.device) if width else None
        for r, got in zip(rows, every):
            logits[torch.from_numpy(r.lm_rows).to(self.device)] = got[0]
            states[torch.from_numpy(r.token_rows).to(self.device)] = got[1].to(states.dtype)
            if width:
                trees[torch.from_numpy(r.seqs).to(self.device)] = got[2].round().long()
        me = rows[self.dp_rank]
        self.dp_stats.steps += 1
        self.dp_stats.sequences += len(me.seqs)
        self.dp_stats.idle_steps += int(len(me.seqs) == 0)
        return logits, states, trees

    # ---- one rank's forward ------------------------------------------------------------------
    def _run(self, inputs, subs, hidden_states, mtp_modules, lm_head_local_dp, lm_rows_only=None,
             next_tokens: Optional[np.ndarray] = None, draft_logits=None,
             hidden_cache: Optional[HiddenCacheRows] = None, targets: Optional[TargetRows] = None,
             keep: Optional[HiddenKeep] = None) -> GeneratorOutput:
        w = self.model_wrapper
        if subs is not None:
            hidden = None if hidden_states is None else hidden_states.to(self.device)
            out = w.forward_speculative_host(inputs, subs, mtp_modules, hidden, lm_head_local_dp,
                                             lm_rows_only, draft_logits, hidden_cache)
        elif mtp_modules:
            out = w.forward_prefill_mtp_host(inputs, mtp_modules, next_tokens)
        else:
            out = w.forward_host(inputs, targets=targets, keep=keep)
        return GeneratorOutput(logits=out.logits, hidden_states=out.hidden_states, draft_tokens=out.draft_tokens,
                               greedy_tokens=out.greedy_tokens, accepted_drafts=out.accepted_drafts)

    # ---- data parallel -----------------------------------------------------------------------
    def _forward_dp(self, inputs, subs, hidden_states, mtp_modules, draft_logits=None) -> GeneratorOutput:
        owners = self.assigner.assign(inputs)
        cache = self.model_wrapper.cache_config
        shard = dp_plan.shard(inputs, subs, owners, self.dp_rank, self.dp_size, cache.dummy_block_id, cache.block_size)
        self._check_step(inputs, subs, owners, mtp_modules)
        local_hidden = None
        if subs is not None:
            mine = hidden_states[torch.from_numpy(shard.hidden_rows).to(hidden_states.device)]
            pad = mine.new_zeros((shard.num_sub_pad, mine.shape[1]))  # dummies draft from zeros
            local_hidden = torch.cat([mine, pad])
        lm_local = None if subs is None else shard.subs[0].lm_head_indices
        # Draft steps on lm_head rows alone, decided on the whole batch: every rank the same way,
        # so the expert-parallel collectives see the same row counts (a rank's dummies would not
        # pass the test on its own share).
        narrow = None if subs is None else lm_rows_only_steps(subs)
        if draft_logits is not None:  # this rank drafts its own sequences' rows
            draft_logits = draft_logits.local(shard.rows[self.dp_rank].seqs)
        out = self._run(shard.main, shard.subs, local_hidden, mtp_modules, lm_local, narrow, draft_logits=draft_logits)
        self._count(shard)
        return self._gather(out, inputs, shard)

    def _check_step(self, inputs: ModelInputs, subs, owners: np.ndarray, mtp_modules) -> None:
        kind = SPECULATIVE if subs is not None else PREFILL_MTP if mtp_modules else PLAIN
        num_sub = 0 if subs is None else subs[0].num_tokens
        ids = inputs.input_ids.astype(np.int64)  # a digest of the tokens: ranks that sampled apart stop here
        signature = [kind, inputs.num_seqs, inputs.num_tokens, num_sub, len(mtp_modules or []),
                     int(np.dot(owners + 1, np.arange(1, len(owners) + 1))),
                     int(np.dot(ids, np.arange(1, len(ids) + 1)) % DIGEST_MODULUS)]
        self.gather.check_same(signature, "kind, sequences, tokens, drafter rows, MTP steps, owners, token digest",
                               self.device)

    def _gather(self, out: GeneratorOutput, inputs: ModelInputs, shard: dp_plan.DpShard) -> GeneratorOutput:
        vocab, hidden = out.logits.shape[1], out.hidden_states.shape[1]
        k = None if out.draft_tokens is None else out.draft_tokens.shape[1]

        def shapes(rows: dp_plan.RankRows) -> list[tuple[int, ...]]:
            s = [(len(rows.lm_rows), vocab), (len(rows.token_rows), hidden)]
            return s + ([(len(rows.seqs), k)] if k is not None else [])

        me = shard.rows[self.dp_rank]
        parts = [out.logits[: len(me.lm_rows)], out.hidden_states[: len(me.token_rows)]]
        if k is not None:
            parts.append(out.draft_tokens[: len(me.seqs)])
        every = self.gather.all_gather(parts, [shapes(r) for r in shard.rows])
        logits = out.logits.new_empty((len(inputs.lm_head_indices), vocab))  # [N, V]
        states = out.hidden_states.new_empty((inputs.num_tokens, hidden))  # [T, H]
        drafts = None if k is None else out.draft_tokens.new_empty((inputs.num_seqs, k))  # [B, K]
        for rows, got in zip(shard.rows, every):
            device = logits.device
            logits[torch.from_numpy(rows.lm_rows).to(device)] = got[0]
            states[torch.from_numpy(rows.token_rows).to(device)] = got[1].to(states.dtype)
            if drafts is not None:
                drafts[torch.from_numpy(rows.seqs).to(device)] = got[2].to(drafts.dtype)
        return GeneratorOutput(logits=logits, hidden_states=states, draft_tokens=drafts)

    def _count(self, shard: dp_plan.DpShard) -> None:
        me = shard.rows[self.dp_rank]
        self.dp_stats.steps += 1
        self.dp_stats.sequences += len(me.seqs)
        self.dp_stats.idle_steps += int(len(me.seqs) == 0)
        self.dp_stats.padded_tokens += shard.main.num_tokens - len(me.token_rows)
