"""Every rank runs the same LLMEngine on the same request stream (SPMD), so every rank schedules
the same batches; the generator keeps each rank's own sequences for the forward and gathers the
outputs, so every rank samples and verifies the same tokens.

Rank 0 (the leader) is the engine the caller sees: each call that changes engine state
(add_request, abort, add_prefilled_request) is applied locally, recorded, and sent to the other
ranks with the next step (control.py), which apply the same calls in the same order and step.
What could differ between ranks is fixed up front: the KV block count (the smallest of the
ranks') and the random generator of unseeded sampling (one seed from rank 0). A rank that dies or
hangs fails the next collective (gloo reports a closed peer at once, a hang after the timeout);
the leader then raises RankFailure for that step and every later call.
"""
from __future__ import annotations

import logging
import random
import subprocess
import time
from typing import Optional, Sequence

import torch.distributed as dist

from mindspec.engine.args import EngineArgs
from mindspec.engine.llm_engine import LLMEngine

from . import parallel_state
from .control import Command, ControlChannel
from .errors import DistributedError, RankFailure
from .parallel_state import ParallelContext

logger = logging.getLogger(__name__)


class SpmdEngine(LLMEngine):
    def __init__(self, args: EngineArgs, ctx: ParallelContext, workers: Sequence[subprocess.Popen] = ()):
        self.ctx = ctx
        self.channel = ControlChannel(ctx.control_group, ctx.rank, ctx.config.timeout_s)
        self.workers = list(workers)  # spawned local ranks 1.. (empty under torchrun)
        self.failure: Optional[DistributedError] = None
        self._ops: list[tuple[str, tuple, dict]] = []
        self._closed = False
        self.on_close: list = []  # callbacks after the process group is gone (launch.py)
        # Off while building: every rank runs the same set-up (warm-up steps included) by itself.
        self._replicating = False
        super().__init__(args)
        seed = self._from_leader(random.randrange(1 << 62))
        self.plugin_manager.sampler.seed(seed)  # unseeded requests: every rank draws the leader's keys
        if ctx.is_leader:
            self._replicating = True
            self.channel.start_heartbeat()

    # ---- identical set-up on every rank ------------------------------------------------------
    def _num_blocks(self) -> int:
        """Block ids are global (one scheduler everywhere): every rank takes the smallest count."""
        local = super()._num_blocks()
        return min(self._all_gather(local))

    def _from_leader(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.ctx.control_group)
        return box[0]

    def _all_gather(self, value) -> list:
        out = [None] * self.ctx.world_size
        dist.all_gather_object(out, value, group=self.ctx.control_group)
        return out

    # ---- leader: calls recorded for the followers --------------------------------------------
    def add_request(self, prompt, params=None, request_id=None, share_prefix_with=None):
        # share_prefix_with is ignored: under dp a sequence's KV lives on one rank, so siblings
        # are prefilled in full (LLMEngine falls back the same way for dp > 1).
        if not self._replicating:
            return super().add_request(prompt, params, request_id)
        self._ensure_alive()
        state = super().add_request(prompt, params, request_id)
        self._ops.append(("add_request", (prompt, params), {"request_id": state.request_id}))
        return state

    def abort(self, request_id: str):
        out = super().abort(request_id)
        if out is not None and self._replicating and self.failure is None:
            self._ops.append(("abort", (request_id,), {}))
        return out

    def reset_prefix_cache(self) -> int:
        forgotten = super().reset_prefix_cache()  # every rank's block manager is the same one
        if self._replicating and self.failure is None:
            self._ops.append(("reset_prefix_cache", (), {}))
        return forgotten

    def add_prefilled_request(self, handoff, params=None, request_id=None):
        if not self._replicating:
            return super().add_prefilled_request(handoff, params, request_id)
        self._ensure_alive()
        state = super().add_prefilled_request(handoff, params, request_id)
        # every rank writes the KV, so whichever rank the generator picks for it holds it
        self._ops.append(("add_prefilled_request", (handoff, params), {"request_id": state.request_id}))
        return state

    def prefill_for_handoff(self, prompt, params=None):
        raise DistributedError("a PD prefill node runs with dp = 1 (its KV read-out is per rank)")

    def step(self):
        if not self._replicating:
            return super().step()
        self._ensure_alive()
        ops, self._ops = self._ops, []
        try:
            self.channel.send(Command(ops=ops, step=True))
            return super().step()
        except DistributedError as exc:  # e.g. RankDivergence: the ranks can no longer agree
            self.failure = exc
            raise
        except RuntimeError as exc:  # gloo / nccl: closed peer, timeout
            raise self._fail(exc) from exc

    def dp_stats(self) -> list:
        """Every rank's generator statistics (DpStats), rank order."""
        self._ensure_alive()
        try:
            return self.channel.query(Command(query="dp_stats"), self.plugin_manager.generator.dp_stats)
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def close(self, timeout: float = 30.0) -> None:
        """Stop the followers, release the process group; the engine is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self.channel.stop_heartbeat()
        if self.ctx.is_leader and self.failure is None:
            try:
                self.channel.send(Command(ops=self._ops, stop=True))
            except RuntimeError as exc:
                logger.warning("dp ranks could not be told to stop: %s", exc)
        for proc in self.workers:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        _destroy_process_group()
        for callback in self.on_close:
            callback()

    # ---- failures ----------------------------------------------------------------------------
    def _ensure_alive(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise DistributedError("the multi-process engine was closed")

    def _fail(self, exc: Exception) -> RankFailure:
        gone = self._exited_workers()
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if gone:
            cause = "; ".join(gone)
        elif "timed out" in text.lower():
            cause = f"a rank did not answer within distTimeout (hung?): {text[:200]}"
        else:
            cause = text[:300]
        self.failure = RankFailure(
            f"a dp rank failed, the engine cannot continue ({cause}); "
            f"collectives wait at most distTimeout={self.ctx.config.timeout_s:g} s"
        )
        logger.error("%s", self.failure)
        return self.failure

    def _exited_workers(self, grace_s: float = 3.0) -> list[str]:
        """The spawned ranks that have exited. A killed rank's sockets close while the kernel
        tears the process down, so the collective can fail before its exit can be reaped:
        wait up to `grace_s` for one to exit before concluding none did."""
        deadline = time.monotonic() + (grace_s if self.workers else 0.0)
        while True:
            gone = [f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                    for r, p in enumerate(self.workers, start=1) if p.poll() is not None]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.05)

    # ---- followers ---------------------------------------------------------------------------
    def follow(self) -> None:
        """Apply the leader's calls and steps until it says stop (ranks > 0)."""
        while True:  # _replicating is off here: the overrides act as plain LLMEngine calls
            command = self.channel.receive()
            for name, args, kwargs in command.ops:
                getattr(self, name)(*args, **kwargs)
            if command.query == "dp_stats":
                self.channel.answer(self.plugin_manager.generator.dp_stats)
            if command.stop:
                return
            if command.step:
                self.step()


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    parallel_state.set_current(None)
