"""Automatic prefix caching: full KV blocks found again by their content (vLLM's scheme).

A full block's key chains the key of the block before it with the block's token ids and the
``context_tokens`` ids after it: block j of a sequence has key
``H(key[j-1], tokens[jB:(j+1)B], tokens[(j+1)B:(j+1)B+C])``. The context is there for the MTP
caches, whose entry at position i depends on tokens up to i + K (module s pairs position i with
token i+1+s): two prompts that share a block but continue differently would otherwise share MTP
entries made for the other continuation. Without a drafter C is 0.

A hash table (not a radix tree) because lookups walk one chain from the root and the block
manager already reference-counts blocks; a radix tree would add partial-block matches, which
this cache leaves out (the last partial block of a prefix is recomputed, so no block is ever
shared while someone writes into it, and no copy-on-write is needed).

Blocks that no sequence holds any more keep their key and wait in ``idle`` (least recently
released first) until the block manager needs them; the manager hands out never-cached free
blocks first and evicts idle ones only after that.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import numpy as np


@dataclass
class PrefixCacheStats:
    """Lookups at admission: prompt tokens asked for and found (cumulative since start)."""

    queries: int = 0  # sequences looked up
    query_tokens: int = 0  # their prompt tokens
    hit_tokens: int = 0  # tokens found cached
    query_blocks: int = 0  # full blocks that could have been found
    hit_blocks: int = 0
    evictions: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


def block_key(parent: Optional[bytes], tokens: Seq[int], context: Seq[int]) -> bytes:
    """The chained content key of one full block (sha256: a collision would serve wrong KV)."""
    h = hashlib.sha256(parent or b"root")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.asarray(context, dtype=np.int64).tobytes())
    return h.digest()


class PrefixCache:
    """``whole_chains``: register a block only under its own sequence's registered parent, so
    that every block of a chain is held by sequences starting with the chain's first block (dp:
    a block's KV lives on one rank, and ranks follow first blocks). Off, a sequence that computed
    a cached prefix again still registers what follows it (one device holds every block)."""

    def __init__(self, block_size: int, context_tokens: int = 0, whole_chains: bool = False):
        self.block_size = block_size
        self.context_tokens = context_tokens
        self.whole_chains = whole_chains
        self._block_of: dict[bytes, int] = {}  # key -> the one block registered for it
        self._key_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds, LRU first
        self.stats = PrefixCacheStats()

    # ---- keys ------------------------------------------------------------------------------------
    def keys(self, token_ids: Seq[int], num_blocks: int, known: Seq[bytes] = ()) -> list[bytes]:
        """Keys of blocks 0..num_blocks-1 of ``token_ids`` (``known``: keys already computed for
        its first blocks). Block j needs tokens up to (j+1)B + C."""
        bs, c = self.block_size, self.context_tokens
        if num_blocks * bs + c > len(token_ids):
            raise ValueError(f"{num_blocks} blocks need {num_blocks * bs + c} tokens, got {len(token_ids)}")
        keys = list(known[:num_blocks])
        for j in range(len(keys), num_blocks):
            end = (j + 1) * bs
            keys.append(block_key(keys[-1] if keys else None, token_ids[j * bs : end], token_ids[end : end + c]))
        return keys

    def full_blocks(self, num_tokens: int) -> int:
        """Whole blocks whose key a sequence of ``num_tokens`` known tokens can compute."""
        return max(0, num_tokens - self.context_tokens) // self.block_size

    # ---- lookup and registration -----------------------------------------------------------------
    def lookup(self, keys: Seq[bytes]) -> list[int]:
        """The registered blocks of the longest run of ``keys`` from the first."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def block_for(self, key: bytes) -> Optional[int]:
        return self._block_of.get(key)

    def register(self, block: int, key: bytes) -> None:
        """Make ``block`` the one found for ``key``, unless another block has it already (the
        first one stays) or this block is registered under another key."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def clear(self) -> list[int]:
        """Forget every key; returns the idle blocks (now plain free blocks)."""
        idle = list(self.idle)
        self._block_of.clear()
        self._key_of.clear()
        self.idle.clear()
        return idle

    # ---- idle blocks -------------------------------------------------------------------------------
    def release(self, block: int) -> bool:
        """The last holder let ``block`` go: True if the cache keeps it (registered), as the most
        recently used idle block."""
        if block not in self._key_of:
            return False
        self.idle[block] = None
        self.idle.move_to_end(block)
        return True

    def revive(self, block: int) -> None:
        """An idle block is held again (a prefix hit)."""
        del self.idle[block]

    def evict(self) -> int:
        """The least recently released idle block, forgotten and handed out."""
        block, _ = self.idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        self.stats.evictions += 1
        return block

    @property
    def num_registered(self) -> int:
        return len(self._key_of)

    def registered_blocks(self) -> list[int]:
        return sorted(self._key_of)

    def record_query(self, prompt_tokens: int, query_blocks: int, hit_blocks: int) -> None:
        s = self.stats
        s.queries += 1
        s.query_tokens += prompt_tokens
        s.query_blocks += query_blocks
        s.hit_blocks += hit_blocks
        s.hit_tokens += hit_blocks * self.block_size
