"""Decode-step graph runner: pad a decode batch to a batch-size bucket, copy it into static
buffers, and replay one captured step per bucket (CUDA graphs), backend-agnostic.

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
- block tables are widened to a fixed width with the dummy block; a batch whose tables are wider,
  whose sequences have unequal q, that has a tree mask or is a prefill, is run eagerly.

Outputs are sliced back to the real rows (and cloned: the next replay overwrites them). With
``capture=False`` the runner does all of this but calls the step eagerly over the static
buffers: that is how it is tested on CPU, where no graphs exist.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from mindspec.backend import AttentionMetadata
from mindspec.modeling.forward_metadata import DeviceInputs

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ENV_SWITCH = "MINDSPEC_GRAPHS"  # "0" turns decode graphs off on a backend that supports them


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


def pad_inputs(inputs: DeviceInputs, spec: PadSpec, lm_rows_per_seq: int) -> DeviceInputs:
    """The forward of ``inputs`` with padding sequences appended (see the module docstring).

    Each padding sequence (not the slack one) contributes its last ``lm_rows_per_seq`` rows to
    lm_head_indices, so outputs keep the shape [num_seqs * lm_rows_per_seq, ...]."""
    meta = inputs.meta
    real_seqs, real_tokens = meta.q_lens.shape[0], inputs.input_ids.shape[0]
    if meta.block_tables.shape[1] > spec.width:
        raise ValueError(f"block tables of {meta.block_tables.shape[1]} columns exceed the padded width {spec.width}")
    pad_q = _pad_rows(spec, real_seqs, real_tokens)
    pad_seq_lens = [max(n, 1) for n in pad_q]
    pad_pos = [p for n in pad_q for p in range(n)]
    starts, lm_rows = [], []
    for b, n in enumerate(pad_q):
        start = real_tokens + sum(pad_q[:b])
        starts.append(start + n)
        if b < spec.num_seqs - real_seqs:
            lm_rows.extend(range(start + n - lm_rows_per_seq, start + n))
    dev = inputs.input_ids.device

    def tail(values, dtype):
        return torch.tensor(values, dtype=dtype, device=dev)

    pos = tail(pad_pos, torch.int64)
    tables = torch.full((real_seqs + len(pad_q), spec.width), spec.dummy_block, dtype=torch.int32, device=dev)
    tables[:real_seqs, : meta.block_tables.shape[1]] = meta.block_tables
    # replace() keeps every other field of the metadata (new ones included) as the real batch has it.
    padded_meta = replace(
        meta,
        slots=torch.cat([meta.slots, spec.dummy_block * spec.block_size + pos % spec.block_size]),
        block_tables=tables,
        seq_lens=torch.cat([meta.seq_lens, tail(pad_seq_lens, torch.int32)]),
        q_lens=torch.cat([meta.q_lens, tail(pad_q, torch.int32)]),
        q_start_loc=torch.cat([meta.q_start_loc, tail(starts, torch.int32)]),
        seq_lens_host=list(meta.seq_lens_host) + pad_seq_lens,
        q_lens_host=list(meta.q_lens_host) + pad_q,
        is_prefill=False,
        tree_mask=None,
        scratch={},
    )
    return DeviceInputs(
        input_ids=torch.cat([inputs.input_ids, torch.zeros(len(pad_pos), dtype=torch.int64, device=dev)]),
        positions=torch.cat([inputs.positions, pos]),
        meta=padded_meta,
        lm_head_indices=torch.cat([inputs.lm_head_indices, tail(lm_rows, torch.int64)]),
    )


def pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x [n, ...] -> [num_rows, ...], zero rows appended."""
    out = x.new_zeros((num_rows,) + tuple(x.shape[1:]))
    out[: x.shape[0]] = x
    return out


# ------------------------------------------------------------------------------------------
# Static buffers and captured steps
# ------------------------------------------------------------------------------------------


class StaticInputs:
    """Fixed-address copies of one padded DeviceInputs; ``load`` copies new values in place."""

    def __init__(self, template: DeviceInputs):
        m = template.meta
        self.inputs = DeviceInputs(
            input_ids=template.input_ids.clone(),
            positions=template.positions.clone(),
            meta=replace(
                m, slots=m.slots.clone(), block_tables=m.block_tables.clone(), seq_lens=m.seq_lens.clone(),
                q_lens=m.q_lens.clone(), q_start_loc=m.q_start_loc.clone(),
                seq_lens_host=list(m.seq_lens_host), q_lens_host=list(m.q_lens_host), scratch={},
            ),
            lm_head_indices=template.lm_head_indices.clone(),
        )

    def load(self, padded: DeviceInputs) -> None:
        s, m = self.inputs, padded.meta
        for dst, src in (
            (s.input_ids, padded.input_ids), (s.positions, padded.positions), (s.lm_head_indices, padded.lm_head_indices),
            (s.meta.slots, m.slots), (s.meta.block_tables, m.block_tables), (s.meta.seq_lens, m.seq_lens),
            (s.meta.q_lens, m.q_lens), (s.meta.q_start_loc, m.q_start_loc),
        ):
            if dst.shape != src.shape:
                raise ValueError(f"static buffer {tuple(dst.shape)} cannot hold {tuple(src.shape)}")
            dst.copy_(src, non_blocking=True)
        # Eager backends read the host lists; a captured graph never looks at them again.
        s.meta.seq_lens_host = list(m.seq_lens_host)
        s.meta.q_lens_host = list(m.q_lens_host)

    def reset_scratch(self) -> None:
        # Per-forward memos must be recomputed from the new values (and, during a capture, be
        # computed inside the graph so that replays recompute them).
        self.inputs.meta.scratch.clear()


class EagerStep:
    """Stands in for a captured graph: ``replay`` runs the step again over the static buffers."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.outputs = None

    def replay(self) -> None:
        self.outputs = self.fn()


@dataclass
class _Entry:
    statics: list[StaticInputs]
    extra: dict[str, torch.Tensor]  # other static tensors (hidden states, drafter lm rows)
    step: object = None  # EagerStep or the backend's captured graph

    def reset_scratch(self) -> None:
        for s in self.statics:
            s.reset_scratch()


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
    """Routes decode forwards of a ModelWrapper through padded static buffers and captured steps.

    The wrapper calls ``accepts`` first; the runner calls the wrapper's own forward for the step
    it captures, and ``accepts`` answers False while it does (no recursion)."""

    def __init__(self, wrapper, buckets=DEFAULT_BUCKETS, max_blocks_per_seq: Optional[int] = None, capture: bool = True):
        cc = wrapper.cache_config
        if cc is None:
            raise ValueError("the graph runner needs the KV cache allocated first")
        self.wrapper = wrapper
        self.buckets = tuple(sorted(buckets))
        self.capture = capture
        self.dummy_block = cc.dummy_block_id
        self.block_size = cc.block_size
        max_pos = getattr(wrapper.config, "max_position_embeddings", cc.num_blocks * cc.block_size)
        # + 1: MTP Eagle widens tables by a column for its shifted draft positions.
        self.width = max_blocks_per_seq or min(cc.num_blocks, -(-max_pos // cc.block_size)) + 1
        self.stats = RunnerStats()
        self._entries: dict[tuple, _Entry] = {}
        self._busy = False

    # ---- routing ---------------------------------------------------------------------------
    def bucket(self, num_seqs: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def _meta_ok(self, meta: AttentionMetadata, num_seqs: int) -> bool:
        return (
            not meta.is_prefill
            and meta.tree_mask is None
            and len(meta.q_lens_host) == num_seqs
            and meta.block_tables.shape[1] <= self.width
        )

    def accepts(self, inputs: DeviceInputs, sub_steps: Optional[list[DeviceInputs]] = None) -> bool:
        if self._busy:
            return False
        meta = inputs.meta
        num_seqs = len(meta.q_lens_host)
        if num_seqs == 0 or self.bucket(num_seqs) is None or not self._meta_ok(meta, num_seqs):
            return False
        if len(set(meta.q_lens_host)) != 1 or inputs.lm_head_indices.shape[0] % num_seqs:
            return False
        if sub_steps is not None:
            return all(self._meta_ok(s.meta, num_seqs) and s.lm_head_indices.shape[0] == num_seqs for s in sub_steps)
        return True

    # ---- plain decode ----------------------------------------------------------------------------
    def forward(self, inputs: DeviceInputs):
        meta = inputs.meta
        num_seqs, q = len(meta.q_lens_host), meta.q_lens_host[0]
        num_rows, lm_per_seq = inputs.input_ids.shape[0], inputs.lm_head_indices.shape[0] // num_seqs
        seqs = self.bucket(num_seqs)
        spec = PadSpec(seqs, q, seqs * q, self.width, self.dummy_block, self.block_size)
        padded = pad_inputs(inputs, spec, lm_per_seq)
        key = ("decode", seqs, q, lm_per_seq)
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry([StaticInputs(padded)], {})
            entry.step = self._make_step(key, entry, lambda: self.wrapper.forward(entry.statics[0].inputs))
            self._entries[key] = entry
        entry.statics[0].load(padded)
        out = self._replay(entry)
        return _sliced(out, inputs.lm_head_indices.shape[0], num_rows, None)

    # ---- MTP draft + verify ----------------------------------------------------------------------
    def forward_speculative(
        self,
        inputs: DeviceInputs,
        sub_steps: list[DeviceInputs],
        mtp_modules: list[int],
        hidden_states: torch.Tensor,
        lm_head_local_dp: torch.Tensor,
    ):
        meta = inputs.meta
        num_seqs, q = len(meta.q_lens_host), meta.q_lens_host[0]
        seqs = self.bucket(num_seqs)
        main_spec = PadSpec(seqs, q, seqs * q, self.width, self.dummy_block, self.block_size)
        sub_q = max(max(s.meta.q_lens_host) for s in sub_steps)
        per_seq = -(-sub_q // q) * q  # rows per sequence in the draft steps, a multiple of q
        sub_spec = PadSpec(seqs, q, seqs * per_seq, self.width, self.dummy_block, self.block_size, slack_seq=True)
        main = pad_inputs(inputs, main_spec, inputs.lm_head_indices.shape[0] // num_seqs)
        subs = [pad_inputs(s, sub_spec, 1) for s in sub_steps]
        hidden = pad_rows(hidden_states, sub_spec.num_tokens)
        # The drafter's lm_head rows of the padding sequences are theirs in the padded draft steps.
        lm_local = torch.cat([lm_head_local_dp, subs[0].lm_head_indices[num_seqs:]])
        key = ("speculative", seqs, q, per_seq, tuple(mtp_modules), inputs.lm_head_indices.shape[0] // num_seqs)
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry([StaticInputs(main)] + [StaticInputs(s) for s in subs],
                           {"hidden": hidden.clone(), "lm_local": lm_local.clone()})
            modules = list(mtp_modules)

            def step():
                statics = entry.statics
                return self.wrapper.forward_speculative(
                    statics[0].inputs, [s.inputs for s in statics[1:]], modules, entry.extra["hidden"], entry.extra["lm_local"]
                )

            entry.step = self._make_step(key, entry, step)
            self._entries[key] = entry
        for static, padded in zip(entry.statics, [main] + subs):
            static.load(padded)
        entry.extra["hidden"].copy_(hidden)
        entry.extra["lm_local"].copy_(lm_local)
        out = self._replay(entry)
        return _sliced(out, inputs.lm_head_indices.shape[0], inputs.input_ids.shape[0], num_seqs)

    # ---- capture and replay ----------------------------------------------------------------------
    def _make_step(self, key: tuple, entry: _Entry, fn: Callable[[], object]):
        def run():
            entry.reset_scratch()
            return fn()

        if not self.capture:
            return EagerStep(run)
        return _LazyCapture(self, key, run)

    def _replay(self, entry: _Entry):
        self._busy = True
        try:
            step = entry.step
            if isinstance(step, _LazyCapture):
                step = entry.step = step.capture()
            step.replay()
        finally:
            self._busy = False
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


def _sliced(out, num_logits: int, num_rows: int, num_seqs: Optional[int]):
    """The real rows of a padded step's output, copied out of the static buffers."""
    return replace(
        out,
        logits=out.logits[:num_logits].clone(),
        hidden_states=out.hidden_states[:num_rows].clone(),
        draft_tokens=None if num_seqs is None or out.draft_tokens is None else out.draft_tokens[:num_seqs].clone(),
    )


def maybe_graph_runner(wrapper) -> Optional[DecodeGraphRunner]:
    """A runner when the backend can capture graphs and MINDSPEC_GRAPHS is not "0"."""
    if not getattr(wrapper.backend, "supports_graph_capture", False):
        return None
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return None
    return DecodeGraphRunner(wrapper)
