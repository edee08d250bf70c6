"""Paged KV accounting: blocks of ``block_size`` tokens, slot = block_id * block_size + offset.

The last block (``num_blocks - 1``) is reserved for dummy and padding inputs, as MindIE does, and
is never given to a sequence: padded rows of a batch write their KV there without touching a live
sequence. Host-side only: the block manager never touches the cache tensors.

Blocks are reference counted: a sequence may share the full prompt blocks of another sequence
with the same prompt (``share``, n > 1 completions) instead of computing them again. A block goes
back to the free list when its last owner frees it, so preempting, aborting or finishing either
owner never takes blocks from the other. Only blocks that no owner writes again are shared (the
scheduler picks them: positions before the last prompt tokens and drafts).

With a ``PrefixCache`` (prefix_cache.py), full blocks whose KV is final are registered under a
key of their content (``publish``) and found again by later sequences (``cached_prefix``,
``take_cached``); when their last holder releases them they stay cached, idle, and are evicted
least recently used first, only once no never-cached block is free.

Coverage rule used by every method: a block table "covers" ``n`` token positions when
``len(block_table) * block_size >= n``; positions are 0-based, so covering ``n`` means positions
0..n-1 have slots.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

from .errors import EngineError
from .prefix_cache import PrefixCache
from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, reserve_dummy_block: bool = True,
                 prefix_cache: Optional[PrefixCache] = None):
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
        if prefix_cache is not None and prefix_cache.block_size != block_size:
            raise EngineError(f"the prefix cache keys {prefix_cache.block_size}-token blocks, the KV cache has {block_size}")
        self.prefix_cache = prefix_cache

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
        return self.num_free_blocks + len(self._refs)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can be given now: never-cached ones and idle cached ones."""
        return len(self._free) + self.num_idle_blocks

    @property
    def num_idle_blocks(self) -> int:
        """Cached blocks nobody holds (evicted when needed)."""
        return len(self.prefix_cache.idle) if self.prefix_cache is not None else 0

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
        return self.blocks_missing(seq, seq.num_tokens + num_lookahead) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Cover all of seq's tokens plus ``num_lookahead`` positions (prefill)."""
        self.ensure(seq, seq.num_tokens + num_lookahead)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_missing(seq, seq.num_tokens + num_new_tokens) <= self.num_free_blocks

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
        if missing > self.num_free_blocks:
            raise EngineError(
                f"sequence {seq.seq_id} needs {missing} more block(s) for {num_tokens} tokens, "
                f"{self.num_free_blocks} free"
            )
        for _ in range(missing):
            block = self._free.popleft() if self._free else self.prefix_cache.evict()
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

    # ---- prefix cache ----------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence, max_tokens: int) -> tuple[list[bytes], list[int]]:
        """(keys, blocks): the cached blocks that hold ``seq``'s first positions, at most
        ``max_tokens`` of them, and the keys of its whole blocks up to there. Takes nothing."""
        cache = self.prefix_cache
        if cache is None:
            return [], []
        n = min(cache.full_blocks(seq.num_tokens), max(0, max_tokens) // self.block_size)
        keys = cache.keys(seq.token_ids, n, seq.block_keys)
        if len(keys) > len(seq.block_keys):
            seq.block_keys = keys  # content keys: computed once while the sequence waits
        return keys, cache.lookup(keys)

    def is_idle(self, block: int) -> bool:
        """A cached block nobody holds (taking it uses up a free block)."""
        return block not in self._refs

    def take_cached(self, seq: Sequence, keys: list[bytes], blocks: list[int]) -> None:
        """Start ``seq``'s empty table with cached ``blocks`` (its first positions' KV, final)."""
        if seq.block_table:
            raise EngineError(f"sequence {seq.seq_id} already holds blocks; only an empty table takes cached ones")
        for block in blocks:
            if block in self._refs:
                self._refs[block] += 1
            else:
                self.prefix_cache.revive(block)
                self._refs[block] = 1
        seq.block_table = list(blocks)
        seq.block_keys = list(keys)

    def publish(self, seq: Sequence, num_final_tokens: int) -> None:
        """Register ``seq``'s whole blocks below position ``num_final_tokens`` (KV final in every
        cache) so later sequences find them; a key already registered keeps its block. With
        ``whole_chains`` (dp) a block is registered only under a registered parent that is
        ``seq``'s own block before it: a chain's blocks are then all held by sequences that
        start with the chain's first block, on that block's rank."""
        cache = self.prefix_cache
        if cache is None:
            return
        n = min(cache.full_blocks(seq.num_tokens), num_final_tokens // self.block_size, len(seq.block_table))
        if n <= seq.published_blocks:
            return
        keys = seq.block_keys = cache.keys(seq.token_ids, n, seq.block_keys)
        table = seq.block_table
        for j in range(seq.published_blocks, n):
            if cache.block_for(keys[j]) == table[j]:
                continue  # found in the cache at admission, or registered before
            if cache.whole_chains and j and cache.block_for(keys[j - 1]) != table[j - 1]:
                break  # the chain through this sequence's blocks ended
            cache.register(table[j], keys[j])
        seq.published_blocks = n

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (held ones stay with their holders); returns how many were
        registered."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        registered = cache.num_registered
        self._free.extendleft(cache.clear())
        return registered

    # ---- release -----------------------------------------------------------------------------
    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free trailing blocks not needed for ``num_tokens`` positions (KV rollback of
        rejected drafts). num_cached_tokens is clipped to what is left."""
        if num_tokens < 0:
            raise EngineError(f"cannot trim sequence {seq.seq_id} to {num_tokens} tokens")
        keep = self.blocks_for_tokens(num_tokens)
        # Rolled-back positions hold stale KV even when no block is released.
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_tokens)
        seq.published_blocks = min(seq.published_blocks, keep)
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
        seq.published_blocks = 0

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
        if self.prefix_cache is None or not self.prefix_cache.release(block):
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
