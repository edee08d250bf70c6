"""LLMEngine: requests in, tokens and text out, one scheduler step at a time.

    add_request -> Sequence -> Scheduler (admission, batching, blocks)
    step: schedule -> PluginManager.generate_token -> Scheduler.postprocess (stops, frees blocks)
          -> detokenize -> RequestOutputs
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Optional, Sequence as Seq, Union

import torch

from mindspec.config.plugin_params import PluginParams, parse_plugin_params
from mindspec.modeling.loader import checkpoint_keys
from mindspec.modeling.model_path import is_gguf
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.modeling.step_accounting import account_decode_steps
from mindspec.plugins.plugin import load_plugin, plugin_class
from mindspec.plugins.structured_output import structured_output_plugin as structured_output
from mindspec.plugins.structured_output.structured_output_plugin import StructuredOutputPlugin
from mindspec.text_generator.detokenizer import IncrementalDetokenizer
from mindspec.text_generator.generator import Generator
from mindspec.text_generator.plugin_manager import PluginManager
from mindspec.text_generator.sampling.params import SamplingParams
from mindspec.text_generator.step import StepBatch, StepOutputs
from mindspec.text_generator.stop_strings import StopStringMatcher
from mindspec.text_generator.tokenizer import Tokenizer, TokenizerError, load_tokenizer

from .args import GiB, EngineArgs
from .async_scheduling import AsyncStepper
from .block_manager import BlockManager
from .errors import EngineError, RequestRejected
from .outputs import PrefillHandoff, RequestOutput, SpecDecodeStats
from .prefix_cache import PrefixCache
from .request_state import RequestState
from .scheduler import ScheduledBatch, Scheduler, SeqUpdate
from .sequence import FinishReason, Sequence

logger = logging.getLogger(__name__)
# After the warm-up, with compile workers: the steps a shape without a package runs eagerly before
# a worker compiles it. A batch's steady shape passes it in a fraction of a second; a catch-up
# step's row count or a batch size met in passing may never, and costs no compile.
EXPORT_AFTER_STEPS = 16

Prompt = Union[str, list[int]]


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        plugin_params = _without_missing_gguf_mtp(parse_plugin_params(args.plugin_params), args.model)
        # structured output's options are its own; every other plugin reads the rest
        options = {k: v for k, v in plugin_params.options.items() if k not in structured_output.OPTION_KEYS}
        plugin_classes = [plugin_class(name) for name in plugin_params.plugin_types]
        num_mtp = max((c.mtp_modules_needed(options, args.model) for c in plugin_classes
                       if hasattr(c, "mtp_modules_needed")), default=0)
        self.model_wrapper = ModelWrapper(
            args.model, args.backend, args.resolved_dtype(args.backend), num_mtp_modules=num_mtp,
            device=args.device, progress=args.progress, decode_graphs=args.decode_graphs,
            compile_workers=args.compile_workers,
        )
        self.tokenizer = _maybe_tokenizer(args.model)
        self.eos_token_ids = self._eos_token_ids()
        cache = self.model_wrapper.allocate_cache(self._num_blocks(), args.cache_block_size)
        generator = Generator(self.model_wrapper)
        plugins = [
            load_plugin(name, generator=generator, cache_config=cache, **options)
            for name in plugin_params.plugin_types if name != StructuredOutputPlugin.name
        ]
        self.structured = self._structured_output(StructuredOutputPlugin.name in plugin_params.plugin_types,
                                                  structured_output.parse_options(plugin_params.options))
        if self.structured is not None:  # last: its plugin_verify checks what the drafters' kept
            plugins.append(self.structured)
        self.plugin_manager = PluginManager(generator, plugins=plugins, eos_token_ids=sorted(self.eos_token_ids))
        args.scheduler.num_lookahead_tokens = self.plugin_manager.num_lookahead_tokens
        args.scheduler.split_fuse = args.scheduler.split_fuse or plugin_params.splitfuse
        if args.scheduler.split_fuse and generator.dp_size > 1:
            raise EngineError("SplitFuse (plugin_type splitfuse / enableSplit) is not available with dp > 1: "
                              "turn one of them off")
        self.prefix_caching = args.enable_prefix_caching or plugin_params.prefix_cache
        prefix_cache = PrefixCache(cache.block_size, self.plugin_manager.kv_context_tokens,
                                   whole_chains=generator.dp_size > 1) if self.prefix_caching else None
        self.block_manager = BlockManager(cache.num_blocks, cache.block_size, reserve_dummy_block=True,
                                          prefix_cache=prefix_cache)
        self.scheduler = Scheduler(args.scheduler, self.block_manager)
        if self.prefix_caching:
            self.plugin_manager.enable_prefix_caching()
            self.scheduler.final_kv_tokens = self.plugin_manager.final_kv_tokens
        self.requests: dict[int, RequestState] = {}
        # Engine-wide speculative counters (all requests since start), for metrics and benchmarks.
        self.spec_stats = SpecDecodeStats.for_drafts(max(1, self.plugin_manager.draft_positions))
        self._ids = itertools.count()
        self.async_stepper = self._async_stepper() if args.scheduler.async_scheduling else None
        # Host work per batch-1 decode step, measured after warm-up (step_accounting.py): /metrics.
        self.step_accounting: Optional[dict] = None
        if args.warmup:
            self.model_wrapper.warmup(max_seqs=args.scheduler.max_batch_size)
            if self.model_wrapper.compiled is not None:
                self.warmup_decode()

    # ---- set-up helpers ---------------------------------------------------------------------------
    def _structured_output(self, listed: bool, options: dict) -> Optional[StructuredOutputPlugin]:
        """Structured output serves any request that asks for a format; listed in plugin_type it
        also loads xgrammar at start-up instead of at the first such request."""
        if self.tokenizer is None:
            if listed:
                raise EngineError(f"plugin_type structured_output needs the model's tokenizer; {self.args.model} has none")
            return None
        return StructuredOutputPlugin(self.tokenizer, self.model_wrapper.config.vocab_size, sorted(self.eos_token_ids),
                                      warm=listed, **options)

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.tokenizer.eos_token_ids) if self.tokenizer else set()
        eos = self.model_wrapper.config.eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    def _async_stepper(self) -> AsyncStepper:
        if self.plugin_manager.generator.dp_size > 1:
            raise EngineError("asyncScheduling is not available with dp > 1: turn one of them off")
        for plugin in self.plugin_manager.plugins:
            if not plugin.supports_async_scheduling:
                what = getattr(plugin, "async_refusal", None) or f"plugin_type {plugin.name!r}"
                raise EngineError(f"asyncScheduling is not available with {what} yet: turn one of them off")
        for plugin in self.plugin_manager.plugins:
            if getattr(plugin, "adaptive", None) is not None and plugin.adaptive.enabled:
                # Steps are built before the previous one is timed: speculate on every step.
                logger.info("async scheduling: adaptive speculation is off, %s speculates every step", plugin.name)
                plugin.adaptive.enabled = False
        return AsyncStepper(self)

    def _num_blocks(self) -> int:
        args, sched = self.args, self.args.scheduler
        # Never more than the configured batch could ever use: a 5 GB default budget on a tiny
        # model would otherwise allocate gigabytes of zeros.
        per_seq = -(-(sched.max_seq_len + 8) // args.cache_block_size)
        cap = sched.max_batch_size * per_seq + 1
        if args.num_blocks is not None:
            return args.num_blocks
        if args.kv_cache_gb is not None:
            budget = int(args.kv_cache_gb * GiB)
        else:
            free, _ = self.model_wrapper.backend.mem_get_info()
            budget = int(free * 0.5)
        return max(2, min(cap, self.model_wrapper.num_blocks_for(budget, args.cache_block_size)))

    # ---- requests ---------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected(f"{self.args.model} has no tokenizer: pass prompts as token id lists")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.model_wrapper.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this model's vocabulary, and
        that a structured output format compiles (StructuredOutputError names the field)."""
        vocab = self.model_wrapper.config.vocab_size
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if not 0 <= t < vocab)
            if bad:
                raise RequestRejected(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if params.has_structured:
            if self.structured is None:
                raise RequestRejected(f"structured output needs the model's tokenizer; {self.args.model} has none")
            self.structured.check(params)

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                    share_prefix_with: Optional[str] = None) -> RequestState:
        """Queue a request. ``share_prefix_with``: the id of a request added before this one with
        the same prompt (n > 1 completions); this one then takes that request's prompt KV blocks
        once its prefill has run and computes only the last prompt tokens. Where that cannot be
        done (the other request is gone, has another prompt, was preempted first; dp > 1) the
        prompt is prefilled in full: the tokens are the same either way."""
        params = params or SamplingParams()
        self.check_params(params)
        seq_id = next(self._ids)
        seq = Sequence(seq_id=seq_id, prompt_token_ids=self.encode(prompt), max_tokens=params.max_tokens, sampling_params=params,
                       prompt_only=params.max_tokens == 0)  # SamplingParams allows 0 with prompt_logprobs only
        self.scheduler.add(seq)
        state = self._new_state(seq, prompt if isinstance(prompt, str) else None, request_id)
        if share_prefix_with is not None:
            self._link_prefix(state, share_prefix_with)
        self.requests[seq_id] = state
        return state

    def _link_prefix(self, state: RequestState, parent_id: str) -> None:
        """Point the new sequence at the live request ``parent_id`` whose prompt blocks it may
        share (the scheduler decides when it admits it); nothing when sharing cannot be right."""
        if self.plugin_manager.generator.dp_size > 1:
            return  # a sequence's KV lives on one dp rank, which its sibling may not share
        parent = next((s for s in self.requests.values() if s.request_id == parent_id and not s.seq.is_finished), None)
        if parent is None or parent.seq.prompt_token_ids != state.seq.prompt_token_ids:
            return
        if state.seq.sampling_params.prompt_logprobs is not None and (
            parent.seq.sampling_params.prompt_logprobs != state.seq.sampling_params.prompt_logprobs
        ):
            return  # the shared positions' prompt logprobs are copied from the parent: it must have the same ones
        state.seq.share_parent = parent.seq
        state.prefix_parent = parent

    def _new_state(self, seq: Sequence, prompt: Optional[str], request_id: Optional[str]) -> RequestState:
        params: SamplingParams = seq.sampling_params
        return RequestState(
            request_id=request_id if request_id is not None else str(seq.seq_id),
            seq=seq,
            prompt=prompt,
            detokenizer=IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
            if self.tokenizer else None,
            stop_matcher=StopStringMatcher(params.stop) if params.stop else None,
            logprobs=[] if params.logprobs is not None else None,
            top_logprobs=[] if params.logprobs else None,
        )

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        for seq_id, state in list(self.requests.items()):
            if state.request_id == request_id and not state.seq.is_finished:
                self.scheduler.abort(seq_id)
                self._clear_plugins([seq_id])
                del self.requests[seq_id]
                state.metrics.note_tokens(time.monotonic(), 0, finished=True)
                return state.output([])
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (vLLM's reset_prefix_cache); blocks that running
        sequences hold stay theirs. Returns how many blocks were registered."""
        return self.block_manager.reset_prefix_cache()

    def warmup_decode(self, batch_sizes: Seq[int] = (1,)) -> None:
        """Run a few decode steps at each batch size so that compiled decode steps (speculative
        ones included) are built or loaded before the first request rather than during it, then
        measure a batch-1 step's host work (``step_accounting``, for /metrics). Speculation
        statistics and the adaptive controller's timings of these steps (compile time included)
        are discarded."""
        ids = [1, 2, 3]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        compiled = self.model_wrapper.compiled
        # Its prefills run eagerly: a package per batch size of 3-token prompts would serve no request.
        prefill_max_rows, compiled.prefill_max_rows = compiled.prefill_max_rows, 0
        try:
            self._warm_up_shapes(ids, params, batch_sizes)
        finally:
            compiled.prefill_max_rows = prefill_max_rows
        if compiled.background is not None:  # serving: rare shapes stay eager, recurring ones compile
            compiled.export_after = EXPORT_AFTER_STEPS
        self.spec_stats = SpecDecodeStats.for_drafts(len(self.spec_stats.accepted_per_position))
        self._reset_adaptive()

    def _warm_up_shapes(self, ids: list[int], params: SamplingParams, batch_sizes: Seq[int]) -> None:
        compiled = self.model_wrapper.compiled
        for n in batch_sizes:
            self.generate([ids] * n, params)
        # The counted steps run each time from a reset controller, inside its first exploration of
        # the arms (adaptive.py), so they meet the same shapes every time, whatever steps cost:
        # once before the wait, so that worker processes compile those shapes with the others.
        self._account_decode_steps(ids)
        compiled.wait_for_compiles()
        self.step_accounting = self._account_decode_steps(ids)

    def _account_decode_steps(self, ids: list[int]) -> dict:
        self._reset_adaptive()
        return account_decode_steps(self, ids, steps=4)

    def _reset_adaptive(self) -> None:
        for plugin in self.plugin_manager.plugins:
            if hasattr(plugin, "adaptive"):
                plugin.adaptive.reset()

    # ---- PD disaggregation ------------------------------------------------------------------------
    def prefill_for_handoff(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> PrefillHandoff:
        """Prefill node: run one request's prefill, return its first token and prompt KV (main
        model and MTP caches), and free it."""
        params = replace(params or SamplingParams(), max_tokens=1, stop=[], min_tokens=0)
        state = self.add_request(prompt, params)
        state.export_kv = True
        self.run([state])
        return state.handoff

    def add_prefilled_request(
        self, handoff: PrefillHandoff, params: Optional[SamplingParams] = None, request_id: Optional[str] = None
    ) -> RequestState:
        """Decode node: adopt a request prefilled on another node, from its KV and first token."""
        params = params or SamplingParams()
        self.check_params(params)
        for plugin in self.plugin_manager.plugins:
            role = getattr(getattr(plugin, "params", None), "pd_role", "decode")
            if role != "decode":
                raise EngineError(f"plugin {plugin.name!r} must run with pd_role 'decode' to adopt prefilled requests")
        if len(handoff.kv) != len(self.model_wrapper.caches):
            raise EngineError(f"the hand-off carries {len(handoff.kv)} cache layers, this model has {len(self.model_wrapper.caches)}")
        seq_id = next(self._ids)
        seq = Sequence(seq_id=seq_id, prompt_token_ids=list(handoff.prompt_token_ids), max_tokens=params.max_tokens,
                       sampling_params=params, output_token_ids=[handoff.first_token_id])
        self.scheduler.add_prefilled(seq)
        self._write_kv(seq, handoff.kv)
        model = self.model_wrapper.model
        for plugin in self.plugin_manager.plugins:
            if hasattr(plugin, "adopt_prefilled"):
                plugin.adopt_prefilled(seq, model.cfg.hidden_size, model.dtype, self.model_wrapper.device)
        state = self._new_state(seq, None, request_id)
        self.requests[seq_id] = state
        reason = self._is_stop(seq, handoff.first_token_id)
        if reason is None and seq.num_output_tokens >= seq.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._clear_plugins([seq_id])
        state.metrics.note_tokens(time.monotonic(), 1, finished=reason is not None)  # its first token, from the hand-off
        return state

    def _read_kv(self, seq: Sequence) -> list[torch.Tensor]:
        slots = torch.from_numpy(self.block_manager.slots(seq, 0, seq.num_prompt_tokens)).to(self.model_wrapper.device)
        bs = self.block_manager.block_size
        blocks, offsets = slots // bs, slots % bs
        return [torch.cat([c.c_kv[blocks, offsets], c.k_pe[blocks, offsets]], dim=-1).cpu() for c in self.model_wrapper.caches]

    def _write_kv(self, seq: Sequence, kv: list[torch.Tensor]) -> None:
        """The handed-off prompt KV, after the positions its cached blocks hold (never written)."""
        start = seq.prefix_cached_tokens
        slots = torch.from_numpy(self.block_manager.slots(seq, start, seq.num_prompt_tokens)).to(self.model_wrapper.device)
        rank = self.model_wrapper.config.kv_lora_rank
        backend = self.model_wrapper.backend
        for cache, layer_kv in zip(self.model_wrapper.caches, kv):
            layer_kv = layer_kv[start:].to(self.model_wrapper.device, cache.c_kv.dtype)
            backend.write_latent_cache(cache, layer_kv[:, :rank], layer_kv[:, rank:], slots)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.async_stepper is not None:
            return self.async_stepper.step()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        outputs = self.plugin_manager.generate_token(
            StepBatch(batch.seqs, batch.is_prefill, self.block_manager.block_size, batch.chunks))
        return self.finish_step(batch, outputs)

    def finish_step(self, batch: ScheduledBatch, outputs: StepOutputs) -> list[RequestOutput]:
        """Host post-processing of a step's results: append tokens, stops, detokenize, outputs."""
        if batch.is_prefill or batch.is_mixed:
            for b, seq in enumerate(batch.seqs):
                if not batch.completes_prefill(b):
                    continue
                state = self.requests[seq.seq_id]
                if seq.sampling_params.prompt_logprobs is not None and not state.prompt_logprobs_done:
                    if seq.shared_prefix_tokens:  # the positions it did not compute: its parent's
                        state.copy_prompt_logprobs(state.prefix_parent, seq.shared_prefix_tokens + 1)
                    state.set_prompt_logprobs(outputs.prompt_logprobs.get(seq.seq_id))
                    state.prompt_logprobs_done = True  # a recompute after a preemption changes nothing
                if state.export_kv:
                    state.handoff = PrefillHandoff(list(seq.prompt_token_ids), outputs.accepted[b][0], self._read_kv(seq))
        updates = self.scheduler.postprocess(batch, outputs.accepted, self._is_stop)
        self._record(batch, outputs, updates)
        finished = [u.seq.seq_id for u in updates if u.finished]
        if finished:
            self._clear_plugins(finished)
        results, now = [], time.monotonic()
        for u in updates:
            state = self.requests[u.seq.seq_id]
            state.metrics.note_tokens(now, len(u.new_token_ids), u.finished)
            if u.finished:
                state.finish_text()
                del self.requests[u.seq.seq_id]
            results.append(state.output(u.new_token_ids))
        return results

    def _clear_plugins(self, seq_ids: list[int]) -> None:
        if self.async_stepper is not None:
            self.async_stepper.clear(seq_ids)  # after the device step that may still read them
        else:
            self.plugin_manager.clear(seq_ids)

    def close(self) -> None:
        if self.async_stepper is not None:
            self.async_stepper.close()
        if self.model_wrapper.compiled is not None:
            self.model_wrapper.compiled.close()

    def _is_stop(self, seq: Sequence, token: int) -> Optional[FinishReason]:
        state = self.requests[seq.seq_id]
        params: SamplingParams = seq.sampling_params
        matched = state.add_token_text(token)
        if matched:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            state.stop_reason = token
            return FinishReason.STOP
        if token in self.eos_token_ids and (not params.ignore_eos or params.has_structured):  # a format's end
            return FinishReason.STOP
        return None

    def _record(self, batch: ScheduledBatch, outputs: StepOutputs, updates: list[SeqUpdate]) -> None:
        """Logprobs of the appended tokens and speculative statistics per request."""
        for b, u in enumerate(updates):
            state = self.requests[u.seq.seq_id]
            rows = outputs.accepted_rows[b][: len(u.new_token_ids)]
            if state.logprobs is not None:
                state.logprobs.extend(float(outputs.logprobs[r]) for r in rows)
            if state.top_logprobs is not None and outputs.top_logprobs is not None:
                ids, vals = outputs.top_logprobs
                n = u.seq.sampling_params.logprobs
                state.top_logprobs.extend({int(i): float(v) for i, v in zip(ids[r][:n], vals[r][:n])} for r in rows)
            if outputs.num_draft_accepted is not None and not batch.is_prefill:
                self._record_spec(state, outputs, b)

    def _record_spec(self, state: RequestState, outputs: StepOutputs, b: int) -> None:
        # this step's drafts: at most K (adaptive speculation), or the sequence's own count
        k = outputs.num_drafts[b] if outputs.num_drafts is not None else outputs.draft_tokens.shape[1]
        state.spec_decode = state.spec_decode or SpecDecodeStats.for_drafts(self.plugin_manager.draft_positions)
        for stats in (state.spec_decode, self.spec_stats):
            stats.add_step(k, outputs.num_draft_accepted[b])

    # ---- batch API ----------------------------------------------------------------------------------
    def generate(self, prompts: Seq[Prompt], params: Union[SamplingParams, Seq[SamplingParams], None] = None) -> list[RequestOutput]:
        """Run prompts to completion (alongside any requests already queued); outputs in prompt order."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        return self.run([self.add_request(p, sp) for p, sp in zip(prompts, plist)])

    def run(self, states: list[RequestState]) -> list[RequestOutput]:
        """Step until every given request has finished; their final outputs, in order."""
        index = {s.request_id: i for i, s in enumerate(states)}
        results: list[Optional[RequestOutput]] = [None] * len(states)
        for i, state in enumerate(states):
            if state.seq.is_finished:  # e.g. a hand-off whose first token already ended it
                state.finish_text()
                self.requests.pop(state.seq.seq_id, None)
                results[i] = state.output(list(state.seq.output_token_ids))
        while any(r is None for r in results):
            outs = self.step()
            if not outs and not self.has_unfinished():
                raise EngineError("the engine went idle with requests unfinished")
            for out in outs:
                i = index.get(out.request_id)
                if i is not None and out.finished:
                    results[i] = out
        return results  # type: ignore[return-value]


def _without_missing_gguf_mtp(params: PluginParams, model: str) -> PluginParams:
    """A GGUF file without MTP (nextn) layers serves without MTP, saying so: llama.cpp's converter
    drops DeepSeek's MTP layers, and such files are what users have. (A safetensors checkpoint
    without them is a configuration error, reported by the MTP plugin.)"""
    if "mtp" not in params.plugin_types or not is_gguf(model):
        return params
    from mindspec.models.deepseekv2.config import DeepseekV2Config
    from mindspec.models.deepseekv2.weights import mtp_modules_in

    if mtp_modules_in(DeepseekV2Config.from_model_dir(model), checkpoint_keys(model)):
        return params
    logger.warning("%s has no MTP (nextn) layers (llama.cpp's converter drops them; `mindspec convert --to gguf` "
                   "keeps them): serving without MTP", model)
    return replace(params, plugin_types=tuple(t for t in params.plugin_types if t != "mtp"))


def _maybe_tokenizer(model_dir: str) -> Optional[Tokenizer]:
    try:
        return load_tokenizer(model_dir)
    except TokenizerError as exc:
        logger.warning("no tokenizer loaded (%s); prompts must be token ids", exc)
        return None
