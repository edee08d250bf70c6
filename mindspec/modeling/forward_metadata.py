"""Host-side model inputs (MindIE's ModelInput) and their move to the device.

Everything here is numpy and vectorised: the engine builds one ``ModelInputs`` per forward from
per-sequence lengths and block tables, and ``to_device`` turns it into the tensors and
AttentionMetadata the model consumes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import numpy as np
import torch

from mindspec.backend import AttentionMetadata
from mindspec.modeling.packed_transfer import to_device_packed


@dataclass
class ModelInputs:
    """One forward over a flat token-major batch; sequence b owns rows q_start[b]:q_start[b+1]."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64, -1 = do not write the cache
    block_tables: np.ndarray  # [B, max_blocks] int32 (padded with 0)
    seq_lens: np.ndarray  # [B] int32 tokens in the cache after this forward
    q_lens: np.ndarray  # [B] int32 new tokens per sequence
    lm_head_indices: np.ndarray  # [N] int64 rows that need logits
    is_prefill: bool  # no sequence has cached context
    block_size: int = 0  # tokens per cache block the slots and tables refer to
    # [B] bool, a verification's sequences whose draft rows carry their drafts in input_ids
    # (drafted on the host, e.g. suffix drafts) instead of taking the MTP drafts of this forward
    drafts_in_inputs: Optional[np.ndarray] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.q_lens.shape[0])

    @property
    def q_start_loc(self) -> np.ndarray:
        """[B + 1] int32 cumulative q_lens (read-only where kept: ``start_locations``)."""
        return start_locations(self.q_lens)

    def with_(self, **changes) -> "ModelInputs":
        """A copy with ``changes`` (dataclasses.replace's result, without its __init__ call: a
        decode step makes a dozen of these)."""
        if not changes.keys() <= _MODEL_INPUT_FIELDS:
            raise TypeError(f"ModelInputs has no field(s) {sorted(changes.keys() - _MODEL_INPUT_FIELDS)}")
        new = object.__new__(ModelInputs)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


_MODEL_INPUT_FIELDS = frozenset(f.name for f in fields(ModelInputs))


def pad_block_tables(block_tables: Sequence[Sequence[int]], min_width: int = 1) -> np.ndarray:
    """Ragged block tables -> [B, max_blocks] int32 padded with 0."""
    width = max([min_width, *(len(t) for t in block_tables)])
    out = np.zeros((len(block_tables), width), dtype=np.int32)
    for b, table in enumerate(block_tables):
        out[b, : len(table)] = table
    return out


def token_positions(start: np.ndarray, q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(seq index [T], position [T]) of tokens start[b] .. start[b] + q_lens[b] - 1 per sequence
    (the seq index shared and read-only: ``row_grid``)."""
    seq_idx, offsets = row_grid(q_lens)
    return seq_idx, np.asarray(start, dtype=np.int64)[seq_idx] + offsets


def row_grid(q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(seq index [T], row within its sequence [T]) of a flat batch of q_lens[b] rows per
    sequence, read-only. Decode steps repeat a few row counts, so theirs are kept per q_lens and
    shared: a step's host work is mostly numpy's per-call cost at these sizes. Prefills (many
    rows, lengths seldom repeated) are computed each time."""
    q_lens = np.asarray(q_lens, dtype=np.int64)
    if q_lens.size > GRID_CACHED_SEQS or (q_lens.size and q_lens.max() > GRID_CACHED_ROWS):
        return _row_grid(q_lens)
    return _cached_row_grid(q_lens.tobytes())


GRID_CACHED_SEQS, GRID_CACHED_ROWS = 256, 64  # at most 16K rows a grid, 256 grids


def start_locations(q_lens: np.ndarray) -> np.ndarray:
    """[B + 1] int32: 0, then the cumulative q_lens; kept per q_lens for decode steps (read-only),
    as ``row_grid``'s grids."""
    q_lens = np.asarray(q_lens)
    if q_lens.size > GRID_CACHED_SEQS:
        return _start_locations(q_lens)
    return _cached_start_locations(q_lens.astype(np.int64, copy=False).tobytes())


def _start_locations(q_lens: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)


@functools.lru_cache(maxsize=256)
def _cached_start_locations(q_key: bytes) -> np.ndarray:
    starts = _start_locations(np.frombuffer(q_key, dtype=np.int64))
    starts.setflags(write=False)
    return starts


@functools.lru_cache(maxsize=256)
def _cached_row_grid(q_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    return _row_grid(np.frombuffer(q_key, dtype=np.int64))


def _row_grid(q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    seq_idx = np.repeat(np.arange(len(q_lens)), q_lens)
    offsets = np.arange(len(seq_idx)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    seq_idx.setflags(write=False)
    offsets.setflags(write=False)
    return seq_idx, offsets


def slots_for(block_tables: np.ndarray, seq_idx: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """slot = block_tables[b, pos // block_size] * block_size + pos % block_size."""
    blocks = block_tables[seq_idx, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


def build_model_inputs(
    token_ids: Sequence[Sequence[int]],
    num_cached: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    lm_head_indices: Optional[np.ndarray] = None,
) -> ModelInputs:
    """Inputs for appending ``token_ids[b]`` after ``num_cached[b]`` cached tokens of sequence b.

    lm_head_indices defaults to the last new token of each sequence.
    """
    q_lens = np.array([len(t) for t in token_ids], dtype=np.int32)
    cached = np.asarray(num_cached, dtype=np.int64)
    tables = pad_block_tables(block_tables)
    seq_idx, positions = token_positions(cached, q_lens)
    if lm_head_indices is None:
        lm_head_indices = np.cumsum(q_lens, dtype=np.int64) - 1
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids]) if len(token_ids) else np.zeros(0, np.int64)
    return ModelInputs(
        input_ids=flat,
        positions=positions,
        slots=slots_for(tables, seq_idx, positions, block_size),
        block_tables=tables,
        seq_lens=(cached + q_lens).astype(np.int32),
        q_lens=q_lens,
        lm_head_indices=np.asarray(lm_head_indices, dtype=np.int64),
        is_prefill=bool((cached == 0).all()),
        block_size=block_size,
    )


def build_decode_inputs(last_tokens: Sequence[int], num_cached: Sequence[int],
                        block_tables: Sequence[Sequence[int]], block_size: int) -> ModelInputs:
    """``build_model_inputs`` for one new token per sequence (``last_tokens[b]`` at position
    ``num_cached[b]``): the same inputs from a few array ops, every decode step's."""
    positions = np.array(num_cached, dtype=np.int64)
    tables = pad_block_tables(block_tables)
    n = len(positions)
    rows = np.arange(n, dtype=np.int64)
    return ModelInputs(
        input_ids=np.array(last_tokens, dtype=np.int64),
        positions=positions,
        slots=slots_for(tables, rows, positions, block_size),
        block_tables=tables,
        seq_lens=(positions + 1).astype(np.int32),
        q_lens=np.ones(n, dtype=np.int32),
        lm_head_indices=rows,
        is_prefill=bool((positions == 0).all()),
        block_size=block_size,
    )


@dataclass
class DeviceInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    lm_head_indices: torch.Tensor  # [N] int64


NUM_INPUT_ARRAYS = 8  # what input_arrays returns per ModelInputs


def input_arrays(inputs: ModelInputs) -> list[np.ndarray]:
    """The NUM_INPUT_ARRAYS arrays a forward moves to the device, in ``device_inputs``' order and
    dtypes."""
    return [
        inputs.input_ids.astype(np.int64, copy=False), inputs.positions.astype(np.int64, copy=False),
        inputs.slots.astype(np.int64, copy=False), inputs.block_tables.astype(np.int32, copy=False),
        inputs.seq_lens.astype(np.int32, copy=False), inputs.q_lens.astype(np.int32, copy=False),
        inputs.q_start_loc, inputs.lm_head_indices.astype(np.int64, copy=False),
    ]


def to_device(inputs: ModelInputs, device: torch.device | str, tree_mask: Optional[torch.Tensor] = None) -> DeviceInputs:
    return device_inputs(to_device_packed(input_arrays(inputs), device), inputs, tree_mask)


def device_inputs(tensors: list[torch.Tensor], inputs: ModelInputs, tree_mask: Optional[torch.Tensor] = None) -> DeviceInputs:
    """DeviceInputs from the tensors of ``inputs``' arrays in to_device's order (host lists from
    ``inputs``)."""
    input_ids, positions, slots, block_tables, seq_lens, q_lens, q_start_loc, lm_head_indices = tensors
    meta = AttentionMetadata(
        slots=slots,
        block_tables=block_tables,
        seq_lens=seq_lens,
        q_lens=q_lens,
        q_start_loc=q_start_loc,
        seq_lens_host=inputs.seq_lens.tolist(),
        q_lens_host=inputs.q_lens.tolist(),
        is_prefill=inputs.is_prefill,
        tree_mask=tree_mask,
        block_size=inputs.block_size,
    )
    return DeviceInputs(input_ids=input_ids, positions=positions, meta=meta, lm_head_indices=lm_head_indices)
