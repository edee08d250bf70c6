"""Decode-step graph runner: pad a decode batch's host inputs to a batch-size bucket, copy them
into the bucket's static buffers in one transfer, and replay one captured step per bucket (CUDA
graphs), backend-agnostic.

A captured graph replays fixed shapes and fixed addresses, so every decode forward of a bucket
must look the same: ``num_seqs`` sequences of ``q`` new tokens each (plain decode: q = 1; MTP
verification: q = K + 1), and for the MTP draft steps a fixed number of rows. The real batch
occupies the first rows and sequences unchanged; the rest is padding:

- padding sequences have q new tokens at positions 0..q-1, seq_len q (>= 1, never 0: a length-0
  row would compute block_table[-1], a bug seen in peers), a block-table row made only of the
  reserved dummy block (``CacheConfig.dummy_block_id``, never given to a sequence) and slots in
  that block: they can read and write nothing but the dummy block;
- the MTP draft steps have a variable number of rows per sequence (MTP Vanilla re-writes history
  rows), so their row count is rounded up to a multiple of q per sequence and the slack goes to one
  extra padding sequence at the end (0 or more rows, same dummy-only block table);
- a verification forward whose sequences verify different numbers of drafts (unequal q, every
  row an lm_head row) has each sequence padded to the most rows (``pad_verify_rows``): padding
  rows come after a sequence's real rows, write nothing and are dropped from the outputs, so the
  shape depends on the batch size and the most drafts only;
- block tables are widened to a fixed width with the dummy block; a batch whose tables are wider,
  whose sequences have unequal q outside a verification, or is a prefill, is run eagerly;
- a tree verification of host drafts (Medusa) keeps its mask in a static buffer too; a tree
  speculation step (MTP draft trees) is padded by tree_padding.py to one shape per bucket.

Outputs are sliced back to the real rows (and cloned: the next replay overwrites them). With
``capture=False`` the runner does all of this but calls the step eagerly over the static
buffers: that is how it is tested on CPU, where no graphs exist.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Optional

import numpy as np
import torch

from mindspec.modeling.forward_metadata import (
    NUM_INPUT_ARRAYS, DeviceInputs, ModelInputs, build_model_inputs, device_inputs, input_arrays, token_positions,
)
from mindspec.modeling.hidden_cache import DeviceHiddenCache, HiddenCacheRows, HiddenKeep, device_rows
from mindspec.text_generator.sampling.step_targets import TargetRows
from mindspec.modeling.packed_transfer import PackedLayout, Staging, packed_span
from mindspec.modeling.step_accounting import outside_accounting

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ENV_SWITCH = "MINDSPEC_GRAPHS"  # "0" turns decode graphs off on a backend that supports them
MAX_VERIFY_ROWS = 16  # a sequence's last token and up to 15 drafts


# ------------------------------------------------------------------------------------------
# Padding
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PadSpec:
    """The static shape one bucket's forward is padded to."""

    num_seqs: int  # sequences after padding (the bucket), without the slack sequence
    q: int  # new tokens of each padding sequence
    num_tokens: int  # rows after padding
    width: int  # block-table columns
    dummy_block: int
    block_size: int
    slack_seq: bool = False  # one more sequence at the end takes the rows left over


def _pad_rows(spec: PadSpec, real_seqs: int, real_tokens: int) -> list[int]:
    """New-token counts of the padding sequences (and of the slack sequence, last)."""
    pad = [spec.q] * (spec.num_seqs - real_seqs)
    slack = spec.num_tokens - real_tokens - sum(pad)
    if slack < 0 or (slack and not spec.slack_seq):
        raise ValueError(f"{real_tokens} rows of {real_seqs} sequences do not fit the padded shape {spec}")
    return pad + [slack] if spec.slack_seq else pad


@dataclass(frozen=True)
class _Padding:
    """The rows and sequences ``pad_inputs`` appends; the same for every step of one shape."""

    positions: np.ndarray  # [P] padding rows' positions
    slots: np.ndarray  # [P] in the dummy block
    seq_lens: np.ndarray  # [S]
    q_lens: np.ndarray  # [S]
    lm_rows: np.ndarray  # [L] padding sequences' lm_head rows


@functools.lru_cache(maxsize=256)
def _padding(spec: PadSpec, real_seqs: int, real_tokens: int, lm_rows_per_seq: int) -> _Padding:
    pad_q = np.array(_pad_rows(spec, real_seqs, real_tokens), dtype=np.int32)
    _, pad_pos = token_positions(np.zeros(len(pad_q), dtype=np.int64), pad_q)
    ends = real_tokens + np.cumsum(pad_q, dtype=np.int64)  # one past each padding sequence's rows
    lm_ends = ends[: spec.num_seqs - real_seqs]  # the slack sequence has no lm_head rows
    padding = _Padding(
        positions=pad_pos,
        slots=spec.dummy_block * spec.block_size + pad_pos % spec.block_size,
        seq_lens=np.maximum(pad_q, 1),
        q_lens=pad_q,
        lm_rows=(lm_ends[:, None] + np.arange(-lm_rows_per_seq, 0)).reshape(-1),
    )
    for a in (padding.positions, padding.slots, padding.seq_lens, padding.q_lens, padding.lm_rows):
        a.setflags(write=False)  # shared by every step of the shape
    return padding


def pad_inputs(inputs: ModelInputs, spec: PadSpec, lm_rows_per_seq: int) -> ModelInputs:
    """The host inputs with padding sequences appended (see the module docstring).

    Each padding sequence (not the slack one) contributes its last ``lm_rows_per_seq`` rows to
    lm_head_indices, so outputs keep the shape [num_seqs * lm_rows_per_seq, ...]."""
    real_seqs, real_tokens = inputs.num_seqs, inputs.num_tokens
    if inputs.block_tables.shape[1] > spec.width:
        raise ValueError(f"block tables of {inputs.block_tables.shape[1]} columns exceed the padded width {spec.width}")
    pad = _padding(spec, real_seqs, real_tokens, lm_rows_per_seq)
    tables = np.full((real_seqs + len(pad.q_lens), spec.width), spec.dummy_block, dtype=np.int32)
    tables[:real_seqs, : inputs.block_tables.shape[1]] = inputs.block_tables
    if not len(pad.q_lens):  # the batch fills its bucket: only the tables widen
        return ModelInputs(
            input_ids=inputs.input_ids, positions=inputs.positions, slots=inputs.slots, block_tables=tables,
            seq_lens=inputs.seq_lens, q_lens=inputs.q_lens, lm_head_indices=inputs.lm_head_indices,
            is_prefill=False, block_size=inputs.block_size,
        )
    return ModelInputs(
        input_ids=np.concatenate([inputs.input_ids, np.zeros(len(pad.positions), dtype=np.int64)]),
        positions=np.concatenate([inputs.positions, pad.positions]),
        slots=np.concatenate([inputs.slots, pad.slots]),
        block_tables=tables,
        seq_lens=np.concatenate([inputs.seq_lens, pad.seq_lens], dtype=np.int32),
        q_lens=np.concatenate([inputs.q_lens, pad.q_lens], dtype=np.int32),
        lm_head_indices=np.concatenate([inputs.lm_head_indices, pad.lm_rows], dtype=np.int64),
        is_prefill=False,
        block_size=inputs.block_size,
    )


def pad_rows_per_seq(inputs: ModelInputs, rows: int) -> tuple[ModelInputs, np.ndarray]:
    """Every sequence's rows padded to ``rows`` at its end -> (inputs, new row of each old row [T]).

    The grid of the result is a reshape of the flat batch, and its shape no longer depends on how
    rows are spread over sequences. Padding rows repeat their sequence's last token position
    (always a valid rope row), write nothing (slot -1) and come after the real rows, so the causal
    mask keeps every real row from seeing them; their outputs are dropped."""
    spread = _row_spread(inputs.q_lens.astype(np.int64, copy=False).tobytes(), rows)
    if spread is None:  # already in shape (a steady speculative step's draft rows): nothing moves
        return inputs, np.arange(inputs.num_tokens)
    row_map = spread.row_map
    total = len(spread.q_lens) * rows
    ids = np.zeros(total, dtype=np.int64)
    ids[row_map] = inputs.input_ids
    positions = np.repeat(inputs.positions[spread.last_rows], rows)
    positions[row_map] = inputs.positions
    slots = np.full(total, -1, dtype=np.int64)
    slots[row_map] = inputs.slots
    padded = inputs.with_(
        input_ids=ids, positions=positions, slots=slots,
        seq_lens=(inputs.seq_lens + spread.added).astype(np.int32),
        q_lens=spread.q_lens,
        lm_head_indices=row_map[inputs.lm_head_indices],
    )
    return padded, row_map


@dataclass(frozen=True)
class _RowSpread:
    """Where ``pad_rows_per_seq`` puts each row of sequences of given q_lens (read-only)."""

    row_map: np.ndarray  # [T] new row of each old row
    last_rows: np.ndarray  # [B] each sequence's last old row
    added: np.ndarray  # [B] padding rows of each sequence
    q_lens: np.ndarray  # [B] int32, every one ``rows``


@functools.lru_cache(maxsize=256)
def _row_spread(q_key: bytes, rows: int) -> Optional[_RowSpread]:
    """Kept per (q_lens, rows): a speculative step's draft steps share their q_lens, and steps
    repeat them. None where every sequence has ``rows`` rows already."""
    q = np.frombuffer(q_key, dtype=np.int64)
    if (q < 1).any() or (q > rows).any():
        raise ValueError(f"q_lens {q.tolist()} do not fit {rows} rows per sequence")
    if (q == rows).all():
        return None
    num_seqs = len(q)
    seq_idx = np.repeat(np.arange(num_seqs), q)
    starts = np.cumsum(q) - q
    spread = _RowSpread(row_map=seq_idx * rows + np.arange(len(seq_idx)) - np.repeat(starts, q),
                        last_rows=starts + q - 1, added=rows - q, q_lens=np.full(num_seqs, rows, dtype=np.int32))
    for a in (spread.row_map, spread.last_rows, spread.added, spread.q_lens):
        a.setflags(write=False)
    return spread


def _pad_draft_steps(steps: list[ModelInputs], rows_per_seq: Optional[int],
                     spec: PadSpec) -> tuple[list[ModelInputs], Optional[np.ndarray]]:
    """Each draft step padded to ``spec`` (every sequence to ``rows_per_seq`` rows first, when
    given) -> (padded steps, new row of each old row or None). Only the first step's tokens are
    read (each later step's are rolled in on the device from the step before), so a step with
    the rows of the one before it (MTP Vanilla's share their arrays) is that step's padded
    inputs again: the static buffers then hold one copy of them (``StaticInputs``)."""
    padded: list[ModelInputs] = []
    row_map = None
    for i, step in enumerate(steps):
        if i and _same_rows(step, steps[i - 1]):
            padded.append(padded[-1])
            continue
        if rows_per_seq is not None:
            step, row_map = pad_rows_per_seq(step, rows_per_seq)
        padded.append(pad_inputs(step, spec, 1))
    return padded, row_map


def _same_rows(a: ModelInputs, b: ModelInputs) -> bool:
    """Every field but the tokens the same (arrays: the same objects)."""
    for name in _ROW_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is not y and (isinstance(x, np.ndarray) or isinstance(y, np.ndarray) or x != y):
            return False
    return True


_ROW_FIELDS = tuple(f.name for f in fields(ModelInputs) if f.name != "input_ids")


def host_verify_rows(rows: int, mtp_rows: int) -> int:
    """Rows per sequence of a speculative step whose sequences verify host drafts (suffix drafts,
    any number) beside MTP's: the MTP rows (K + 1) when they fit, else a multiple of 4, so that
    host draft counts share a few shapes."""
    return mtp_rows if rows <= mtp_rows else -(-rows // 4) * 4


def verify_source_rows(counts: np.ndarray, host: np.ndarray, num_seqs: int, rows: int, k: int) -> np.ndarray:
    """[num_seqs * rows] for a speculative step padded to ``rows`` rows per sequence: each row's
    token in ``cat(input_ids, drafts [num_seqs * k])`` (the model's ``verify_source``). Row j of
    sequence b is MTP draft j of b when 1 <= j <= counts[b] and b drafts with MTP, else its own
    input row (the fed token, a host draft, a padding row; padding sequences are all their own)."""
    b, j = np.divmod(np.arange(num_seqs * rows), rows)
    real = len(counts)
    mtp = np.zeros(num_seqs, dtype=bool)
    mtp[:real] = ~np.asarray(host, dtype=bool)
    n = np.zeros(num_seqs, dtype=np.int64)
    n[:real] = counts
    drafted = mtp[b] & (j >= 1) & (j <= n[b])
    return np.where(drafted, num_seqs * rows + b * k + j - 1, np.arange(num_seqs * rows)).astype(np.int64)


# Draft rows per sequence of any steady MTP step: MTP Vanilla's window is its K - 1 history
# entries and max(accepted, K + 1) new ones (decode_inputs.py), at most 2K (K <= 3: the MTP
# modules of DeepSeek-family checkpoints and the shipped model); MTP Eagle's max(accepted, K + 1),
# K + 1 (K <= 5). More only when a sequence accepted more than K + 1 tokens since its MTP caches
# were last written: a step catching them up after plain steps.
STEADY_DRAFT_ROWS = 6


def draft_rows_bucket(rows: int) -> int:
    """The padded rows per sequence of draft steps whose sequences need at most ``rows``:
    STEADY_DRAFT_ROWS, then a power of two. One bucket for every steady step makes a step's shape
    depend on its draft count alone: with adaptive speculation MTP Vanilla drafting k needs 2k
    rows after a step that drafted k, up to k + 3 after one that drafted more, and each count
    would be a shape of its own to compile, met first in the warm-up only in its transition form.
    A padding row costs a row of the one-layer draft stages. More rows come from catching up MTP
    entries (up to CATCH_UP + K), rare steps whose every row count would otherwise be a shape too."""
    if rows <= STEADY_DRAFT_ROWS:
        return STEADY_DRAFT_ROWS
    return 1 << (rows - 1).bit_length()


def catches_up(rows_per_seq: int) -> bool:
    """Whether draft steps of this many rows per sequence catch MTP entries up: steps that come
    after plain ones, a few dozen in a run, each row count a shape met in passing."""
    return rows_per_seq > STEADY_DRAFT_ROWS


def verifies_every_row(inputs: ModelInputs) -> bool:
    """Every row is an lm_head row, in order: a verification forward (each sequence's last token
    and its drafts), whose sequences may verify different numbers of drafts."""
    n = inputs.num_tokens
    return len(inputs.lm_head_indices) == n and bool((inputs.lm_head_indices == np.arange(n)).all())


def pad_verify_rows(inputs: ModelInputs, rows: Optional[int] = None) -> tuple[ModelInputs, np.ndarray]:
    """A verification forward with unequal q_lens -> every sequence padded to ``rows`` (default:
    the most any has; ``pad_rows_per_seq``), every padded row an lm_head row, and the new row of
    each old row [T]: the outputs' real rows are ``out[row_map]``, in the original order."""
    padded, row_map = pad_rows_per_seq(inputs, rows or int(inputs.q_lens.max()))
    return padded.with_(lm_head_indices=np.arange(padded.num_tokens, dtype=np.int64)), row_map


# ------------------------------------------------------------------------------------------
# Static buffers and captured steps
# ------------------------------------------------------------------------------------------


class StaticInputs:
    """Fixed-address device copies of one bucket's padded inputs (and extra int64 arrays), all in
    one buffer: ``load`` brings a step's values in with a single host-to-device copy."""

    def __init__(self, templates: list[ModelInputs], extras: list[np.ndarray], device: torch.device):
        arrays = self._arrays(templates, extras)
        self.layout = PackedLayout.of(arrays)
        self.staging = Staging(device)
        self.buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        # host memory already (cpu): each step's values are assigned into these, no staging copy
        self.host = self.layout.host_views(self.buffer) if self.buffer.device.type == "cpu" else None
        views = self.layout.views(self.buffer)
        n, at = NUM_INPUT_ARRAYS, 0
        self.inputs: list[DeviceInputs] = []
        for i, t in enumerate(templates):
            if i and t is templates[i - 1]:  # a step given twice: the same device inputs
                self.inputs.append(self.inputs[-1])
                continue
            self.inputs.append(device_inputs(views[at : at + n], t))
            at += n
        self.extras = views[at:]

    @staticmethod
    def _arrays(inputs: list[ModelInputs], extras: list[np.ndarray]) -> list[np.ndarray]:
        arrays: list[np.ndarray] = []
        for i, x in enumerate(inputs):
            if not (i and x is inputs[i - 1]):  # a step given twice (Vanilla's draft steps): its arrays once
                arrays += input_arrays(x)
        return arrays + [_extra(e) for e in extras]

    def load(self, padded: list[ModelInputs], extras: list[np.ndarray]) -> None:
        arrays = self._arrays(padded, extras)
        if self.host is not None and self.layout.fits(arrays):
            for view, values in zip(self.host, arrays):
                view[...] = values
        else:
            self.staging.send(self.layout, arrays, into=self.buffer)
        # Eager backends read the host lists; a captured graph never looks at them again.
        lists = {}
        for static, x in zip(self.inputs, padded):
            key = (id(x.seq_lens), id(x.q_lens))  # (draft steps share their lengths)
            if key not in lists:
                lists[key] = (x.seq_lens.tolist(), x.q_lens.tolist())
            static.meta.seq_lens_host, static.meta.q_lens_host = lists[key]

    def reset_scratch(self) -> None:
        # Per-forward memos must be recomputed from the new values (and, during a capture, be
        # computed inside the graph so that replays recompute them).
        for x in self.inputs:
            x.meta.scratch.clear()


class EagerStep:
    """Stands in for a captured graph: ``replay`` runs the step again over the static buffers."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.outputs = None

    def replay(self) -> None:
        self.outputs = self.fn()


@dataclass
class _Entry:
    statics: StaticInputs
    hidden: Optional[torch.Tensor] = None  # [rows, hidden] the draft steps' padded hidden states
    cache: Optional[torch.Tensor] = None  # or the hidden cache they are read from (hidden_cache.py)
    step: object = None  # EagerStep or the backend's captured graph

    def reset_scratch(self) -> None:
        self.statics.reset_scratch()


@dataclass
class RunnerStats:
    replays: int = 0
    captures: int = 0
    eager_fallbacks: int = 0  # captures that failed; that bucket then runs eagerly
    by_key: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------
# The runner
# ------------------------------------------------------------------------------------------


class DecodeGraphRunner:
    """Runs decode forwards of a ModelWrapper, given as host inputs, through padded static
    buffers and captured steps. The wrapper asks ``accepts`` first; what is refused runs eagerly.
    Padding happens on the host, so a step's device work outside the graph is one copy in, the
    replay, and copies of the real rows out."""

    def __init__(self, wrapper, buckets=DEFAULT_BUCKETS, max_blocks_per_seq: Optional[int] = None, capture: bool = True,
                 uniform_draft_rows: bool = False, max_verify_rows: int = MAX_VERIFY_ROWS):
        cc = wrapper.cache_config
        if cc is None:
            raise ValueError("the graph runner needs the KV cache allocated first")
        self.wrapper = wrapper
        self.buckets = tuple(sorted(buckets))
        self.capture = capture
        # Draft steps with every sequence padded to the same rows (pad_rows_per_seq) instead of
        # one slack sequence: fewer distinct shapes, for steps compiled per shape (exported_step.py).
        self.uniform_draft_rows = uniform_draft_rows
        self.max_verify_rows = max_verify_rows  # rows per sequence of a graph; more (a prompt's tail) run eagerly
        self.dummy_block = cc.dummy_block_id
        self.block_size = cc.block_size
        max_pos = getattr(wrapper.config, "max_position_embeddings", cc.num_blocks * cc.block_size)
        # + 1: MTP Eagle widens tables by a column for its shifted draft positions.
        self.width = max_blocks_per_seq or min(cc.num_blocks, -(-max_pos // cc.block_size)) + 1
        self.stats = RunnerStats()
        self._entries: dict[tuple, _Entry] = {}

    @property
    def num_graphs(self) -> int:
        """Steps captured (or, after a failed capture, set up eagerly) so far: one per shape key."""
        return len(self._entries)

    @property
    def shape_keys(self) -> list[tuple]:
        """The shape key of each step set up so far: ("decode", seqs, rows per sequence, lm_head
        rows per sequence) or ("speculative", ...)."""
        return list(self._entries)

    # ---- routing ---------------------------------------------------------------------------
    def bucket(self, num_seqs: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def _fits(self, inputs: ModelInputs, num_seqs: int) -> bool:
        return not inputs.is_prefill and inputs.num_seqs == num_seqs and inputs.block_tables.shape[1] <= self.width

    def accepts(self, inputs: ModelInputs, sub_steps: Optional[list[ModelInputs]] = None,
                tree_mask: Optional[torch.Tensor] = None) -> bool:
        num_seqs = inputs.num_seqs
        if num_seqs == 0 or self.bucket(num_seqs) is None or not self._fits(inputs, num_seqs):
            return False
        max_q = int(inputs.q_lens.max())
        if tree_mask is not None:  # a tree verification of host drafts (Medusa): every row, one row count
            return sub_steps is None and bool((inputs.q_lens == max_q).all()) and verifies_every_row(inputs)
        if max_q > self.max_verify_rows:
            return False
        if sub_steps is None and inputs.drafts_in_inputs is not None and inputs.drafts_in_inputs.any():
            return False  # host drafts beside MTP drafts come with draft steps (forward_speculative)
        ragged = bool((inputs.q_lens != max_q).any()) or len(inputs.lm_head_indices) % num_seqs != 0
        # A plain step feeds one token; more is a prompt's tail after a shared prefix (run eagerly)
        # unless every row feeds the lm_head: a verification.
        if (ragged or (sub_steps is None and max_q != 1)) and not verifies_every_row(inputs):
            return False

        if sub_steps is not None:
            return all(self._fits(s, num_seqs) and len(s.lm_head_indices) == num_seqs for s in sub_steps)
        return True

    def _spec(self, inputs: ModelInputs) -> PadSpec:
        seqs, q = self.bucket(inputs.num_seqs), int(inputs.q_lens[0])
        return PadSpec(seqs, q, seqs * q, self.width, self.dummy_block, self.block_size)

    def _entry(self, key: tuple, padded: list[ModelInputs], extras: list[np.ndarray], make_fn,
               cache: Optional[torch.Tensor] = None) -> _Entry:
        """``cache``: the drafter's hidden cache the step reads or writes (set before the step is made)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(StaticInputs(padded, extras, self.wrapper.device))
            entry.step = self._make_step(key, entry, make_fn(entry))
        entry.cache = cache  # (a step run eagerly or compiled reads it at each call: it may have moved)
        entry.statics.load(padded, extras)
        return entry

    def _drop_if_moved(self, key: tuple, cache: torch.Tensor) -> None:
        """A captured graph reads addresses: when the hidden cache grew into a new buffer, the
        step that uses it is captured again."""
        if self.capture and key in self._entries and self._entries[key].cache is not cache:
            del self._entries[key]

    # ---- plain decode ----------------------------------------------------------------------------
    def _uniform_rows(self, inputs: ModelInputs) -> tuple[ModelInputs, Optional[np.ndarray]]:
        """Unequal verification rows padded per sequence (pad_verify_rows), with their row map."""
        if (inputs.q_lens == inputs.q_lens[0]).all():
            return inputs, None
        return pad_verify_rows(inputs)

    def forward(self, inputs: ModelInputs, tree_mask: Optional[torch.Tensor] = None,
                targets: Optional[TargetRows] = None, keep: Optional[HiddenKeep] = None):
        """``tree_mask`` [B, q, q] on the device: a tree verification (the mask is a static buffer
        too; padding sequences attend causally). ``targets``: each logits row's token sampled
        inside the step too (padding rows greedy). ``keep``: a step of one row per sequence
        writes its hidden states into the drafter's hidden cache inside too (padding rows none)."""
        real, (inputs, row_map) = inputs, self._uniform_rows(inputs)
        num_seqs = inputs.num_seqs
        lm_per_seq = len(inputs.lm_head_indices) // num_seqs
        spec = self._spec(inputs)
        key = ("decode", spec.num_seqs, spec.q, lm_per_seq) + (("tree",) if tree_mask is not None else ()) \
            + (("sampled",) if targets is not None else ()) + (("keep",) if keep is not None else ())
        padded = pad_inputs(inputs, spec, lm_per_seq)
        extras = [] if targets is None else \
            targets.padded(len(padded.lm_head_indices), row_map, self.wrapper.config.vocab_size).arrays()
        if keep is not None:
            if spec.q != 1:
                raise ValueError("a step keeps its hidden states with one row per sequence")
            extras.append(np.pad(keep.rows, (0, spec.num_seqs - num_seqs)))  # padding sequences: row 0, none
            self._drop_if_moved(key, keep.buffer)

        def make_fn(e: _Entry):
            static = e.statics.inputs[0]
            if tree_mask is not None:
                causal = torch.ones(spec.q, spec.q, dtype=torch.bool, device=tree_mask.device).tril()
                static.meta.tree_mask = causal.expand(spec.num_seqs, -1, -1).clone()
            sampling = e.statics.extras[:4] if targets is not None else None
            rows = e.statics.extras[-1] if keep is not None else None
            return lambda: self.wrapper.forward(static, padded=True, targets=sampling,
                                                keep=None if rows is None else (e.cache, rows))

        entry = self._entry(key, [padded], extras, make_fn, None if keep is None else keep.buffer)
        if tree_mask is not None:
            entry.statics.inputs[0].meta.tree_mask[:num_seqs].copy_(tree_mask)
        out = self._replay(entry)
        return _sliced(out, len(real.lm_head_indices), real.num_tokens, None, row_map)

    def capture_decode_buckets(self, max_seqs: int) -> None:
        """Capture the plain decode step of every bucket up to the one holding ``max_seqs`` now,
        as vLLM captures its batch sizes at start-up: no request waits for a capture later. The
        stand-in sequences have one cached token in the dummy block and write only there."""
        last = self.bucket(max_seqs) or self.buckets[-1]
        for b in (b for b in self.buckets if b <= last):
            tables = [[self.dummy_block]] * b
            self.forward(build_model_inputs([[0]] * b, [1] * b, tables, self.block_size))

    # ---- MTP draft + verify ----------------------------------------------------------------------
    def forward_speculative(
        self,
        inputs: ModelInputs,
        sub_steps: list[ModelInputs],
        mtp_modules: list[int],
        hidden_states: Optional[torch.Tensor],  # [sub rows, hidden] on the device
        lm_head_local_dp: np.ndarray,  # [B] the drafter's lm_head rows
        hidden_cache: Optional[HiddenCacheRows] = None,  # instead of hidden_states (hidden_cache.py)
    ):
        k = len(sub_steps)
        host = inputs.drafts_in_inputs if inputs.drafts_in_inputs is not None and inputs.drafts_in_inputs.any() else None
        real = inputs
        if host is None:
            inputs, main_map = self._uniform_rows(inputs)
        else:  # host drafts (any number) beside MTP's: rows bucketed, each row's token chosen inside
            inputs, main_map = pad_verify_rows(inputs, host_verify_rows(int(inputs.q_lens.max()), k + 1))
        num_seqs, q = inputs.num_seqs, int(inputs.q_lens[0])
        sub_q = max(int(s.q_lens.max()) for s in sub_steps)
        # Rows per sequence in the draft steps: a multiple of q for the slack-sequence layout;
        # with uniform rows any count fits (draft_rows_bucket).
        per_seq = draft_rows_bucket(sub_q) if self.uniform_draft_rows else -(-sub_q // q) * q
        lm_per_seq = len(inputs.lm_head_indices) // num_seqs
        main_spec = self._spec(inputs)
        # uniform rows: every sequence per_seq rows; else q rows per padding sequence and the slack sequence
        sub_spec = PadSpec(main_spec.num_seqs, per_seq if self.uniform_draft_rows else q, main_spec.num_seqs * per_seq,
                           self.width, self.dummy_block, self.block_size, slack_seq=not self.uniform_draft_rows)
        sub_padded, row_map = _pad_draft_steps(sub_steps, per_seq if self.uniform_draft_rows else None, sub_spec)
        if row_map is not None:
            lm_head_local_dp = row_map[lm_head_local_dp]
        padded = [pad_inputs(inputs, main_spec, lm_per_seq)] + sub_padded
        # The drafter's lm_head rows of the padding sequences are theirs in the padded draft steps.
        lm_local = np.concatenate([lm_head_local_dp, padded[1].lm_head_indices[num_seqs:]])
        extras = [lm_local]
        if host is not None:
            extras.append(verify_source_rows(real.q_lens.astype(np.int64) - 1, host, main_spec.num_seqs, q, k))
        cached = 0 if hidden_cache is None else len(extras)  # where the hidden cache's rows start in extras
        if hidden_cache is not None:
            extras += device_rows(_padded_cache(hidden_cache, row_map, sub_spec.num_tokens, main_spec.num_seqs,
                                                len(padded[0].lm_head_indices), main_map, self.wrapper.config.vocab_size),
                                  np.arange(main_spec.num_seqs, dtype=np.int64) * q)
        sampled = hidden_cache is not None and hidden_cache.targets is not None  # targets sampled inside
        shared = tuple(p is before for p, before in zip(sub_padded[1:], sub_padded))  # the static buffers' layout
        key = ("speculative", main_spec.num_seqs, q, per_seq, tuple(mtp_modules), shared, lm_per_seq,
               hidden_cache is not None, host is not None) + (("sampled",) if sampled else ())
        modules = list(mtp_modules)
        buffer = None if hidden_cache is None else hidden_cache.buffer
        if buffer is not None:
            self._drop_if_moved(key, buffer)

        def make_fn(e: _Entry):
            statics = e.statics
            source = statics.extras[1] if host is not None else None
            if buffer is not None:
                return lambda: self.wrapper.forward_speculative(
                    statics.inputs[0], statics.inputs[1:], modules, None, statics.extras[0], padded=True,
                    verify_source=source, hidden_cache=DeviceHiddenCache.of(e.cache, statics.extras[cached:]))
            e.hidden = hidden_states.new_zeros((sub_spec.num_tokens, hidden_states.shape[1]))
            return lambda: self.wrapper.forward_speculative(
                statics.inputs[0], statics.inputs[1:], modules, e.hidden, statics.extras[0], padded=True,
                verify_source=source)

        entry = self._entry(key, padded, extras, make_fn, buffer)
        if buffer is None:
            rows = hidden_states.shape[0]
            if row_map is not None:  # padding rows keep finite values: zeros, then earlier steps' hidden states
                entry.hidden.index_copy_(0, torch.from_numpy(row_map.copy()).to(entry.hidden.device), hidden_states)
            else:
                entry.hidden[:rows].copy_(hidden_states)
                if rows < entry.hidden.shape[0]:
                    entry.hidden[rows:].zero_()
        out = self._replay(entry)
        return _sliced(out, len(real.lm_head_indices), real.num_tokens, num_seqs, main_map)

    # ---- tree speculation -------------------------------------------------------------------------
    def accepts_tree(self, inputs: ModelInputs, steps: list) -> bool:
        """A tree step (draft steps and verification) of a batch that fits a bucket and the width."""
        num_seqs = inputs.num_seqs
        return (num_seqs > 0 and self.bucket(num_seqs) is not None and self._fits(inputs, num_seqs)
                and all(self._fits(s.inputs, num_seqs) for s in steps))

    def forward_tree(self, inputs: ModelInputs, steps: list, hidden_states: torch.Tensor, shape, eagle: bool):
        """A tree step padded to its static shape (tree_padding.py) and replayed -> (ModelOutput
        of the real verification rows, DraftTree of the real sequences)."""
        from mindspec.modeling.tree_padding import TreePad, draft_rows, pad_tree_step, real_outputs
        from mindspec.modeling.tree_speculation import TreeDraftStep

        real_seqs, real_rows = inputs.num_seqs, inputs.num_tokens
        pad = TreePad(self.bucket(real_seqs), draft_rows(steps, shape.depth, eagle), shape.num_nodes + 1, self.width,
                      self.dummy_block, self.block_size)
        main, padded, hidden_map = pad_tree_step(inputs, steps, pad)
        # per draft step: window_src, window_lens, tree_first, root_src, then tree_visible (not step 0's: no tree)
        extras = [a for d, s in enumerate(padded) for a in
                  (s.window_src, s.window_lens, s.tree_first, s.root_src, *([s.tree_visible.reshape(-1)] if d else []))]
        modules = [s.module_idx for s in padded]
        tree_rows = [s.tree_visible.shape[1] for s in padded]
        key = ("tree", pad.num_seqs, pad.rows, shape.key, eagle)

        def make_fn(e: _Entry):
            e.hidden = hidden_states.new_zeros((padded[0].inputs.num_tokens, hidden_states.shape[1]))
            statics, seqs = e.statics, pad.num_seqs

            def run():
                device_steps, at = [], 0
                for d, (module, r) in enumerate(zip(modules, tree_rows)):
                    src, window, first, root = statics.extras[at : at + 4]
                    at += 4
                    visible = statics.extras[at].view(seqs, r).bool() if d else window.new_zeros((seqs, 0), dtype=torch.bool)
                    at += 1 if d else 0
                    device_steps.append(TreeDraftStep(module, statics.inputs[1 + d], src, window, first, root, visible))
                return self.wrapper.forward_tree(statics.inputs[0], device_steps, e.hidden, shape, eagle, padded=True)

            return run

        entry = self._entry(key, [main] + [s.inputs for s in padded], extras, make_fn)
        entry.hidden.index_copy_(0, torch.from_numpy(hidden_map).to(entry.hidden.device), hidden_states)
        out, tree = self._replay(entry)
        return real_outputs(out, tree, real_rows, real_seqs, copy=self._static(entry))

    # ---- capture and replay ----------------------------------------------------------------------
    def _make_step(self, key: tuple, entry: _Entry, fn: Callable[[], object]):
        def run():
            entry.reset_scratch()
            return fn()

        if not self.capture:
            return EagerStep(run)
        return _LazyCapture(self, key, lambda: _with_greedy(run()))

    @staticmethod
    def _static(entry: _Entry) -> bool:
        """Whether the entry's outputs live in buffers the next replay overwrites (a captured
        graph's), rather than tensors made fresh by each call."""
        return not isinstance(entry.step, EagerStep)

    def _replay(self, entry: _Entry):
        step = entry.step
        if isinstance(step, _LazyCapture):
            step = entry.step = step.capture()
        if isinstance(step, EagerStep):
            step.replay()  # (its forward fires the launch signal)
        else:
            with outside_accounting():  # a captured graph: its ops are not launched one by one
                step.replay()
            self.wrapper.launch.fire()  # queued on the device: the host is free until it reads the outputs
        self.stats.replays += 1
        return step.outputs


class _LazyCapture:
    """Captures on first use, once the static buffers hold real inputs (the capture's warm-up run
    is then a real, idempotent step)."""

    def __init__(self, runner: DecodeGraphRunner, key: tuple, fn: Callable[[], object]):
        self.runner, self.key, self.fn = runner, key, fn

    def capture(self):
        try:
            graph = self.runner.wrapper.backend.capture_graph(self.fn)
        except Exception as exc:  # a failed capture must not take serving down: run this bucket eagerly
            log.warning("graph capture of %s failed (%s); running it eagerly", self.key, exc, exc_info=True)
            self.runner.stats.eager_fallbacks += 1
            return EagerStep(self.fn)
        self.runner.stats.captures += 1
        self.runner.stats.by_key[self.key] = "captured"
        return graph


def _with_greedy(out):
    """A captured step's outputs with the argmax of its logits computed inside the graph, and a
    speculative step's drafts right after it in the same buffer: greedy sampling and acceptance
    then read both with one copy to the host (StepOutputs.greedy_host). A tree step's, and one
    whose acceptance packed them already (Backend.accept_and_pack), as they are."""
    if not hasattr(out, "greedy_tokens"):
        return out
    greedy = out.logits.argmax(dim=-1) if out.greedy_tokens is None else out.greedy_tokens  # [N]
    if out.draft_tokens is None:
        return replace(out, greedy_tokens=greedy)
    accepted = [] if out.accepted_drafts is None else [out.accepted_drafts.to(greedy.dtype)]
    if packed_span(greedy, out.draft_tokens, *accepted) is not None:
        return out
    packed = torch.cat([greedy, out.draft_tokens.reshape(-1).to(greedy.dtype), *accepted])  # [N + B * K (+ B)]
    n, d = greedy.shape[0], out.draft_tokens.numel()
    return replace(out, greedy_tokens=packed[:n], draft_tokens=packed[n : n + d].view(out.draft_tokens.shape),
                   accepted_drafts=packed[n + d :] if accepted else None)


def _sliced(out, num_logits: int, num_rows: int, num_seqs: Optional[int], row_map: Optional[np.ndarray] = None):
    """The real rows of a padded step's output. ``row_map``: a verification padded per sequence,
    whose real rows (logits and hidden states alike: every row is an lm_head row) are gathered
    back in their original order. Rows of a captured graph's outputs are views of its static
    buffers, valid until the runner's next step: an engine step consumes them (sampling,
    verification, the drafter's caches) before the next one runs."""
    index = None if row_map is None else torch.from_numpy(row_map.copy()).to(out.logits.device, non_blocking=True)

    def rows(t: Optional[torch.Tensor], n: int, per_token: bool = True) -> Optional[torch.Tensor]:
        if t is None:
            return None
        return t.index_select(0, index) if per_token and index is not None else t[:n]

    return replace(
        out,
        logits=rows(out.logits, num_logits),
        hidden_states=rows(out.hidden_states, num_rows),
        draft_tokens=None if num_seqs is None else rows(out.draft_tokens, num_seqs, False),
        greedy_tokens=rows(out.greedy_tokens, num_logits),
        accepted_drafts=None if num_seqs is None else rows(getattr(out, "accepted_drafts", None), num_seqs, False),
    )


def _extra(a: np.ndarray) -> np.ndarray:
    """An extra input as a step takes it: float32 as it is (sampling inputs), the rest int64."""
    return a if a.dtype == np.float32 else a.astype(np.int64, copy=False)


def _padded_cache(cache: HiddenCacheRows, row_map: Optional[np.ndarray], rows: int, num_seqs: int,
                  logits_rows: int, logits_map: Optional[np.ndarray], vocab_size: int) -> HiddenCacheRows:
    """``cache``'s rows for a step padded to ``rows`` draft rows (``row_map``: each real row's
    padded row), ``num_seqs`` sequences and ``logits_rows`` verification rows (``logits_map``:
    each real one's padded row): padding rows read the zero row, padding sequences verify
    nothing and keep nothing, padding verification rows sample greedily."""
    read = np.zeros(rows, dtype=np.int64)
    if row_map is None:
        read[: len(cache.read_rows)] = cache.read_rows
    else:
        read[row_map] = cache.read_rows
    counts = np.zeros(num_seqs, dtype=np.int64)
    counts[: len(cache.counts)] = cache.counts
    keep = np.zeros((num_seqs, cache.keep_rows.shape[1]), dtype=np.int64)
    keep[: len(cache.keep_rows)] = cache.keep_rows
    targets = None if cache.targets is None else cache.targets.padded(logits_rows, logits_map, vocab_size)
    return replace(cache, read_rows=read, counts=counts, keep_rows=keep, targets=targets)


def maybe_graph_runner(wrapper) -> Optional[DecodeGraphRunner]:
    """A runner when the backend can capture graphs and MINDSPEC_GRAPHS is not "0"."""
    if not getattr(wrapper.backend, "supports_graph_capture", False):
        return None
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return None
    return DecodeGraphRunner(wrapper)
