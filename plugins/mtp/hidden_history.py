"""The main model's hidden states that MTP keeps per sequence: the last ``keep`` positions of each,
in one ring buffer [slots, keep, hidden] that every sequence shares.

The first draft step of a decode feeds MTP module 0 the main hidden states of the positions whose
cache entries it writes, so a sequence must keep a short history (K - 1 entries MTP Vanilla
rewrites, plus the entries plain steps left to catch up). Kept as one tensor per sequence, every
step cost a cat and a slice per sequence and the gather a loop over sequences (0.34 ms of a 10.5 ms
plain step at batch 32); in one buffer, position p of the sequence in slot s lives at
[s, p % keep], and a step writes and reads all its rows with one indexing op each.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from mindspec.modeling.forward_metadata import token_positions


class HiddenHistory:
    def __init__(self, keep: int):
        self.keep = keep
        self.buf: Optional[torch.Tensor] = None  # [slots, keep, hidden]; allocated by the first add
        self._slots: dict[int, int] = {}
        self._free: list[int] = []

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
        seq_idx, rows = token_positions(first_rows, counts)
        _, positions = token_positions(first_positions, counts)
        s, p = self._index(slots[seq_idx], positions)
        self.buf[s, p] = hidden[torch.from_numpy(rows).to(hidden.device)].to(self.buf.dtype)

    def read(self, slots: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """[R, hidden]: position positions[r] of the sequence in slots[r], which must be one of
        its last ``keep`` written positions (an older one has been overwritten)."""
        s, p = self._index(slots, positions)
        return self.buf[s, p]

    def _index(self, slots: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.buf.device
        s = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(device)
        p = torch.from_numpy(np.mod(positions, self.keep).astype(np.int64)).to(device)
        return s, p

    def _reserve(self, slots: int, like: torch.Tensor) -> None:
        if self.buf is not None and self.buf.shape[0] >= slots:
            return
        grown = torch.zeros(max(slots, 2 * (0 if self.buf is None else self.buf.shape[0]), 8), self.keep, like.shape[-1],
                            dtype=like.dtype, device=like.device)
        if self.buf is not None:
            grown[: self.buf.shape[0]] = self.buf
        self.buf = grown
