"""Paged KV accounting: blocks of ``block_size`` tokens, slot = block_id * block_size + offset.

The last block is reserved for dummy and padding inputs (MindIE does the same) and is never given
to a sequence. Host-side only: the block manager never touches the cache tensors.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .errors import EngineError
from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, reserve_dummy_block: bool = True):
        if block_size < 1:
            raise EngineError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < (2 if reserve_dummy_block else 1):
            raise EngineError(f"the KV cache has {num_blocks} block(s); at least 2 are needed (one is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dummy_block_id = num_blocks - 1 if reserve_dummy_block else None
        usable = num_blocks - 1 if reserve_dummy_block else num_blocks
        self._free: deque[int] = deque(range(usable))
        self._used: set[int] = set()

    @classmethod
    def from_memory_budget(cls, mem_bytes: int, bytes_per_token: int, block_size: int, **kw) -> "BlockManager":
        num_blocks = int(mem_bytes // (bytes_per_token * block_size))
        if num_blocks < 2:
            raise EngineError(
                f"a KV budget of {mem_bytes} bytes holds {num_blocks} block(s) of {block_size} tokens "
                f"x {bytes_per_token} bytes; at least 2 are needed"
            )
        return cls(num_blocks, block_size, **kw)

    @property
    def num_usable_blocks(self) -> int:
        return len(self._free) + len(self._used)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _missing(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))

    # ---- allocation ------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        return self._missing(seq, seq.num_tokens + num_lookahead) <= len(self._free)

    def allocate(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Blocks for all of seq's tokens plus ``num_lookahead`` positions."""
        self.ensure(seq, seq.num_tokens + num_lookahead)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._missing(seq, seq.num_tokens + num_new_tokens) <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover seq.num_tokens + num_new_tokens token positions."""
        self.ensure(seq, seq.num_tokens + num_new_tokens)

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        missing = self._missing(seq, num_tokens)
        if missing > len(self._free):
            raise EngineError(f"sequence {seq.seq_id} needs {missing} more block(s), {len(self._free)} free")
        for _ in range(missing):
            block = self._free.popleft()
            self._used.add(block)
            seq.block_table.append(block)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free trailing blocks not needed for ``num_tokens`` positions (KV rollback)."""
        keep = self.blocks_for_tokens(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def _release(self, block: int) -> None:
        if block not in self._used:
            raise EngineError(f"block {block} freed twice or never allocated")
        self._used.remove(block)
        self._free.appendleft(block)

    # ---- addressing ------------------------------------------------------------------------
    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slots of token positions start..end-1 of ``seq`` (int64)."""
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
