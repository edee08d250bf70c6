"""Where the time of one decode step goes: a profile of an engine's steps, stage by stage.

Timers wrap the stages of one engine instance (its scheduler, plugin manager, plugins, generator,
model layers) for the duration of a run; nothing global is patched and production code carries no
timing hooks. Decode steps and prefill steps are kept apart, and every figure is a mean per decode
step. "host overhead" is the step's time minus the model forward: everything a faster device
would not speed up (scheduling, input building, plugin hooks, sampling, verification, stop checks
and detokenisation, output assembly).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable

# Stage names, in the order of a step.
SCHEDULE = "scheduler: schedule"
COMPOSE = "input building (base)"
PLUGIN_INPUTS = "plugin: model_inputs_update"
MODEL = "model forward"
SAMPLE = "sampling"
VERIFY = "plugin: verify"
CACHE_UPDATE = "plugin: cache update"
POSTPROCESS = "scheduler: append tokens, stop checks, detokenize"
STEP = "step total"


class StepProfiler:
    """Accumulates stage times per decode step of one LLMEngine."""

    def __init__(self, engine):
        self.engine = engine
        self.decode = defaultdict(float)
        self.decode_steps = 0
        self._current: dict[str, float] = defaultdict(float)
        self._is_prefill = False
        self._restore: list[tuple[object, str]] = []

    # ---- installing timers ------------------------------------------------------------------
    def _wrap(self, obj, attr: str, key: str, on_result: Callable = None) -> None:
        original = getattr(obj, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            result = original(*args, **kwargs)
            self._current[key] += time.perf_counter() - t
            if on_result is not None:
                on_result(result)
            return result

        setattr(obj, attr, timed)
        self._restore.append((obj, attr))

    def _note_batch(self, batch) -> None:
        self._is_prefill = bool(batch is not None and batch.is_prefill)

    @contextmanager
    def installed(self):
        e = self.engine
        pm = e.plugin_manager
        self._wrap(e.scheduler, "schedule", SCHEDULE, self._note_batch)
        self._wrap(e.scheduler, "postprocess", POSTPROCESS)
        self._wrap(pm, "compose_model_inputs", COMPOSE)
        self._wrap(pm, "sample", SAMPLE)
        for plugin in pm.plugins:
            self._wrap(plugin, "model_inputs_update", PLUGIN_INPUTS)
            self._wrap(plugin, "plugin_verify", VERIFY)
            self._wrap(plugin, "plugin_cache_update", CACHE_UPDATE)
        self._wrap(pm.generator, "forward", MODEL)
        model = e.model_wrapper.model
        if e.model_wrapper.compiled is None:  # a compiled step is one fused graph: no per-layer times
            for i, layer in enumerate(model.layers):
                self._wrap(layer, "forward", f"layer {i:02d}")
            for j, module in enumerate(model.mtp_modules):
                self._wrap(module, "forward", f"mtp module {j}")
        self._wrap(e, "step", STEP, self._end_step)
        try:
            yield self
        finally:
            for obj, attr in reversed(self._restore):
                delattr(obj, attr)  # the instance attribute goes; the class method shows through
            self._restore.clear()

    def _end_step(self, _result) -> None:
        if not self._is_prefill and self._current.get(MODEL):
            for key, value in self._current.items():
                self.decode[key] += value
            self.decode_steps += 1
        self._current = defaultdict(float)

    # ---- report -----------------------------------------------------------------------------
    def report(self) -> dict:
        n = max(1, self.decode_steps)
        ms = {key: round(1e3 * value / n, 4) for key, value in self.decode.items()}
        layers = {k: v for k, v in ms.items() if k.startswith(("layer", "mtp module"))}
        stages = {k: v for k, v in ms.items() if k not in layers}
        model = stages.get(MODEL, 0.0)
        stages["model: outside the decoder layers (embedding, norms, lm_head, draft loop glue)"] = round(
            model - sum(layers.values()), 4) if layers else None
        total = stages.get(STEP, 0.0)
        known = sum(v for k, v in stages.items() if k not in (STEP, MODEL) and not k.startswith("model:") and v)
        stages["other host work (outputs, bookkeeping)"] = round(total - model - known, 4)
        return {
            "decode_steps": self.decode_steps,
            "ms_per_decode_step": stages,
            "ms_per_decode_step_by_layer": layers,
            "host_overhead_ms_per_step": round(total - model, 4),
            "host_overhead_share": round((total - model) / total, 4) if total else None,
        }


def profile_engine(llm, prompts, params, warmup_prompts=None) -> dict:
    """Run ``prompts`` (one batch) on ``llm`` with timers installed; the per-step report."""
    if warmup_prompts:
        llm.generate(warmup_prompts, params)
    profiler = StepProfiler(llm.engine)
    with profiler.installed():
        llm.generate(prompts, params)
    return profiler.report()
