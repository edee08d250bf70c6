"""Async scheduling: while the device runs step N+1, the host post-processes step N (stops,
detokenization, outputs) and schedules and builds step N+2.

    device (calling thread): run N   | fill N+1 from N, run N+1          | fill N+2 from N+1, run N+2
    host (helper thread):    ...     | post-process N, build N+2 (ahead) | post-process N+1, build N+3

The host thread's work for a step starts when that step is launched (the model wrapper's
LaunchSignal): both threads' Python holds the GIL, and the calling thread's input building must
not wait for it.

Sequences in step N+1 appear in step N+2's batch with placeholder tokens for what N+1 adds;
``PluginManager.fill_in_model_result`` patches them from N+1's accepted tokens right before N+2
runs. Each step's batch holds views of its sequences (own token lists and block tables), so the
host appends tokens to the real sequences while the device reads the views. Torch work stays on
the calling thread: on cpu a second thread running intra-op parallel kernels makes both OpenMP
teams several times slower.

The next step is built after the previous one was post-processed, so it never holds a sequence
that had finished by then; sequences that finish while their next step already runs drop what
it computed for them. When the next decode batch would need a preemption nothing is built ahead
and the engine schedules as usual after post-processing. Plugin caches of retired sequences are
cleared after the device step that may still read them. Greedy outputs equal synchronous
scheduling token for token (tests/engine/test_async_scheduling.py).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import numpy as np

from mindspec.text_generator.step import PLACEHOLDER_TOKEN, StepBatch, StepInputs, StepOutputs

from .scheduler import ScheduledBatch
from .sequence import Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .outputs import RequestOutput


@dataclass
class AsyncStats:
    steps: int = 0
    ahead_steps: int = 0  # built while the previous step ran
    waits: int = 0  # steps that could not be built ahead (preemption or nothing to run)
    dropped_sequences: int = 0  # rows computed for sequences that had finished in the step before


@dataclass
class _Step:
    batch: ScheduledBatch  # the engine's sequences
    views: StepBatch  # what the device step reads
    inputs: StepInputs
    pending: np.ndarray  # [B] tokens the previous step may add per sequence (0: none, not ahead)
    ahead: bool
    outputs: Optional[StepOutputs] = None


class AsyncStepper:
    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mindspec-host")
        self.prev: Optional[_Step] = None  # ran, not post-processed yet
        self.next: Optional[_Step] = None  # built ahead, not run yet
        self.stats = AsyncStats()
        self._clears: list[int] = []
        # One more token per step than the drafts: speculation runs on every step here.
        self.max_new_tokens = 1 + engine.plugin_manager.num_lookahead_tokens

    def step(self) -> list["RequestOutput"]:
        outs = []
        if self.next is not None and any(s.is_finished for s in self.next.batch.seqs):
            self.next = None  # a sequence was aborted since: its blocks may be someone else's now
        if self.next is None and self.prev is not None:  # nothing built ahead: post-process first
            outs, self.prev = self._finish(self.prev), None
        cur, self.next = self.next or self._build_now(), None
        if cur is None:
            self._apply_clears()
            return outs
        prev, self.prev = self.prev, None
        launched = threading.Event()
        host = self.host.submit(self._host_work, prev, cur, launched)
        self.engine.model_wrapper.launch.arm(launched.set)
        try:
            self._run(cur, prev)
        finally:
            launched.set()  # a step that never reached the device
            try:
                more, self.next = host.result()
            except BaseException:
                self.next = None
                raise
        self._apply_clears()
        self.prev = cur
        return outs + more

    def clear(self, seq_ids: list[int]) -> None:
        """Plugin caches of retired sequences: cleared after the next device step (which may
        still read them)."""
        self._clears.extend(seq_ids)

    def drain(self) -> list["RequestOutput"]:
        """Post-process the last step and drop the one built ahead (tests, shutdown)."""
        outs = self._finish(self.prev) if self.prev is not None else []
        self.prev = self.next = None
        self._apply_clears()
        return outs

    def close(self) -> None:
        self.drain()
        self.host.shutdown(wait=True)

    # ---- device side (calling thread) -----------------------------------------------------------
    def _run(self, cur: _Step, prev: Optional[_Step]) -> None:
        pm = self.engine.plugin_manager
        if cur.ahead:
            by_id = dict(zip(prev.views.seq_ids, prev.outputs.accepted))
            accepted = [by_id[s.seq_id] if n else [] for s, n in zip(cur.views.seqs, cur.pending)]
            pm.fill_in_model_result(cur.views, cur.inputs, cur.pending, accepted)
        cur.outputs = pm.execute(cur.views, cur.inputs)
        self.stats.steps += 1

    def _apply_clears(self) -> None:
        clears, self._clears = self._clears, []
        if clears:
            self.engine.plugin_manager.clear(clears)

    # ---- host side (helper thread while the device runs) --------------------------------------------
    def _host_work(self, prev: Optional[_Step], cur: _Step,
                   launched: threading.Event) -> tuple[list["RequestOutput"], Optional[_Step]]:
        # Both threads' host work holds the GIL: this one waits until the calling thread has
        # launched the device step (which runs without the GIL), not to delay that launch.
        launched.wait()
        outs = self._finish(prev) if prev is not None else []
        return outs, self._ahead(cur)

    def _build_now(self) -> Optional[_Step]:
        batch = self.engine.scheduler.schedule()
        if batch is None:
            return None
        views = self._views(batch, {})
        return _Step(batch, views, self.engine.plugin_manager.prepare(views), np.zeros(len(views), np.int64), False)

    def _ahead(self, cur: _Step) -> Optional[_Step]:
        per_seq = 1 if cur.batch.is_prefill else self.max_new_tokens
        pending = {s.seq_id: per_seq for s in cur.batch.seqs if not s.is_finished}
        batch = self.engine.scheduler.schedule_ahead(pending)
        if batch is None:
            self.stats.waits += 1
            return None
        self.stats.ahead_steps += 1
        views = self._views(batch, pending)
        counts = np.array([pending.get(s.seq_id, 0) for s in batch.seqs], dtype=np.int64)
        return _Step(batch, views, self.engine.plugin_manager.prepare_ahead(views, counts), counts, True)

    def _views(self, batch: ScheduledBatch, pending: dict[int, int]) -> StepBatch:
        seqs = [_view(s, pending.get(s.seq_id, 0)) for s in batch.seqs]
        return StepBatch(seqs, batch.is_prefill, self.engine.block_manager.block_size, batch.chunks)

    def _finish(self, step: _Step) -> list["RequestOutput"]:
        batch, outputs = self._drop_finished(step.batch, step.outputs)
        return self.engine.finish_step(batch, outputs)

    def _drop_finished(self, batch: ScheduledBatch, outputs: StepOutputs) -> tuple[ScheduledBatch, StepOutputs]:
        """Sequences that finished (or were aborted) before this step's results came back."""
        keep = [b for b, s in enumerate(batch.seqs) if not s.is_finished]
        if len(keep) == len(batch.seqs):
            return batch, outputs
        self.stats.dropped_sequences += len(batch.seqs) - len(keep)
        pick = lambda xs: None if xs is None else [xs[b] for b in keep]  # noqa: E731
        outputs = replace(outputs, accepted=pick(outputs.accepted), accepted_rows=pick(outputs.accepted_rows),
                          num_draft_accepted=pick(outputs.num_draft_accepted))
        chunks = None if batch.chunks is None else [batch.chunks[b] for b in keep]
        return ScheduledBatch([batch.seqs[b] for b in keep], batch.is_prefill, chunks), outputs


def _view(seq: Sequence, pending: int) -> Sequence:
    """What a device step reads of a sequence: its own token list and block table, plus
    ``pending`` placeholders for the tokens of the step still running."""
    view = replace(seq, output_token_ids=list(seq.output_token_ids) + [PLACEHOLDER_TOKEN] * pending,
                   block_table=list(seq.block_table))
    if pending:  # as if the running step accepted all of them; the fill moves it back
        view.num_cached_tokens = view.num_tokens - 1
    return view
