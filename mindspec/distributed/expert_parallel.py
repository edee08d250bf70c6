"""Expert parallelism for DeepSeekMoE (MindIE's ep_level 1: all-gather dispatch).

The ``moe_ep`` ranks of an ep group each hold ``E / moe_ep`` consecutive routed experts. Per MoE
layer every rank routes its own tokens, the group all-gathers tokens and routing (every rank is
padded to the same token count by the generator, so shapes are equal), each rank runs its experts
on every gathered token (ids of other ranks' experts fall outside its range and are skipped by
``Backend.moe_experts``), and a reduce-scatter sums the partial outputs and hands each rank back
its own rows. Shared experts and attention stay local (replicated weights).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import parallel_state

# torch >= 2.10 names; older releases (as shipped with some torch_npu builds) have the *_tensor ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ExpertParallel:
    def __init__(self, num_experts: int, ep_rank: int, ep_size: int, group=None):
        if num_experts % ep_size:
            raise ValueError(f"moe_ep={ep_size} does not divide the model's {num_experts} routed experts")
        self.num_local = num_experts // ep_size
        self.first = ep_rank * self.num_local
        self.ep_size = ep_size
        self.group = group

    @classmethod
    def for_current_process(cls, num_experts: int) -> Optional["ExpertParallel"]:
        """None when this process holds every expert (moe_ep = 1)."""
        ctx = parallel_state.current()
        if ctx.ep_size == 1:
            return None
        return cls(num_experts, ctx.ep_rank, ctx.ep_size, ctx.ep_group)

    @property
    def local_experts(self) -> range:
        return range(self.first, self.first + self.num_local)

    def dispatch(
        self,
        x: torch.Tensor,  # [T, H] this rank's tokens (T equal on every rank of the group)
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int64 global expert ids
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (x [ep*T, H], weights [ep*T, k], local ids [ep*T, k]) of every rank's tokens."""
        k = topk_ids.shape[1]
        x_all = torch.empty((self.ep_size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather(x_all, x.contiguous(), group=self.group)
        # ids travel as float32 next to the weights: exact below 2**24 experts, one collective
        routing = torch.cat([topk_weights.to(torch.float32), topk_ids.to(torch.float32)], dim=1)  # [T, 2k]
        routing_all = torch.empty((self.ep_size * routing.shape[0], 2 * k), dtype=torch.float32, device=x.device)
        _all_gather(routing_all, routing, group=self.group)
        ids = routing_all[:, k:].to(torch.int64) - self.first  # outside [0, num_local): another rank's
        return x_all, routing_all[:, :k].contiguous(), ids

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """partial [ep*T, H] (this rank's experts on every token) -> [T, H] summed over ranks."""
        out = torch.empty((partial.shape[0] // self.ep_size, partial.shape[1]), dtype=partial.dtype,
                          device=partial.device)
        _reduce_scatter(out, partial.contiguous(), group=self.group)
        return out
