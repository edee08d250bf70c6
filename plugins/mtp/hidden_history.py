"""The main model's hidden states that MTP keeps per sequence: the last ``keep`` positions of each,
in one ring buffer [slots, keep, hidden] that every sequence shares.

The first draft step of a decode feeds MTP module 0 the main hidden states of the positions whose
cache entries it writes, so a sequence must keep a short history (K - 1 entries MTP Vanilla
rewrites, plus the entries plain steps left to catch up). Kept as one tensor per sequence, every
step cost a cat and a slice per sequence and the gather a loop over sequences (0.34 ms of a 10.5 ms
plain step at batch 32); in one buffer a step writes and reads all its rows with one indexing
op each. The buffer is flat, [1 + slots * keep, hidden]: position p of the sequence in slot s
lives at row 1 + s * keep + p % keep, and row 0 stays zero for the rows a read marks invalid
(padding), so a read is one gather with one index array (one host-to-device copy on a GPU).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from mindspec.modeling.forward_metadata import token_positions
from mindspec.modeling.packed_transfer import Staging, to_device_packed


class HiddenHistory:
    def __init__(self, keep: int):
        self.keep = keep
        self.buf: Optional[torch.Tensor] = None  # [1 + capacity * keep, hidden]; allocated by the first add
        self.capacity = 0  # slots the buffer holds
        self._slots: dict[int, int] = {}
        self._free: list[int] = []
        # host buffers of the index copies of reads and of writes (allocated with the buffer)
        self._read_staging: Optional[Staging] = None
        self._write_staging: Optional[Staging] = None

    def add(self, seq_id: int, like: torch.Tensor) -> int:
        """A slot for ``seq_id`` (its old one if it has one), in a buffer of ``like``'s width,
        dtype and device."""
        slot = self._slots.get(seq_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[seq_id] = slot
        self._reserve(slot + 1, like)
        return slot

    def remove(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def write(self, slots: np.ndarray, first_positions: np.ndarray, counts: np.ndarray,
              hidden: torch.Tensor, first_rows: np.ndarray) -> None:
        """Per sequence b (slot slots[b]): hidden rows first_rows[b] .. + counts[b] - 1 are the
        states of positions first_positions[b] .. + counts[b] - 1 (all [B] int64 arrays)."""
        if counts.min(initial=1) == 1 and counts.max(initial=1) == 1:  # one row each (plain steps)
            dst, src = self.rows(slots, first_positions), first_rows
        else:
            over = np.maximum(counts - self.keep, 0)  # only the last ``keep`` positions are kept: distinct rows
            first_rows, first_positions, counts = first_rows + over, first_positions + over, counts - over
            seq_idx, src = token_positions(first_rows, counts)
            _, positions = token_positions(first_positions, counts)
            dst = self.rows(slots[seq_idx], positions)
        if len(src) == hidden.shape[0] and bool((src == np.arange(len(src))).all()):  # every row, in order
            (dst,) = to_device_packed([dst], self.buf.device, self._write_staging)
            kept = hidden
        else:
            dst, src = to_device_packed([dst, src], self.buf.device, self._write_staging)
            kept = hidden.index_select(0, src)
        self._put(dst, kept)

    def write_rows(self, slots: list[int], positions: list[int], hidden: torch.Tensor) -> None:
        """One row per sequence (a plain step's): hidden row b [B, hidden] is the state of
        position positions[b] of the sequence in slot slots[b]."""
        (dst,) = to_device_packed([self.rows_of(slots, positions)], self.buf.device, self._write_staging)
        self._put(dst, hidden)

    def rows_of(self, slots: list[int], positions: list[int]) -> np.ndarray:
        """``rows`` of one position per sequence, in Python ints: at a few sequences numpy's
        per-call cost would be most of it (a plain step's write, or the rows it keeps itself)."""
        return np.array([1 + s * self.keep + p % self.keep for s, p in zip(slots, positions)], dtype=np.int64)

    def _put(self, dst: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [R, hidden] into buffer rows dst [R] (on the buffer's device), in its dtype."""
        self.buf.index_copy_(0, dst, rows if rows.dtype == self.buf.dtype else rows.to(self.buf.dtype))

    def read(self, slots: np.ndarray, positions: np.ndarray, valid: Optional[np.ndarray] = None) -> torch.Tensor:
        """[R, hidden]: position positions[r] of the sequence in slots[r], which must be one of
        its last ``keep`` written positions (an older one has been overwritten); zeros where
        ``valid`` [R] is False."""
        (index,) = to_device_packed([self.rows(slots, positions, valid)], self.buf.device, self._read_staging)
        return self.buf.index_select(0, index)

    def rows(self, slots: np.ndarray, positions: np.ndarray, valid: Optional[np.ndarray] = None) -> np.ndarray:
        """The buffer rows of (slots, positions) (any equal shapes), 0 (the zero row) where
        ``valid`` is False: what ``read`` gathers, for a step that reads (or writes) them itself."""
        rows = 1 + np.asarray(slots, dtype=np.int64) * self.keep + np.mod(positions, self.keep).astype(np.int64)
        return rows if valid is None else np.where(valid, rows, 0)

    def _reserve(self, slots: int, like: torch.Tensor) -> None:
        if self.buf is not None and self.capacity >= slots:
            return
        capacity = max(slots, 2 * self.capacity, 8)
        grown = torch.zeros(1 + capacity * self.keep, like.shape[-1], dtype=like.dtype, device=like.device)
        if self.buf is not None:
            grown[: self.buf.shape[0]] = self.buf  # slot s keeps its rows: they depend on keep only
        else:
            self._read_staging, self._write_staging = Staging(like.device), Staging(like.device)
        self.buf, self.capacity = grown, capacity
