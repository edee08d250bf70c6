"""MtpPlugin: DeepSeek MTP speculative decoding through the five plugin hooks (seed 000).

Prefill: the main model, then the MTP module(s) over the prompt shifted by one plus the new token.
Decode: K greedy MTP draft steps, then the main model verifies [last token, d1..dK] in the same
forward; the decoding policy keeps 1..K+1 tokens per sequence. Rejected drafts need no KV clean-up:
the sequence length is the rollback, and the next step overwrites their slots.

Per-sequence cache (MindIE's mtp_hidden_states / mtp_last_token_num): the main model's hidden
states of the last positions (hidden_history.py: one ring buffer for every sequence) and, per MTP
module, how many tokens still lack its cache entry (the tokens the last step that used it
accepted: 1 after prefill; more after steps without it).

Adaptive speculation (adaptive.py, on by default): per decode step the plugin picks how many
drafts each sequence verifies, counts[b] in 0..K, from that sequence's acceptance and the step
time measured at this batch size. The step drafts k = max(counts) tokens and sequence b verifies
the first counts[b] of them (ragged verification rows; k = 0 is a plain decode step). A step
with k drafts runs the first k draft steps over every sequence: MTP Eagle's one module (any
k > 0), MTP Vanilla's modules 0..k-1, so a sequence verifying fewer still has its caches
written. Each module it skips falls behind by the tokens the step accepts; the next step that
uses the module writes the missed entries first (the window of decode_inputs: ``last_accepted``
is the deepest used module's lag). Where the step drafts, module 0, which every speculative step
uses, never falls more than CATCH_UP entries behind: then that sequence verifies at least the
fewest drafts the controller allows, since entries never written would lower its acceptance for
the rest of its life. A module the draft count chosen at the batch size does not use (every
module where no count pays: a plain bucket) keeps only the missed entries a steady step writes,
so a step that uses it again has a steady step's shape, not a catch-up's (_entries_kept).
Vanilla's later modules are not forced: at a large batch,
where one draft per step pays and three do not, catching them up would cost two decoder layers
per token. A later module more than CATCH_UP entries behind gives up its oldest missed entries
(vLLM's speculative_disable_by_batch_size leaves a disabled request's draft cache stale for good);
verification keeps every choice lossless, a stale entry only weakens that module's drafts. For the
same reason a vanilla prefill runs only the modules that the controller's choice at the coming
batch size uses (all K until measured); the others start behind by the prompt.

Draft trees (``tree_choices`` or ``"tree": "dynamic"``; tree_steps.py, docs/trees.md): a decode
step drafts a tree per sequence with the K modules (vanilla) or the one reused (eagle) and
verifies it whole; adaptive speculation chooses per batch size between tree steps and plain
steps (tree_choice.py).

Suffix drafts (``suffix_drafting``, ``"plugin_type": "mtp,suffix"``): a sequence whose suffix
drafts (plugins/suffix) promise more tokens than its MTP drafts verifies those instead, written
into its rows on the host. A step whose sequences all verify suffix drafts (or none) runs no
MTP draft step while module 0 may fall behind by it; the next step that drafts catches up (docs/mtp.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import statistics
from collections import deque

import numpy as np
import torch

from mindspec.config.plugin_params import PluginParamsError
from mindspec.modeling.forward_metadata import row_grid
from mindspec.modeling.hidden_cache import HiddenCacheRows, HiddenKeep
from mindspec.modeling.loader import checkpoint_keys
from mindspec.models.deepseekv2.config import DeepseekV2Config
from mindspec.models.deepseekv2.weights import mtp_modules_in
from mindspec.plugins.plugin import Plugin
from mindspec.plugins.suffix.sequence_drafts import SuffixDrafts, matched_prefix
from mindspec.text_generator.sampling.sampler import penalised_logits, processed_probs
from mindspec.text_generator.sampling.step_targets import samples_in_step
from mindspec.text_generator.step import StepBatch, StepInputs, StepOutputs, accepted_in_step, draft_grid

from . import async_fill
from . import decode_inputs as di
from . import decoding_policy as policy
from .adaptive import ROW_YIELD, AdaptiveSpeculation
from .hidden_history import HiddenHistory
from .tree_inputs import hidden_positions as tree_hidden_positions
from .params import MtpParams, parse_mtp_params
from .step_clock import StepClock
from .tree_choice import TreeOrPlain
from .tree_steps import TreeSteps

CATCH_UP = 32  # most MTP entries a module may lack: module 0 is then caught up, later ones give up the oldest
# Largest batch whose sequences draft from suffixes (above it, MTP drafts alone). On
# 2 cores, against eagle K=3 adaptive in the same runs: at batch 8 they pay (1.42x of MTP off
# against 1.28x); verified at 16 they cost more than they gave (1.14x against 1.23x), with this
# cap 16 is even (1.28x against 1.23x); benchmarks/README.md, "no draft step for suffix drafts alone".
SUFFIX_MAX_BATCH = 8


@dataclass
class MtpSeqState:
    slot: int  # the sequence's row of the hidden history
    hidden_end: int  # main hidden states are kept for the positions before this one (the last ``keep``)
    lag: list[int]  # [modules] tokens without an entry in each MTP module's cache (1 after prefill)
    in_think: bool = False
    hidden_from: int = 0  # first position with a real hidden state (> 0 after a PD hand-off or a shared prefix)
    # Every module's entries before this position were written (or came final from elsewhere):
    # later, a module more than CATCH_UP entries behind gave up entries (prefix caching reads it).
    complete_until: float = float("inf")


class MtpPlugin(Plugin):
    name = "mtp"

    @staticmethod
    def mtp_modules_needed(options: dict, model_dir: str) -> int:
        params = parse_mtp_params(options)
        cfg = DeepseekV2Config.from_model_dir(model_dir)
        available = min(cfg.num_nextn_predict_layers, mtp_modules_in(cfg, checkpoint_keys(model_dir)))
        return params.modules_needed(available)

    def __init__(self, generator, cache_config, **options):
        self.params: MtpParams = parse_mtp_params(options)
        self.generator = generator
        model = generator.model_wrapper.model
        self.k = self.params.num_speculative_tokens
        self.mode = self.params.resolved_mode(model.num_mtp_modules)
        self.modules = list(range(self.k)) if self.mode == "vanilla" else [0] * self.k
        self.block_size = cache_config.block_size
        self.dummy_block_id = cache_config.dummy_block_id
        self.suffix = self._suffix_drafts()
        self.suffix_seconds: deque = deque(maxlen=16)  # recent batch-1 steps of suffix drafts
        self.trees = self._tree_steps(generator)
        # the main model writes a draft position past the last token per draft verified
        self.num_lookahead_tokens = max(self.k, self.params.suffix_max_drafts if self.suffix else 0,
                                        self.trees.shape.lookahead if self.trees else 0)
        self.kv_context_tokens = self.k
        self.draft_positions = self.k if self.trees else self.num_lookahead_tokens  # a tree's depth is K
        self.keep_hidden = self.k + CATCH_UP  # vanilla's history (K-1) + the entries to catch up
        self.cache_modules = len(set(self.modules))  # MTP caches this plugin keeps: K (vanilla) or 1
        self.states: dict[int, MtpSeqState] = {}
        self.complete_prefill = False  # prefix caching: every prefill writes every MTP cache
        self.history = HiddenHistory(self.keep_hidden)
        # chains: draft counts per sequence; trees: tree or plain steps per batch size
        self.adaptive = AdaptiveSpeculation(range(self.k + 1), self.params.adaptive_speculation and not self.trees)
        self.tree_choice = TreeOrPlain(self.params.adaptive_speculation and self.trees is not None)
        self.clock = StepClock()  # what each decode step costs, for both controllers
        self._kept: dict[int, tuple[int, ...]] = {}  # _entries_kept per modules used
        self.simulation_rng = np.random.default_rng(0)  # simulated_acceptance's draws: the same every run
        # relaxed and typical acceptance read the target probabilities; strict needs the sampled tokens only
        self.needs_sampling_metadata = self.params.decoding_policy != "strict" and self.params.simulated_acceptance is None

    # ---- hooks ---------------------------------------------------------------------------------
    def model_inputs_update(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        self.clock.started(decode=not (batch.is_prefill or batch.is_mixed))  # step_clock.py
        if batch.is_prefill:
            inputs.extra["mtp_modules"] = self.modules[: self._prefill_modules(batch)]
            return inputs
        if batch.is_mixed:
            return self._mixed_inputs(batch, inputs)
        if self.trees:
            if self.tree_choice.tree_step(len(batch)):
                return self._tree_inputs(batch, inputs)
            return self._plain_inputs(batch, inputs)  # (tree_choice.py)
        kinds = _kinds(batch)
        counts = np.asarray(self.adaptive.draft_counts([s.seq_id for s in batch.seqs], kinds), dtype=np.int64)
        # A sequence left out of a drafting step would leave its entries unwritten for good; in a
        # plain bucket every sequence gives up all but a steady step's (_entries_kept).
        if self.adaptive.planned(len(batch)) > 0:
            behind = np.array([self.states[s.seq_id].lag[0] >= CATCH_UP for s in batch.seqs])
            if behind.any():
                counts[behind] = np.maximum(counts[behind], min(a for a in self.adaptive.arms if a))
        host_drafts = self._suffix_choice(batch, inputs, kinds, counts) if self.suffix else {}
        if not host_drafts and not counts.any():
            return self._plain_inputs(batch, inputs)
        mtp = np.ones(len(counts), dtype=bool)
        for b, drafts in host_drafts.items():
            counts[b], mtp[b] = len(drafts), False
        # The MTP draft steps run as far as the most MTP drafts verified (none when only suffix
        # drafts are, while module 0 may fall behind by the step: _suffix_draft_steps).
        k = max(int(counts[mtp].max()) if mtp.any() else 0, self._suffix_draft_steps(batch, counts, host_drafts))
        inputs.extra["mtp_k"] = k
        if k == 0:
            return self._suffix_inputs(batch, inputs, counts, host_drafts)
        inputs = self._speculative_inputs(batch, inputs, self._window(batch.seqs, k), k, counts, host_drafts)
        inputs.extra["hidden_cache"] = self._hidden_cache(batch, inputs)
        return inputs

    def _plain_inputs(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        """A plain decode step: the base inputs as composed. On one rank the step itself keeps
        each sequence's hidden state in the history (``keep_hidden``; else ``_plain_done``
        writes it after the step)."""
        inputs.extra["mtp_k"] = 0
        if self.generator.dp_size == 1 and bool((inputs.model_inputs.q_lens == 1).all()):
            states = [self.states[s.seq_id] for s in batch.seqs]
            rows = self.history.rows_of([st.slot for st in states], [st.hidden_end for st in states])
            inputs.extra["keep_hidden"] = HiddenKeep(self.history.buf, rows)
        return inputs

    def _mixed_inputs(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        """SplitFuse: a plain forward over decode rows and prefill chunks, then every MTP module
        over all rows, as a prefill does. A chunk's last entries pair its last positions with
        the prompt tokens after it (``mtp_next_tokens``); where those are not known yet (a final
        chunk, a decode row) the module's own draft stands in, and the first decode after it
        writes the entry again (lag). Decode rows draft nothing this step."""
        modules = self.modules[: self.cache_modules]  # vanilla: every module; eagle: its one
        inputs.extra["mtp_k"] = 0
        inputs.extra["mtp_modules"] = modules
        nxt = np.full((len(batch), len(modules)), -1, dtype=np.int64)
        for b, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
            if chunk:
                end = seq.num_cached_tokens + chunk
                known = seq.tokens_from(end)[: len(modules)]
                nxt[b, : len(known)] = known
        inputs.extra["mtp_next_tokens"] = nxt
        return inputs

    def prepare_masks_for_filling(self, batch: StepBatch, inputs: StepInputs, pending: np.ndarray) -> StepInputs:
        """Async scheduling (speculation on every step): a sequence still in the running step is
        laid out as if that step accepted all pending[b] tokens; fill_in_model_result moves it
        back by what was rejected. Hidden states are gathered at fill time, when they exist."""
        if batch.is_prefill:
            return self.model_inputs_update(batch, inputs)
        self.clock.started(decode=not batch.is_mixed)
        if self.trees:  # a tree step's window follows what the running step accepts: built at fill time
            inputs.extra["tree_deferred"] = True
            return inputs
        inputs.extra["mtp_k"] = self.k
        # A sequence whose prefill is still running has no state yet: its pending count is its window.
        # Otherwise K drafts use every module, so the window is the deepest module's lag (_window).
        last_accepted = np.array([n if n else self.states[s.seq_id].lag[-1] for s, n in zip(batch.seqs, pending)],
                                 dtype=np.int64)
        return self._speculative_inputs(batch, inputs, last_accepted, self.k, np.full(len(batch), self.k))

    def fill_in_model_result(self, batch: StepBatch, inputs: StepInputs, pending: np.ndarray,
                             accepted: list[list[int]]) -> None:
        if batch.is_prefill:
            return
        if inputs.extra.pop("tree_deferred", False):  # the views hold the real tokens now
            self._tree_inputs(batch, inputs)
            return
        layout = async_fill.fill(inputs, pending, accepted, self.k, self.mode)
        inputs.extra["mtp_layout"] = layout
        if self.suffix:
            self._fill_suffix_drafts(batch, inputs)
        inputs.extra["hidden_cache"] = self._hidden_cache(batch, inputs)  # the states the running step kept

    def _fill_suffix_drafts(self, batch: StepBatch, inputs: StepInputs) -> None:
        """Async scheduling: suffix drafts follow the previous step's tokens, known only now (the
        views hold them); sequences whose suffix drafts promise more than their K MTP drafts
        verify those, in main rows laid out again (the draft steps stay as prepared)."""
        counts = inputs.extra["mtp_counts"].copy()
        host_drafts = self._suffix_choice(batch, inputs, _kinds(batch), counts)
        if not host_drafts:
            return
        for b, drafts in host_drafts.items():
            counts[b] = len(drafts)
        inputs.model_inputs = self._main_inputs(batch.seqs, counts, host_drafts)
        inputs.q_lens = inputs.model_inputs.q_lens
        inputs.extra["mtp_counts"] = counts
        inputs.extra["host_drafts"] = host_drafts

    def _speculative_inputs(self, batch: StepBatch, inputs: StepInputs, last_accepted: np.ndarray, k: int,
                            counts: np.ndarray, host_drafts: Optional[dict[int, list[int]]] = None) -> StepInputs:
        """A step that drafts k tokens per sequence; sequence b verifies the first counts[b] <= k,
        or, in ``host_drafts``, its counts[b] suffix drafts."""
        seqs = batch.seqs
        num_tokens = np.array([s.num_tokens for s in seqs], dtype=np.int64)
        tables = inputs.model_inputs.block_tables  # as composed: every sequence's blocks
        # A sequence whose prefill is still running has no state yet: it was prefilled here.
        hidden_from = np.array([getattr(self.states.get(s.seq_id), "hidden_from", 0) for s in seqs], dtype=np.int64)
        layout = di.decode_layout(num_tokens, last_accepted, k, self.mode, hidden_from)
        inputs.model_inputs = di.main_inputs(
            np.array([s.last_token_id for s in seqs]), num_tokens, tables, self.block_size, counts, host_drafts
        )
        inputs.sub_model_inputs = di.sub_inputs(
            di.window_tokens(seqs, layout), layout, tables, self.block_size, k, self.mode,
            hidden_from, self.dummy_block_id,
        )
        inputs.q_lens = inputs.model_inputs.q_lens
        inputs.extra["mtp_modules"] = self.modules[:k]
        inputs.extra["mtp_layout"] = layout
        inputs.extra["mtp_counts"] = np.asarray(counts, dtype=np.int64)
        inputs.extra["host_drafts"] = host_drafts or None
        return inputs

    def _suffix_inputs(self, batch: StepBatch, inputs: StepInputs, counts: np.ndarray,
                       host_drafts: dict[int, list[int]]) -> StepInputs:
        """A step without MTP draft steps: the main model verifies the suffix drafts (written into
        their rows) in a plain forward, every row an lm_head row; the others feed their token."""
        seqs = batch.seqs
        model_inputs = self._main_inputs(seqs, counts, host_drafts)
        model_inputs.drafts_in_inputs = None  # no MTP drafts to place: any row's token is its input
        inputs.model_inputs, inputs.q_lens = model_inputs, model_inputs.q_lens
        inputs.extra["mtp_counts"] = np.asarray(counts, dtype=np.int64)
        inputs.extra["host_drafts"] = host_drafts
        inputs.extra["draft_prefix"] = draft_grid([host_drafts.get(b, []) for b in range(len(seqs))])
        return inputs

    def _main_inputs(self, seqs, counts: np.ndarray, host_drafts: Optional[dict[int, list[int]]]):
        """The verification rows (decode_inputs.main_inputs) of the sequences as they are now."""
        return di.main_inputs(np.array([s.last_token_id for s in seqs]),
                              np.array([s.num_tokens for s in seqs], dtype=np.int64),
                              di.block_tables([s.block_table for s in seqs]), self.block_size, counts, host_drafts)

    def _tree_inputs(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        """Every decode step verifies a whole tree; its window is the one a K-draft chain step has."""
        seqs = batch.seqs
        hidden_from = np.array([self.states[s.seq_id].hidden_from for s in seqs], dtype=np.int64)
        inputs, layout = self.trees.inputs(batch, inputs, self._window(seqs, self.k), hidden_from)
        inputs.extra["mtp_k"] = self.k
        inputs.extra["mtp_layout"] = layout
        seq_idx, positions = tree_hidden_positions(layout)
        slots = np.array([self.states[s.seq_id].slot for s in seqs], dtype=np.int64)
        inputs.hidden_states = self.history.read(slots[seq_idx], positions)
        return inputs

    def forward(self, batch: StepBatch, inputs: StepInputs, generator):
        if "tree_steps" in inputs.extra:
            return self.trees.forward(inputs, generator, inputs.hidden_states)
        if not self._speculating(batch, inputs):
            return generator.forward(inputs.model_inputs, mtp_modules=inputs.extra.get("mtp_modules"),
                                     mtp_next_tokens=inputs.extra.get("mtp_next_tokens"),
                                     targets=inputs.extra.get("targets"), keep=inputs.extra.get("keep_hidden"))
        return generator.forward(
            inputs.model_inputs,
            sub_model_inputs=inputs.sub_model_inputs,
            q_lens=inputs.q_lens,
            mtp_modules=inputs.extra["mtp_modules"],
            draft_logits=inputs.extra.get("draft_logits"),  # structured output's masks
            hidden_cache=inputs.extra["hidden_cache"],
        )

    def sample_preprocess(self, batch: StepBatch, inputs: StepInputs) -> StepInputs:
        if "tree" in inputs.extra:
            history = self.needs_sampling_metadata or not all(s.sampling_params.plain_greedy for s in batch.seqs)
            return self.trees.sample_rows(inputs, batch, history)
        if self._verifying(batch, inputs):  # one sampling row per verified position
            counts = inputs.extra["mtp_counts"]
            inputs.row_seq, inputs.row_offset = row_grid(counts + 1)
        return inputs

    def plugin_verify(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> StepOutputs:
        if "tree" in inputs.extra:
            in_think = np.array([self.states[s.seq_id].in_think for s in batch.seqs])
            return self.trees.verify(inputs, outputs, self.params, in_think)
        if not self._verifying(batch, inputs):
            return outputs
        counts = inputs.extra["mtp_counts"]
        width = max(self._drafts(batch, inputs), int(counts.max()))  # suffix drafts may outnumber MTP's
        grid = di.verify_grid(counts, width)  # [B, width + 1] rows, a sequence's last repeated
        drafts = outputs.drafts_host() if self._speculating(batch, inputs) else inputs.extra["draft_prefix"]
        targets = outputs.sampled[grid]
        if accepted_in_step(inputs, outputs):  # the step accepted (strict) and kept the hidden states itself
            accepted = np.asarray(outputs.accepted_host(), dtype=np.int64)
        else:
            accepted = np.minimum(self._accept(batch, inputs, outputs, drafts, targets, grid), counts)
        outputs.accepted = policy.emitted_tokens(drafts, targets, accepted)
        outputs.accepted_rows = [list(range(g[0], g[0] + c + 1)) for g, c in zip(grid.tolist(), accepted.tolist())]
        outputs.num_draft_accepted = accepted.tolist()
        outputs.num_drafts = counts.tolist()
        return outputs

    def plugin_cache_update(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> None:
        hidden = outputs.hidden_states
        if batch.is_prefill:
            self._prefilled(batch, inputs, hidden)
            return
        if batch.is_mixed:
            self._mixed_done(batch, inputs, outputs)
            return
        if "tree" in inputs.extra:
            self._tree_done(batch, inputs, outputs)
            return
        k = self._drafts(batch, inputs)
        speculated, verified = k > 0, self._verifying(batch, inputs)
        lens = [len(a) for a in outputs.accepted]
        if not speculated and not verified and lens.count(1) == len(lens):
            self._plain_done(batch, inputs, outputs)
            return
        used = self._modules_used(k)
        counts = np.array(lens, dtype=np.int64)
        states = [self.states[seq.seq_id] for seq in batch.seqs]
        rows = inputs.extra["mtp_counts"] + 1 if verified else np.ones(len(states), dtype=np.int64)
        # Sequence b's accepted rows first_row[b] + 0..count-1 hold positions n-1 .. n-2+count
        # (kept by the step itself where it accepted).
        if not accepted_in_step(inputs, outputs):
            self.history.write(np.array([st.slot for st in states], dtype=np.int64),
                               np.array([st.hidden_end for st in states], dtype=np.int64), counts,
                               hidden, np.cumsum(rows) - rows)
        lag0 = np.array([st.lag[0] for st in states], dtype=np.int64) if speculated else None  # before this step
        self._advance(states, counts.tolist(), used, outputs.accepted)
        # Module 0 behind by more than a speculative step leaves it (K+1): plain steps came before.
        caught_up = speculated and bool((lag0 > self.k + 1).any())
        drafted = inputs.extra["mtp_counts"] if verified else np.zeros(len(states), dtype=np.int64)
        accepted = np.asarray(outputs.num_draft_accepted if verified else drafted, dtype=np.int64)
        arm_timed = True
        if self.suffix:
            drafted, accepted, arm_timed = self._suffix_step_done(batch, inputs, outputs, drafted, accepted)
        self.adaptive.record([seq.seq_id for seq in batch.seqs], drafted, accepted)
        k = int(drafted.max()) if len(drafted) else 0
        suffix_step = len(states) == 1 and bool(inputs.extra.get("host_drafts"))
        self.clock.ended(lambda seconds: self._step_timed(seconds, len(states), k, int(counts.sum()), caught_up,
                                                          arm_timed, suffix_step))

    def _plain_done(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> None:
        """After a decode step without drafts, each sequence's one row: the hidden state of its
        newest position into the history (unless the step kept it), and every module one entry
        further behind. The general
        path's per-step arrays (rows, counts, catch-ups) are all ones or zeros here, and a plain
        step runs at ~1 ms at batch 1 (compiled, cpu): what it adds is what MTP costs over MTP off
        where no draft count pays."""
        states = [self.states[seq.seq_id] for seq in batch.seqs]
        if "keep_hidden" not in inputs.extra:  # (kept by the step itself: _plain_inputs)
            self.history.write_rows([st.slot for st in states], [st.hidden_end for st in states], outputs.hidden_states)
        self._advance(states, [1] * len(states), 0, outputs.accepted)
        if self.suffix:  # proposals not verified are scored against the tokens emitted
            self._record_suffix(batch, inputs.extra.get("suffix_proposals", {}), {}, outputs)
        none = np.zeros(len(states), dtype=np.int64)
        self.adaptive.record([seq.seq_id for seq in batch.seqs], none, none)
        self.clock.ended(lambda seconds: self._step_timed(seconds, len(states), 0, len(states), False, True, False))

    def _advance(self, states: list[MtpSeqState], counts: list[int], used: int, accepted: list[list[int]]) -> None:
        """Each sequence's state after a decode step that accepted counts[b] tokens (accepted[b]):
        the modules this step ran (the first ``used``) wrote the entries of the tokens before
        them, the others fell behind by them."""
        keep = self._entries_kept(len(states))
        for state, count, tokens in zip(states, counts, accepted):
            self._lag_behind(state, count, used, keep)
            state.hidden_end += count
            self._follow_think(state, tokens)

    def _step_timed(self, seconds: Optional[float], batch_size: int, k: int, tokens: int, caught_up: bool,
                    arm_timed: bool, suffix_step: bool) -> None:
        """A decode step's time, delivered when the next step begins (step_clock.py). A step that
        caught up MTP entries plain steps skipped is no sample of its arm (adaptive.py)."""
        steady = None if caught_up else seconds
        if self.trees:  # a plain step of tree_choice.py
            self.tree_choice.record(batch_size, False, tokens, steady)
        if suffix_step and seconds is not None:
            self.suffix_seconds.append(seconds)
        self.adaptive.time_step(batch_size, k, steady if arm_timed else None)

    def _tree_done(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> None:
        """After a tree step: the accepted path's KV into place, its hidden states kept."""
        self.trees.compact(inputs, self.generator.model_wrapper)
        rows = np.concatenate([np.asarray(r, dtype=np.int64) for r in outputs.accepted_rows])
        counts = np.array([len(a) for a in outputs.accepted], dtype=np.int64)
        hidden = outputs.hidden_states.index_select(0, torch.from_numpy(rows).to(outputs.hidden_states.device))
        states = [self.states[seq.seq_id] for seq in batch.seqs]
        self.history.write(np.array([st.slot for st in states], dtype=np.int64),
                           np.array([st.hidden_end for st in states], dtype=np.int64), counts,
                           hidden, np.cumsum(counts) - counts)
        self._advance(states, counts.tolist(), self.cache_modules, outputs.accepted)  # every module ran
        caught_up = int(inputs.extra["mtp_layout"].last_accepted.max()) > self.k + 1  # plain steps came before
        tokens = int(counts.sum())
        self.clock.ended(lambda seconds: self.tree_choice.record(len(states), True, tokens, None if caught_up else seconds))

    def _prefilled(self, batch: StepBatch, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """New states for a prefill's sequences; their last ``keep`` hidden states kept."""
        q_lens = inputs.model_inputs.q_lens.astype(np.int64)
        keeps = np.minimum(q_lens, self.keep_hidden)
        prefilled = len(inputs.extra["mtp_modules"])
        ends = np.array([seq.num_cached_tokens for seq in batch.seqs], dtype=np.int64) + q_lens
        slots = np.empty(len(batch.seqs), dtype=np.int64)
        keep = self._entries_kept(len(self.states) + len(batch.seqs))  # at the batch size _prefill_modules judged by
        for b, (seq, q, end) in enumerate(zip(batch.seqs, q_lens.tolist(), ends.tolist())):
            lag = self._fresh_lag()
            lag[prefilled:] = [min(q, c) for c in keep[prefilled:]]  # this prefill's entries, as far as its hidden states reach
            gave_up = any(q > c for c in keep[prefilled:])
            slots[b] = self.history.add(seq.seq_id, hidden)
            # A prefill after a shared prompt prefix (n > 1) starts past position 0: the hidden
            # states before it are another sequence's, and its MTP entries there are shared blocks
            # it must not rewrite; as after a PD hand-off, rows before hidden_from go to the dummy block.
            self.states[seq.seq_id] = MtpSeqState(
                slot=int(slots[b]), hidden_end=end, lag=lag, in_think=self._prompt_in_think(seq.token_ids),
                hidden_from=seq.num_cached_tokens,
                complete_until=seq.num_cached_tokens if gave_up else float("inf"),
            )
        self.history.write(slots, ends - keeps, keeps, hidden, np.cumsum(q_lens) - keeps)  # each prompt's last rows

    def _mixed_done(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs) -> None:
        """After a SplitFuse step: a decode row is a plain step for its sequence (every module's
        lag grows by its token); a chunk starts or extends its sequence's state. The step is not
        timed for adaptive speculation (its time is mostly the chunks')."""
        q_lens = inputs.model_inputs.q_lens.astype(np.int64)
        first_rows = np.cumsum(q_lens) - q_lens
        ends = batch.prefill_ends()
        slots, starts, keeps = [], [], []
        for b, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
            state = self.states.get(seq.seq_id)
            if not chunk:
                slots.append(state.slot)
                starts.append(state.hidden_end)
                keeps.append(1)
                self._lag_behind(state, 1, used=0)
                state.hidden_end += 1
                self._follow_think(state, outputs.accepted[b])
                continue
            # its first chunk (after any cached or shared prefix), or the first of a recompute
            # after a preemption, whose old state ended elsewhere
            if state is None or state.hidden_end != seq.num_cached_tokens:
                state = self.states[seq.seq_id] = MtpSeqState(
                    slot=self.history.add(seq.seq_id, outputs.hidden_states), hidden_end=seq.num_cached_tokens,
                    lag=self._fresh_lag(), in_think=False, hidden_from=seq.num_cached_tokens)
            keep = min(chunk, self.keep_hidden)
            slots.append(state.slot)
            starts.append(seq.num_cached_tokens + chunk - keep)
            keeps.append(keep)
            first_rows[b] += chunk - keep
            state.hidden_end = seq.num_cached_tokens + chunk
            # every module ran over the chunk: entries are missing only where a draft stood in
            state.lag = self._fresh_lag() if ends[b] else [0] * self.cache_modules
            if ends[b]:
                state.in_think = self._prompt_in_think(seq.token_ids)
        self.history.write(np.array(slots, dtype=np.int64), np.array(starts, dtype=np.int64),
                           np.array(keeps, dtype=np.int64), outputs.hidden_states, first_rows)

    def _follow_think(self, state: MtpSeqState, accepted: list[int]) -> None:
        """Whether the sequence is inside a thinking span after its accepted tokens (relaxed)."""
        if self.params.think_start_token_id is not None:
            state.in_think = bool(policy.update_think_state(
                np.array([state.in_think]), [accepted], self.params.think_start_token_id,
                self.params.think_end_token_id)[0])

    def _entries_kept(self, batch_size: int) -> tuple[int, ...]:
        """[modules] most missed entries each module keeps to catch up. A module the draft count
        chosen at this batch size does not use (every module in a plain bucket, where no count
        pays) keeps only those a steady step of K drafts writes, so a step that uses it again (a
        try of another count) has a steady step's shape: a catch-up's shape runs eagerly on cpu
        (15-40 ms at batch 1 against a ~1 ms plain step)."""
        used = self._modules_used(self.adaptive.planned(batch_size))
        keep = self._kept.get(used)
        if keep is None:
            keep = self._kept[used] = (CATCH_UP,) * used + (self.k + 1,) * (self.cache_modules - used)
        return keep

    def _lag_behind(self, state: MtpSeqState, count: int, used: int, keep=CATCH_UP) -> None:
        """The modules from ``used`` on wrote none of the ``count`` new tokens' entries; module m
        keeps at most ``keep`` (or keep[m]) missed entries to catch up (the oldest are given up).
        Python lists: a lag has one entry per module, and every decode step updates every
        sequence's (numpy's per-call cost would be most of a plain step's bookkeeping)."""
        lag = state.lag
        caps = keep[used:] if isinstance(keep, tuple) else (keep,) * (len(lag) - used)
        missed = [x + count for x in lag[used:]]
        if any(m > c for m, c in zip(missed, caps)):  # the oldest missed entries are given up
            state.complete_until = min(state.complete_until, state.hidden_end - 1 - max(lag))
        state.lag = [count] * used + [min(m, c) for m, c in zip(missed, caps)]

    def adopt_prefilled(self, seq, hidden_size: int, dtype: torch.dtype, device) -> None:
        """A sequence prefilled on another node (PD disaggregation): its KV arrived, its hidden
        states did not. Zeros stand in for the one hidden state the first decode needs, and rows
        fed from it write to the dummy block (see decode_inputs.sub_inputs)."""
        n_prompt = seq.num_prompt_tokens
        zeros = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        slot = self.history.add(seq.seq_id, zeros)
        self.history.write(np.array([slot]), np.array([n_prompt - 1]), np.ones(1, dtype=np.int64), zeros, np.zeros(1, dtype=np.int64))
        self.states[seq.seq_id] = MtpSeqState(
            slot=slot, hidden_end=n_prompt,
            lag=self._fresh_lag(), in_think=self._prompt_in_think(seq.prompt_token_ids), hidden_from=n_prompt,
        )

    def plugin_cache_clear(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.states.pop(seq_id, None)
            self.history.remove(seq_id)
        self.adaptive.finish(seq_ids)
        if self.suffix:
            self.suffix.clear(seq_ids)

    # ---- helpers -------------------------------------------------------------------------------
    def _tree_steps(self, generator) -> Optional[TreeSteps]:
        shape = self.params.tree_shape()
        if shape is None:
            return None
        return TreeSteps(shape, self.mode == "eagle", self.block_size, self.dummy_block_id)

    def _suffix_drafts(self) -> Optional[SuffixDrafts]:
        p = self.params
        if not p.suffix_drafting:
            return None
        return SuffixDrafts(p.suffix_max_drafts, p.suffix_min_match)

    def _suffix_choice(self, batch: StepBatch, inputs: StepInputs, kinds: list[str],
                       counts: np.ndarray) -> dict[int, list[int]]:
        """{b: suffix drafts} for the sequences whose suffix drafts promise more tokens this step
        than their counts[b] MTP drafts, each cut to the drafts worth a verification row. In a
        batch, where rows cost compute, each row is charged ROW_YIELD tokens (the yield at
        which a row pays); at batch 1 the two steps' measured times are weighed instead. Every
        sequence's proposal is kept (``suffix_proposals``) to be scored against what it emits.
        Above SUFFIX_MAX_BATCH nothing is drafted (the automata catch up when the batch shrinks)."""
        seqs = batch.seqs
        proposals = {}
        inputs.extra["suffix_proposals"] = proposals
        if len(seqs) > SUFFIX_MAX_BATCH:
            return {}
        for b, seq in enumerate(seqs):
            drafts = self.suffix.draft(seq)  # also brings the sequence's automaton up to date
            if drafts:
                proposals[b] = drafts
        if not proposals:
            return {}
        row_cost = ROW_YIELD if len(seqs) > 1 else 0.0
        mtp_value = self.adaptive.expected([s.seq_id for s in seqs], kinds, counts)  # [B] tokens
        mtp_value = mtp_value * self._suffix_step_cost(len(seqs), counts) - row_cost * counts
        chosen = {}
        for b, drafts in proposals.items():
            seq_id = seqs[b].seq_id
            n = self.suffix.useful(seq_id, drafts, ROW_YIELD)
            if n and self.suffix.expected(seq_id, n) - row_cost * n > mtp_value[b]:
                chosen[b] = drafts[:n]
        return chosen

    def _suffix_draft_steps(self, batch: StepBatch, counts: np.ndarray, host_drafts: dict[int, list[int]]) -> int:
        """MTP draft steps a step needs for its suffix drafts alone: none while every sequence's
        module 0 can fall behind by this step's tokens and stay within CATCH_UP (the next step
        that drafts writes the missed entries); else one, which catches module 0 up."""
        if not host_drafts:
            return 0
        lag = np.array([self.states[s.seq_id].lag[0] for s in batch.seqs], dtype=np.int64)
        return 0 if (lag + counts + 1 <= CATCH_UP).all() else 1

    def _suffix_step_cost(self, batch_size: int, counts: np.ndarray) -> float:
        """A step of suffix drafts against the step of MTP drafts it replaces, by their measured
        times: at batch 1 it runs no MTP draft step, or one, not counts[0], so it may yield fewer
        tokens and still pay (until three are timed, a one-draft step's time stands in for it). At
        larger batches other sequences set the step's MTP drafts, and without a clock: 1."""
        if batch_size != 1 or not self.adaptive.enabled:  # dp > 1: every rank must choose alike, by no clock
            return 1.0
        suffix = statistics.median(self.suffix_seconds) if len(self.suffix_seconds) >= 3 \
            else self.adaptive.step_seconds(1, 1)
        mtp = self.adaptive.step_seconds(1, int(counts[0]))
        return suffix / mtp if suffix > 0 and mtp > 0 else 1.0

    def _suffix_step_done(self, batch: StepBatch, inputs: StepInputs, outputs: StepOutputs, drafted: np.ndarray,
                          accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """The suffix estimates learn from the step; what the MTP controller then records:
        suffix drafts are no evidence of MTP acceptance. The step's time counts for the MTP arm
        whose draft steps it ran (suffix rows included: in a batch where suffix drafts are
        common they are part of every step's cost, and an arm never timed would be explored
        for good), not when only suffix drafts set how far it drafted: -> (drafted, accepted,
        whether the step's time counts for its MTP arm)."""
        host_drafts = inputs.extra.get("host_drafts") or {}
        self._record_suffix(batch, inputs.extra.get("suffix_proposals", {}), host_drafts, outputs)
        if not host_drafts:
            return drafted, accepted, True
        drafted, accepted = drafted.copy(), accepted.copy()
        for b in host_drafts:
            drafted[b] = accepted[b] = 0
        k = inputs.extra["mtp_k"]
        return drafted, accepted, bool(k) and int(drafted.max()) == k

    def _record_suffix(self, batch: StepBatch, proposals: dict[int, list[int]], verified: dict[int, list[int]],
                       outputs: StepOutputs) -> None:
        """Each sequence's suffix estimate learns from every step it had a proposal: drafts it
        verified count as the policy kept them; a proposal not verified is scored against the
        tokens the step emitted (its first len(emitted) drafts can be judged), so a sequence
        whose text repeats is seen to repeat while MTP drafts it."""
        for b, drafts in proposals.items():
            seq_id = batch.seqs[b].seq_id
            if b in verified:
                self.suffix.record(seq_id, len(verified[b]), int(outputs.num_draft_accepted[b]))
                continue
            emitted = outputs.accepted[b]
            self.suffix.record(seq_id, min(len(drafts), len(emitted)), matched_prefix(drafts, emitted))

    def _drafts(self, batch: StepBatch, inputs: StepInputs) -> int:
        """Drafts this step verifies per sequence (0: prefill or a plain step)."""
        return 0 if batch.is_prefill else inputs.extra.get("mtp_k", self.k)

    def _modules_used(self, k: int) -> int:
        """MTP caches a step with k drafts writes: vanilla's modules 0..k-1, eagle's one module."""
        return min(k, self.cache_modules)

    def _prefill_modules(self, batch: StepBatch) -> int:
        """MTP modules a prefill runs: those the next decode steps will use, judged by the batch
        size they will run at (every tracked sequence plus these), at least module 0; all of them
        with prefix caching, whose cached blocks serve later sequences at any batch size."""
        if self.complete_prefill:
            return self.cache_modules
        return max(1, self._modules_used(self.adaptive.planned(len(self.states) + len(batch))))

    # ---- prefix caching ---------------------------------------------------------------------------
    def enable_prefix_caching(self) -> None:
        self.complete_prefill = True

    def final_cache_positions(self, seq, finished: bool = False) -> Optional[int]:
        """Positions before the entries a coming step may still write: each module's missing
        entries (lag), vanilla's rewritten history (K-1) and, under async scheduling, the steps
        already built (up to K+1 tokens each); 3(K+1) covers them all. Nothing past a gap.
        At the sequence's end only a step already built may still write (3(K+1) back): entries
        still missing then, or given up, stay missing, and the blocks are cached anyway, since
        their main KV is what a later prompt cannot do without; a missing MTP entry only weakens
        the drafts near it (verification keeps the output the same)."""
        state = self.states.get(seq.seq_id)
        if state is None:
            return 0
        end = state.hidden_end - 3 * (self.k + 1)
        if finished:
            return max(0, end)
        return max(0, int(min(end - max(state.lag), state.complete_until)))

    def _fresh_lag(self) -> list[int]:
        return [1] * self.cache_modules  # the prompt's entries; the new token's is missing

    def _window(self, seqs, k: int) -> np.ndarray:
        """[B] entries a step with k drafts writes per sequence: the lag of the deepest module it
        uses (lags never decrease with depth, so the shallower modules' entries are rewritten)."""
        deepest = self._modules_used(k) - 1
        return np.array([self.states[s.seq_id].lag[deepest] for s in seqs], dtype=np.int64)

    def _speculating(self, batch: StepBatch, inputs: StepInputs) -> bool:
        """The step runs MTP draft steps."""
        return self._drafts(batch, inputs) > 0

    def _verifying(self, batch: StepBatch, inputs: StepInputs) -> bool:
        """The step verifies drafts: MTP's, or suffix drafts alone (without draft steps)."""
        return not batch.is_prefill and "mtp_counts" in inputs.extra

    def _hidden_cache(self, batch: StepBatch, inputs: StepInputs) -> HiddenCacheRows:
        """The hidden history's rows a speculative step reads itself (each window row's main
        hidden state; padding rows the zero row) and, where it accepts itself (strict
        verification, every sequence plain greedy or sampling with temperature, top-k, top-p and
        a seed only, no host drafts, one dp rank: a dp step gathers its shards' states on the
        host), the rows of each sequence's verified positions n-1 .. n-1+k. The plugin manager
        adds how each row samples (``targets``)."""
        layout: di.DecodeLayout = inputs.extra["mtp_layout"]
        seq_idx, positions, valid = di.hidden_rows(layout)
        states = [self.states[seq.seq_id] for seq in batch.seqs]
        slots = np.array([st.slot for st in states], dtype=np.int64)
        k = inputs.extra["mtp_k"]
        accepts = (self.params.decoding_policy == "strict" and self.params.simulated_acceptance is None
                   and not inputs.extra.get("host_drafts") and self.generator.dp_size == 1
                   and all(samples_in_step(s.sampling_params) for s in batch.seqs))
        keep = np.zeros((len(slots), k + 1), dtype=np.int64)  # all 0: acceptance on the host
        if accepts:
            ends = np.array([st.hidden_end for st in states], dtype=np.int64)
            keep = self.history.rows(slots[:, None], ends[:, None] + np.arange(k + 1))
        return HiddenCacheRows(self.history.buf, self.history.rows(slots[seq_idx], positions, valid),
                               inputs.extra["mtp_counts"], keep)

    def _accept(self, batch, inputs, outputs, drafts, targets, grid) -> np.ndarray:
        """Drafts kept per sequence [B] by the decoding policy, from the target rows ``grid``
        [B, k + 1] (the caller caps each at the drafts the sequence verified)."""
        p = self.params
        if p.simulated_acceptance is not None:
            return policy.simulated_accept(np.array(p.simulated_acceptance[: drafts.shape[1]]), self.simulation_rng,
                                           len(drafts))
        if p.decoding_policy == "strict":
            return policy.strict_accept(drafts, targets)
        md = inputs.extra["sampling_metadata"]
        if p.decoding_policy == "relaxed":
            probs = _on_grid(torch.softmax(penalised_logits(outputs.logits, md), dim=-1), grid)
            delta = np.array([p.relaxed_delta if self.states[s.seq_id].in_think else 0.0 for s in batch.seqs])
            return policy.relaxed_accept(drafts, targets, probs, p.relaxed_topk, delta)
        probs = _on_grid(processed_probs(outputs.logits, md), grid)
        return policy.typical_accept(drafts, targets, probs, p.posterior_threshold, p.posterior_alpha)

    def _prompt_in_think(self, token_ids: list[int]) -> bool:
        p = self.params
        if p.think_start_token_id is None:
            return False
        return bool(policy.update_think_state(np.array([False]), [token_ids], p.think_start_token_id, p.think_end_token_id)[0])


def _on_grid(probs: torch.Tensor, grid: np.ndarray) -> torch.Tensor:
    """[rows, V] -> [B, k + 1, V] on the host: the rows of each sequence's verified positions."""
    index = torch.tensor(grid.reshape(-1), device=probs.device)  # (grid: shared, read-only)
    return probs.index_select(0, index).view(*grid.shape, -1).cpu()


def _kinds(batch: StepBatch) -> list[str]:
    return ["greedy" if _greedy(s.sampling_params) else "sampled" for s in batch.seqs]


def _greedy(params) -> bool:
    return params is None or not params.temperature
