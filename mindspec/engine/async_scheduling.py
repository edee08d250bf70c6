"""Async scheduling: the host schedules and builds step N+1 while the device runs step N, then
post-processes step N (stops, detokenization, outputs) while the device runs N+1.

    host:    build N+1 (placeholders) | wait N | post-process N | build N+2 | wait N+1 | ...
    device:  run N ------------------>| fill N+1 from N, run N+1 ------------------->| ...

The "device" is one worker thread (a stream stand-in on cpu): steps run on it strictly in order,
so step N+1's fill reads step N's outputs and the plugins' caches that N updated. Sequences in
step N carry placeholder tokens in step N+1's batch; ``PluginManager.fill_in_model_result`` patches
them from N's accepted tokens right before N+1 runs. Each step's batch holds views of its
sequences (own token lists and block tables), so the host may append N's tokens to the real
sequences while N+1 runs.

A step waits for the one in flight (and the engine falls back to scheduling after it) when the
next decode batch would need a preemption; sequences that finish in step N drop whatever step
N+1 computed for them; plugin caches are cleared on the device, after the steps that read them.
Greedy outputs equal synchronous scheduling token for token (tests/engine/test_async_scheduling.py).
"""
from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import numpy as np

from mindspec.text_generator.step import PLACEHOLDER_TOKEN, StepBatch, StepOutputs

from .scheduler import ScheduledBatch
from .sequence import Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class AsyncStats:
    steps: int = 0
    ahead_steps: int = 0  # built while the previous step ran
    waits: int = 0  # steps that could not be built ahead (preemption or nothing to run)
    dropped_sequences: int = 0  # rows computed for sequences that had finished in the step before


@dataclass
class _InFlight:
    batch: ScheduledBatch  # the engine's sequences
    views: StepBatch  # what the device step reads
    future: "Future[StepOutputs]"


class AsyncStepper:
    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mindspec-device")
        self.inflight: Optional[_InFlight] = None
        self.stats = AsyncStats()
        # One more token per step than the drafts: speculation runs on every step here.
        self.max_new_tokens = 1 + engine.plugin_manager.num_lookahead_tokens

    def step(self) -> list["RequestOutput"]:
        if self.inflight is None:
            batch = self.engine.scheduler.schedule()
            if batch is None:
                return []
            self.inflight = self._submit(batch, None)
        current = self.inflight
        self.inflight = self._ahead(current)
        try:
            outputs = current.future.result()
        except BaseException:
            self.drain()
            raise
        batch, outputs = self._drop_finished(current.batch, outputs)
        return self.engine.finish_step(batch, outputs)

    def clear(self, seq_ids: list[int]) -> None:
        """Plugin caches of retired sequences: cleared after the steps already queued."""
        self.device.submit(self.engine.plugin_manager.clear, list(seq_ids))

    def wait_device(self) -> None:
        """Block until the step in flight is done (its results stay for the next ``step``):
        before the host writes KV itself, into blocks that step may still be writing."""
        if self.inflight is not None:
            concurrent.futures.wait([self.inflight.future])

    def drain(self) -> None:
        """Wait for the step in flight and forget it (after a failure, or at shutdown)."""
        inflight, self.inflight = self.inflight, None
        if inflight is not None:
            try:
                inflight.future.result()
            except BaseException:  # noqa: BLE001 - the first failure was already raised
                logger.debug("a queued step failed after an earlier failure", exc_info=True)

    def close(self) -> None:
        self.drain()
        self.device.shutdown(wait=True)

    # ---- building steps ------------------------------------------------------------------------
    def _ahead(self, current: _InFlight) -> Optional[_InFlight]:
        per_seq = 1 if current.batch.is_prefill else self.max_new_tokens
        pending = {s.seq_id: per_seq for s in current.batch.seqs if not s.is_finished}
        batch = self.engine.scheduler.schedule_ahead(pending)
        if batch is None:
            self.stats.waits += 1
            return None
        self.stats.ahead_steps += 1
        return self._submit(batch, current, pending)

    def _submit(self, batch: ScheduledBatch, previous: Optional[_InFlight], pending: Optional[dict] = None) -> _InFlight:
        engine = self.engine
        counts = np.array([(pending or {}).get(s.seq_id, 0) for s in batch.seqs], dtype=np.int64)
        views = StepBatch([_view(s, int(n)) for s, n in zip(batch.seqs, counts)], batch.is_prefill,
                          engine.block_manager.block_size)
        pm = engine.plugin_manager
        inputs = pm.prepare_ahead(views, counts) if counts.any() else pm.prepare(views)
        before = previous.future if previous is not None else None
        before_ids = [s.seq_id for s in previous.views.seqs] if previous is not None else []

        def run() -> StepOutputs:
            if counts.any():
                last = before.result()  # already done: one device thread runs steps in order
                by_id = dict(zip(before_ids, last.accepted))
                accepted = [by_id[s.seq_id] if n else [] for s, n in zip(views.seqs, counts)]
                pm.fill_in_model_result(views, inputs, counts, accepted)
            return pm.execute(views, inputs)

        self.stats.steps += 1
        return _InFlight(batch, views, self.device.submit(run))

    def _drop_finished(self, batch: ScheduledBatch, outputs: StepOutputs) -> tuple[ScheduledBatch, StepOutputs]:
        """Sequences that finished (or were aborted) before this step's results came back."""
        keep = [b for b, s in enumerate(batch.seqs) if not s.is_finished]
        if len(keep) == len(batch.seqs):
            return batch, outputs
        self.stats.dropped_sequences += len(batch.seqs) - len(keep)
        pick = lambda xs: None if xs is None else [xs[b] for b in keep]  # noqa: E731
        outputs = replace(outputs, accepted=pick(outputs.accepted), accepted_rows=pick(outputs.accepted_rows),
                          num_draft_accepted=pick(outputs.num_draft_accepted))
        return ScheduledBatch([batch.seqs[b] for b in keep], batch.is_prefill), outputs


def _view(seq: Sequence, pending: int) -> Sequence:
    """What a device step reads of a sequence: its own token list and block table, plus
    ``pending`` placeholders for the tokens of the step still running."""
    outputs = list(seq.output_token_ids) + [PLACEHOLDER_TOKEN] * pending
    cached = seq.num_cached_tokens
    if pending:  # as if the running step accepted all of them; the fill moves it back
        cached = len(seq.prompt_token_ids) + len(outputs) - 1
    return Sequence(seq_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids, max_tokens=seq.max_tokens,
                    sampling_params=seq.sampling_params, output_token_ids=outputs, status=seq.status,
                    block_table=list(seq.block_table), num_cached_tokens=cached, arrival_time=seq.arrival_time)
