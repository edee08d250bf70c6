"""Every dp rank's outputs back in request order, identical on every rank.

Each rank sends only its real rows (a prefix of its outputs: padding comes last), packed into
one float32 buffer: logits [n, V], hidden states [t, H] (bf16/fp16 -> fp32 is exact) and drafts
[b, K] (token ids below 2**24 are exact in fp32). One all_gather per step; every rank knows
every rank's row counts from the plan, so nothing else is exchanged.
"""
from __future__ import annotations

from math import prod

import torch
import torch.distributed as dist

from .errors import RankDivergence

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Shape = tuple[int, ...]


class OutputGather:
    def __init__(self, group, world_size: int):
        self.group, self.world_size = group, world_size

    def all_gather(self, parts: list[torch.Tensor], shapes: list[list[Shape]], device=None) -> list[list[torch.Tensor]]:
        """parts: this rank's tensors (none: a rank that ran nothing, on ``device``); shapes[r]:
        rank r's shapes of the same parts -> per rank, its parts as float32 (this rank's
        included, as received)."""
        sizes = [sum(prod(s) for s in rank_shapes) for rank_shapes in shapes]
        width = max(max(sizes), 1)
        device = parts[0].device if parts else device
        send = torch.zeros(width, dtype=torch.float32, device=device)
        flat = torch.cat([p.reshape(-1).to(torch.float32) for p in parts]) if parts else send[:0]
        send[: flat.numel()] = flat
        recv = torch.empty(self.world_size * width, dtype=torch.float32, device=device)
        _all_gather(recv, send, group=self.group)
        out = []
        for r, rank_shapes in enumerate(shapes):
            buf, offset, tensors = recv[r * width:(r + 1) * width], 0, []
            for s in rank_shapes:
                tensors.append(buf[offset:offset + prod(s)].view(s))
                offset += prod(s)
            out.append(tensors)
        return out

    def check_same(self, values: list[int], describe: str, device) -> None:
        """Every rank must be about to run the same step: an all_gather of a few integers, and a
        clear error instead of collectives that hang or mix up shapes."""
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        every = torch.empty(self.world_size * len(values), dtype=torch.int64, device=device)
        _all_gather(every, mine, group=self.group)
        rows = every.view(self.world_size, len(values)).tolist()
        if any(row != rows[0] for row in rows):
            raise RankDivergence(f"dp ranks disagree about this step ({describe}): " +
                                 "; ".join(f"rank {r}: {row}" for r, row in enumerate(rows)))
