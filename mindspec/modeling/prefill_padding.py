"""Prefills padded to a static shape, so that one compiled package (exported_step.py) serves every
prompt length of a bucket.

A prefill reads no cache: its keys are its own new tokens (``AttentionMetadata.is_prefill``), so
its shape is the sequences' row counts alone. Each sequence's rows are padded at their end to the
bucket (``pad_rows_per_seq``): padding rows repeat the sequence's last position, write no cache
entry (slot -1) and come after the real rows, so the causal mask keeps every real row from seeing
them, and their outputs are dropped. Block tables are cut or widened to the bucket's own width
(a prefill writes through its slots and reads no table). Each row bucket is one package per
batch size, compiled once its eager runs have cost a compile's time (eager_runs.py;
while serving, after ``export_after`` eager runs, in a worker); a batch padded to more than
PREFILL_MAX_ROWS rows, or to more than twice its rows plus PREFILL_MIN_ROWS (prompts of very
different lengths), runs eagerly. ``MINDSPEC_COMPILE_PREFILL=0`` runs every prefill eagerly
(compiled decode steps stay), ``=1`` compiles each bucket when first met.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mindspec.modeling.forward_metadata import ModelInputs
from mindspec.modeling.graph_runner import pad_rows_per_seq

PREFILL_MIN_ROWS = 16
PREFILL_MAX_ROWS = 512
PREFILL_ENV = "MINDSPEC_COMPILE_PREFILL"


@dataclass(frozen=True)
class PaddedPrefill:
    inputs: ModelInputs  # every sequence's rows padded to the bucket
    row_map: np.ndarray  # [T] int64: the padded row of each real row, in the batch's order


def compiled_prefill_rows() -> int:
    """The most rows a compiled prefill may have: PREFILL_MAX_ROWS, 0 with compiled prefills off."""
    return 0 if os.environ.get(PREFILL_ENV, "1") == "0" else PREFILL_MAX_ROWS


def prefill_rows_bucket(rows: int) -> int:
    """The padded rows per sequence of a prefill whose longest sequence has ``rows``: a multiple
    of PREFILL_MIN_ROWS up to 128, of 64 above (a step's GEMMs grow with its rows: padding 65
    rows to 128 would cost as much as the eager prefill saves)."""
    step = PREFILL_MIN_ROWS if rows <= 128 else 64
    return max(PREFILL_MIN_ROWS, -(-rows // step) * step)


def pad_prefill(inputs: ModelInputs, dummy_block: int, block_size: int,
                max_rows: int) -> Optional[PaddedPrefill]:
    """``inputs`` padded to its bucket, or None: run it eagerly (not a prefill, or too much padding)."""
    if not inputs.is_prefill or inputs.num_tokens == 0:
        return None
    rows = prefill_rows_bucket(int(inputs.q_lens.max()))
    total = rows * inputs.num_seqs
    if total > max_rows or total > 2 * inputs.num_tokens + PREFILL_MIN_ROWS:
        return None
    padded, row_map = pad_rows_per_seq(inputs, rows)
    width = -(-rows // block_size)
    tables = np.full((inputs.num_seqs, width), dummy_block, dtype=np.int32)
    keep = min(width, padded.block_tables.shape[1])
    tables[:, :keep] = padded.block_tables[:, :keep]
    return PaddedPrefill(padded.with_(block_tables=tables), row_map.astype(np.int64))
