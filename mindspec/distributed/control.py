"""Rank 0 -> every rank: the engine calls of each step, in order (MindIE's centralised dp: one
rank receives the requests, every rank schedules the same batches).

Commands are pickled host objects broadcast over a gloo group (it also works next to nccl /
hccl). The group's timeout bounds every wait, so a rank whose leader hangs or dies gives up
instead of waiting forever; while the leader is idle a heartbeat (an empty command) keeps the
followers from mistaking idleness for a hang.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist


@dataclass
class Command:
    # engine method name, args, kwargs: calls the leader made (and that succeeded), in order
    ops: list[tuple[str, tuple, dict]] = field(default_factory=list)
    step: bool = False  # then run one engine step
    query: Optional[str] = None  # every rank answers (all_gather_object)
    stop: bool = False


class ControlChannel:
    def __init__(self, group, rank: int, timeout_s: float):
        self.group, self.rank = group, rank
        self.heartbeat_s = max(0.5, min(10.0, timeout_s / 4))
        self._lock = threading.Lock()  # one broadcast at a time (heartbeat thread vs engine thread)
        self._last_send = time.monotonic()
        self._stopped = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None

    # ---- leader ------------------------------------------------------------------------------
    def send(self, command: Command) -> None:
        with self._lock:
            self._broadcast(command)

    def query(self, command: Command, answer: Any) -> list[Any]:
        """Send a query and gather every rank's answer (the leader's ``answer`` first)."""
        with self._lock:
            self._broadcast(command)
            return self._gather(answer)

    def start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._beat, name="mindspec-dp-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.join(self.heartbeat_s + 1)

    def _beat(self) -> None:
        while not self._stopped.wait(self.heartbeat_s / 2):
            with self._lock:
                if self._stopped.is_set() or time.monotonic() - self._last_send < self.heartbeat_s:
                    continue
                try:
                    self._broadcast(Command())
                except Exception:  # a broken group: the engine thread reports it at its next call
                    return

    def _broadcast(self, command: Command) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)
        self._last_send = time.monotonic()

    # ---- followers ---------------------------------------------------------------------------
    def receive(self) -> Command:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def answer(self, answer: Any) -> list[Any]:
        return self._gather(answer)

    def _gather(self, answer: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, answer, group=self.group)
        return out
