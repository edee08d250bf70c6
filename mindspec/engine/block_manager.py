"""Paged KV accounting: blocks of ``block_size`` tokens, slot = block_id * block_size + offset.

The last block (``num_blocks - 1``) is reserved for dummy and padding inputs, as MindIE does, and
is never given to a sequence: padded rows of a batch write their KV there without touching a live
sequence. Host-side only: the block manager never touches the cache tensors.

Blocks are reference counted: a sequence may share the full prompt blocks of another sequence
with the same prompt (``share``, n > 1 completions) instead of computing them again. A block goes
back to the free list when its last owner frees it, so preempting, aborting or finishing either
owner never takes blocks from the other. Only blocks that no owner writes again are shared (the
scheduler picks them: positions before the last prompt tokens and drafts).

Coverage rule used by every method: a block table "covers" ``n`` token positions when
``len(block_table) * block_size >= n``; positions are 0-based, so covering ``n`` means positions
0..n-1 have slots.
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
        need = 2 if reserve_dummy_block else 1
        if num_blocks < need:
            raise EngineError(
                f"the KV cache has {num_blocks} block(s); at least {need} are needed"
                + (" (one is reserved for dummy inputs)" if reserve_dummy_block else "")
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dummy_block_id = num_blocks - 1 if reserve_dummy_block else None
        usable = num_blocks - 1 if reserve_dummy_block else num_blocks
        # Freed blocks go to the front and are reused first (their cache lines are likely warm).
        self._free: deque[int] = deque(range(usable))
        self._refs: dict[int, int] = {}  # owners of every used block

    @classmethod
    def from_memory_budget(cls, mem_bytes: int, bytes_per_token: int, block_size: int, **kw) -> "BlockManager":
        """As many blocks as ``mem_bytes`` holds (MindIE npuMemSize / cpuMemSize is this budget)."""
        if bytes_per_token < 1 or block_size < 1:
            raise EngineError(f"bytes_per_token ({bytes_per_token}) and block_size ({block_size}) must be >= 1")
        num_blocks = int(mem_bytes // (bytes_per_token * block_size))
        if num_blocks < 2:
            raise EngineError(
                f"a KV budget of {mem_bytes} bytes holds {num_blocks} block(s) of {block_size} tokens "
                f"x {bytes_per_token} bytes per token ({bytes_per_token * block_size} bytes per block); "
                f"at least 2 are needed"
            )
        return cls(num_blocks, block_size, **kw)

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that sequences may own (all but the dummy block)."""
        return len(self._free) + len(self._refs)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    def ref_count(self, block: int) -> int:
        """Sequences whose table lists ``block`` (0: free)."""
        return self._refs.get(block, 0)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return Sequence.num_blocks_needed(num_tokens, self.block_size)

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs to cover ``num_tokens`` positions."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))

    # ---- allocation ------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        return self.blocks_missing(seq, seq.num_tokens + num_lookahead) <= len(self._free)

    def allocate(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Cover all of seq's tokens plus ``num_lookahead`` positions (prefill)."""
        self.ensure(seq, seq.num_tokens + num_lookahead)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_missing(seq, seq.num_tokens + num_new_tokens) <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the table so it covers ``seq.num_tokens + num_new_tokens`` positions.

        At decode the newest token (position num_tokens-1) is already counted in num_tokens and
        gets its KV written this step; ``num_new_tokens`` are the positions beyond it (the
        drafts, i.e. the scheduler's num_lookahead_tokens).
        """
        self.ensure(seq, seq.num_tokens + num_new_tokens)

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        """Cover ``num_tokens`` positions; never shrinks. All or nothing."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > len(self._free):
            raise EngineError(
                f"sequence {seq.seq_id} needs {missing} more block(s) for {num_tokens} tokens, "
                f"{len(self._free)} free"
            )
        for _ in range(missing):
            block = self._free.popleft()
            self._refs[block] = 1
            seq.block_table.append(block)

    def share(self, seq: Sequence, owner: Sequence, num_blocks: int) -> None:
        """Start ``seq``'s empty table with the first ``num_blocks`` blocks of ``owner``'s (one
        more owner each); their KV must be final (never written again by either sequence)."""
        if seq.block_table:
            raise EngineError(f"sequence {seq.seq_id} already holds blocks; only an empty table takes shared ones")
        if not 0 <= num_blocks <= len(owner.block_table):
            raise EngineError(
                f"sequence {owner.seq_id} holds {len(owner.block_table)} blocks, cannot share {num_blocks}"
            )
        blocks = owner.block_table[:num_blocks]
        self._check_owned(owner, blocks)
        for block in blocks:
            self._refs[block] += 1
        seq.block_table = list(blocks)

    # ---- release -----------------------------------------------------------------------------
    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free trailing blocks not needed for ``num_tokens`` positions (KV rollback of
        rejected drafts). num_cached_tokens is clipped to what is left."""
        if num_tokens < 0:
            raise EngineError(f"cannot trim sequence {seq.seq_id} to {num_tokens} tokens")
        keep = self.blocks_for_tokens(num_tokens)
        # Rolled-back positions hold stale KV even when no block is released.
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_tokens)
        if len(seq.block_table) <= keep:
            return
        tail = seq.block_table[keep:]
        self._check_owned(seq, tail)
        del seq.block_table[keep:]
        for block in reversed(tail):
            self._release(block)

    def free(self, seq: Sequence) -> None:
        """Return every block of ``seq``; its table is emptied and nothing is cached any more."""
        self._check_owned(seq, seq.block_table)
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def _check_owned(self, seq: Sequence, blocks: list[int]) -> None:
        # Checked before releasing anything, so a bad table never leaves the free list half-updated.
        if len(set(blocks)) != len(blocks):
            raise EngineError(f"sequence {seq.seq_id} lists a block twice: {blocks}")
        bad = [b for b in blocks if b not in self._refs]
        if bad:
            raise EngineError(
                f"sequence {seq.seq_id}: block(s) {bad} freed twice or never allocated"
                + (f" (block {self.dummy_block_id} is the reserved dummy block)" if self.dummy_block_id in bad else "")
            )

    def _release(self, block: int) -> None:
        """One owner fewer; the last one returns the block to the free list."""
        left = self._refs[block] - 1
        if left:
            self._refs[block] = left
            return
        del self._refs[block]
        self._free.appendleft(block)

    # ---- addressing ------------------------------------------------------------------------
    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slots of token positions start..end-1 of ``seq`` (int64)."""
        covered = len(seq.block_table) * self.block_size
        if not 0 <= start <= end <= covered:
            raise EngineError(
                f"sequence {seq.seq_id}: positions {start}..{end - 1} are outside its {covered} covered positions"
            )
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def dummy_slots(self, n: int) -> np.ndarray:
        """``n`` slots inside the reserved dummy block (for padded rows), cycling over its offsets."""
        if self.dummy_block_id is None:
            raise EngineError("this block manager reserves no dummy block")
        return self.dummy_block_id * self.block_size + np.arange(n, dtype=np.int64) % self.block_size
