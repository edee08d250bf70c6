"""This process's place in a multi-process run: its rank and its process groups.

One ParallelContext per process, set by the launcher before the engine is built (the model reads
it when it loads its experts, the generator when it splits batches), as vLLM and Megatron keep
their parallel state. A process that never launched anything sees the single-rank context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .parallel_config import ParallelConfig


@dataclass
class ParallelContext:
    config: ParallelConfig
    rank: int = 0
    local_rank: int = 0
    # data plane (backend.dist_backend: gloo / nccl / hccl): output gathers, step checks
    world_group: Any = None
    # routed experts: moe_ep consecutive ranks
    ep_group: Any = None
    # host objects from rank 0 (always gloo, so it also works next to nccl / hccl)
    control_group: Any = None

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def dp_size(self) -> int:
        return self.config.dp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.config.tp

    @property
    def ep_size(self) -> int:
        return self.config.moe_ep

    @property
    def ep_rank(self) -> int:
        return self.rank % self.config.moe_ep

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


SINGLE_PROCESS = ParallelContext(ParallelConfig())
_current: Optional[ParallelContext] = None


def current() -> ParallelContext:
    return _current or SINGLE_PROCESS


def set_current(ctx: Optional[ParallelContext]) -> None:
    global _current
    _current = ctx
