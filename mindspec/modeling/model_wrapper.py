"""ModelWrapper: binds a model to the backend chosen by config, owns its KV cache, warms it up.

MindIE's ATBModelWrapper equivalent: the generator hands it host inputs (``forward_host``,
``forward_speculative_host``: decode batches go to the graph runner where the backend captures
graphs) or device inputs (eager), and it calls the model with the caches; nothing above it knows
which backend or model class runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from mindspec.backend import Backend, LatentCache, get_backend, keep_hidden_rows
from mindspec.modeling.forward_metadata import DeviceInputs, ModelInputs, build_model_inputs, to_device
from mindspec.modeling.draft_rows import lm_rows_only_steps, on_lm_rows, verify_source
from mindspec.modeling.exported_step import ExportedSteps
from mindspec.modeling.graph_runner import DecodeGraphRunner, maybe_graph_runner
from mindspec.modeling.hidden_cache import DeviceHiddenCache, HiddenCacheRows, HiddenKeep, device_rows, speculative_step
from mindspec.modeling.launch_signal import LaunchSignal
from mindspec.modeling.packed_transfer import to_device_packed
from mindspec.modeling.loader import read_hf_config
from mindspec.modeling.prefill_padding import PaddedPrefill, pad_prefill
from mindspec.modeling.registry import model_class, supported_model_types
from mindspec.modeling.draft_tree import TreeShape
from mindspec.modeling.tree_speculation import TreeDrafter, TreeDraftStep, TreeStepHost, verify_tree
from mindspec.text_generator.sampling.step_targets import TargetRows, decided_targets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class CacheConfig:
    num_blocks: int
    block_size: int

    @property
    def dummy_block_id(self) -> int:
        """The last block is kept for dummy and padding inputs (MindIE does the same)."""
        return self.num_blocks - 1


class ModelWrapper:
    def __init__(
        self,
        model_dir: str | Path,
        backend: str | Backend = "cpu",
        dtype: str | torch.dtype = "bfloat16",
        num_mtp_modules: Optional[int] = 0,
        device: Optional[str] = None,
        progress: bool = True,
        decode_graphs: Optional[bool] = None,
        compile_workers: int = 0,
    ):
        self.model_dir = Path(model_dir)
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend, device)
        self.whole_rows = self.backend.steps_branch  # step_targets' whole-row thresholds
        self.dtype = parse_dtype(dtype)
        self.hf_config = read_hf_config(model_dir, supported_model_types())
        # Decode steps as captured graphs (graph_runner.py, set up with the cache) where the backend
        # captures them; where it exports whole steps instead (cpu), and when asked for, the graph
        # runner pads decode batches to buckets and each padded step runs as one compiled package
        # (exported_step.py), whose weights are baked in: quantized weights are then dequantized at load.
        capture = getattr(self.backend, "supports_graph_capture", False)
        export = bool(decode_graphs and not capture and getattr(self.backend, "supports_step_export", False))
        cls = model_class(self.hf_config["model_type"])
        self.model = cls.load(model_dir, self.backend, self.dtype, num_mtp_modules=num_mtp_modules, progress=progress,
                              keep_quantized=not export)
        self.caches: list[LatentCache] = []
        self.cache_config: Optional[CacheConfig] = None
        self.decode_graphs = decode_graphs
        self.graph_runner = None
        self.launch = LaunchSignal()  # fired when each step's work is handed to the device
        self.compiled = (ExportedSteps(self.model, self.backend, self.model_dir, self.dtype, compile_workers,
                                       launch=self.launch) if export else None)
        self._tree_drafters: dict[tuple, TreeDrafter] = {}

    @property
    def config(self):
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.backend.device

    # ---- cache ---------------------------------------------------------------------------------
    def bytes_per_block(self, block_size: int) -> int:
        return self.model.cache_bytes_per_token() * block_size

    def num_blocks_for(self, mem_bytes: int, block_size: int) -> int:
        return int(mem_bytes // self.bytes_per_block(block_size))

    def allocate_cache(self, num_blocks: int, block_size: int) -> CacheConfig:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.caches = self.model.allocate_caches(num_blocks, block_size)
        self.cache_config = CacheConfig(num_blocks, block_size)
        if self.compiled is not None:
            self.graph_runner = DecodeGraphRunner(self, capture=False, uniform_draft_rows=True)  # packages replace graphs
        elif self.decode_graphs is not False:
            self.graph_runner = maybe_graph_runner(self)  # None unless the backend captures graphs
        return self.cache_config

    # ---- forward -------------------------------------------------------------------------------
    def _prepare(self, *inputs: DeviceInputs) -> None:
        for x in inputs:
            self.backend.prepare(x.meta)

    def forward(self, inputs: DeviceInputs, padded: bool = False, targets: Optional[list[torch.Tensor]] = None,
                keep: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """One forward, eagerly; replayed graphs take host inputs: ``forward_host``. ``padded``:
        a decode step the graph runner padded to a bucket, which runs compiled where the backend
        exports steps. ``targets`` (``TargetRows.arrays()`` on the device, one row per logits
        row): the step also samples each row's token (``greedy_tokens``: the targets, or -1).
        ``keep`` (the drafter's hidden cache [R, hidden], rows [T] on the device): a step of one
        row per sequence also writes its hidden states there (``keep_hidden_rows``)."""
        self._prepare(inputs)
        args = (inputs.input_ids, inputs.positions, self.caches, inputs.meta, inputs.lm_head_indices)
        if self.compiled and padded:  # (fires the launch signal itself)
            out = self.compiled.forward(*args, targets=targets, keep=keep)
        else:
            self.launch.fire()
            out = self.model.forward(*args)
        if out.greedy_tokens is None:  # run eagerly (a package gives its tokens): keep and sample here
            if keep is not None:
                keep_hidden_rows(keep[0], out.hidden_states, keep[1])
            if targets is not None:
                out.greedy_tokens = decided_targets(out.logits, targets, self.whole_rows)
        return out

    def forward_host(self, inputs: ModelInputs, tree_mask: Optional[torch.Tensor] = None,
                     targets: Optional[TargetRows] = None, keep: Optional[HiddenKeep] = None):
        """``forward`` from host inputs: a decode batch the graph runner takes is padded and
        replayed, anything else moves to the device and runs eagerly."""
        if self.graph_runner is not None and self.graph_runner.accepts(inputs, tree_mask=tree_mask):
            return self.graph_runner.forward(inputs, tree_mask, targets, keep)
        if keep is not None:  # (a plain decode step: no prefill padding)
            (rows,) = to_device_packed([keep.rows], self.device)
            return self.forward(to_device(inputs, self.device), targets=self._device_targets(targets),
                                keep=(keep.buffer, rows))
        padded = self._padded_prefill(inputs) if tree_mask is None and targets is None else None
        if padded is not None:
            out = self._run_padded(padded, lambda x: self.compiled.forward_prefill(
                x.input_ids, x.positions, self.caches, x.meta, x.lm_head_indices))
            if out is not None:
                return out
        device_targets = self._device_targets(targets)
        return self._eagerly(padded, lambda: self.forward(to_device(inputs, self.device, tree_mask),
                                                          targets=device_targets))

    def _device_targets(self, targets: Optional[TargetRows]) -> Optional[list[torch.Tensor]]:
        return None if targets is None else to_device_packed(targets.arrays(), self.device)

    def _padded_prefill(self, inputs: ModelInputs) -> Optional[PaddedPrefill]:
        """``inputs`` padded to a compiled prefill's bucket, or None: it runs eagerly."""
        if self.compiled is None or not inputs.is_prefill:
            return None
        cc = self.cache_config
        return pad_prefill(inputs, cc.dummy_block_id, cc.block_size, self.compiled.prefill_max_rows)

    def _run_padded(self, padded: PaddedPrefill, run):
        """``run`` over the padded prefill's device inputs -> its output with the hidden states
        of the real rows only, in the batch's order (the logits are of its lm_head rows already);
        None when no package runs it now (the caller runs the unpadded prefill eagerly: padding
        rows cost as much as real ones there)."""
        x = to_device(padded.inputs, self.device)
        self._prepare(x)
        out = run(x)
        if out is not None:
            out.hidden_states = out.hidden_states[torch.from_numpy(padded.row_map).to(self.device)]
        return out

    def _eagerly(self, padded: Optional[PaddedPrefill], run):
        """``run()``; for a prefill with a bucket but no package its time goes to the bucket's
        eager seconds (eager_runs.py: a bucket compiles once they reach a compile's time)."""
        return run() if padded is None else self.compiled.eagerly(run)

    def lm_head_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[R, vocab] float32 logits of hidden states the model returned (after the final norm):
        the main model's lm_head, as its forward applies it at lm_head_indices."""
        return self.backend.linear(hidden_states, self.model.lm_head).float()

    def forward_mtp(self, module_idx: int, inputs: DeviceInputs, hidden_states: torch.Tensor):
        self._prepare(inputs)
        self.launch.fire()
        return self.model.forward_mtp(
            module_idx, inputs.input_ids, hidden_states, inputs.positions, self.caches, inputs.meta, inputs.lm_head_indices
        )

    def forward_prefill_mtp(self, inputs: DeviceInputs, mtp_modules: list[int],
                            next_tokens: Optional[torch.Tensor] = None):
        """``next_tokens`` [B, len(mtp_modules)]: the tokens after each sequence's last fed one
        where known (-1: the module's draft stands in)."""
        self._prepare(inputs)
        self.launch.fire()
        return self.model.forward_prefill_mtp(
            inputs.input_ids, inputs.positions, inputs.meta, inputs.lm_head_indices, mtp_modules, self.caches,
            next_tokens,
        )

    def forward_prefill_mtp_host(self, inputs: ModelInputs, mtp_modules: list[int],
                                 next_tokens: Optional[np.ndarray] = None):
        """``forward_prefill_mtp`` from host inputs: compiled, padded to its bucket, where the
        backend exports steps; eagerly otherwise."""
        nxt = None if next_tokens is None else torch.from_numpy(next_tokens).to(self.device)
        padded = self._padded_prefill(inputs)
        if padded is not None:
            out = self._run_padded(padded, lambda x: self.compiled.forward_prefill_mtp(
                x.input_ids, x.positions, x.meta, x.lm_head_indices, mtp_modules, self.caches, nxt))
            if out is not None:
                return out
        return self._eagerly(padded, lambda: self.forward_prefill_mtp(to_device(inputs, self.device), mtp_modules, nxt))

    def forward_speculative(
        self,
        inputs: DeviceInputs,
        sub_steps: list[DeviceInputs],
        mtp_modules: list[int],
        hidden_states: torch.Tensor,
        lm_head_local_dp: torch.Tensor,
        lm_rows_only: Optional[list[bool]] = None,  # per step: it runs on the lm_head rows alone (draft_rows.py)
        padded: bool = False,  # as in ``forward``
        verify_source: Optional[torch.Tensor] = None,  # [R]: ragged verification rows (decode_inputs.verify_source)
        draft_logits=None,  # rewrites each draft step's logits (flash_causal_deepseekv2.DraftLogits)
        hidden_cache: Optional[DeviceHiddenCache] = None,  # instead of hidden_states: read (and kept) inside
    ):
        from mindspec.models.deepseekv2.flash_causal_deepseekv2 import DraftStep

        self._prepare(inputs, *sub_steps)
        first = sub_steps[0]
        narrow = lm_rows_only or [False] * len(sub_steps)
        steps = [DraftStep(m, d.positions, d.meta, n) for m, d, n in zip(mtp_modules, sub_steps, narrow)]

        def run(hidden: torch.Tensor):
            return self.model.forward_speculative(
                inputs.input_ids, inputs.positions, inputs.meta, inputs.lm_head_indices, first.input_ids, hidden,
                lm_head_local_dp, steps, self.caches, verify_source=verify_source, draft_logits=draft_logits)

        if self.compiled and padded and draft_logits is None:
            return self.compiled.forward_speculative(
                inputs.input_ids, inputs.positions, inputs.meta, inputs.lm_head_indices, first.input_ids, hidden_states,
                lm_head_local_dp, steps, self.caches, verify_source=verify_source, hidden_cache=hidden_cache)
        self.launch.fire()
        return run(hidden_states) if hidden_cache is None else speculative_step(run, hidden_cache, self.whole_rows,
                                                                                 self.backend)

    def forward_speculative_host(
        self,
        inputs: ModelInputs,
        sub_steps: list[ModelInputs],
        mtp_modules: list[int],
        hidden_states: torch.Tensor,  # [sub rows, hidden] on the device
        lm_head_local_dp: np.ndarray,  # [B]
        lm_rows_only: Optional[list[bool]] = None,
        draft_logits=None,
        hidden_cache: Optional[HiddenCacheRows] = None,  # instead of hidden_states (modeling/hidden_cache.py)
    ):
        """``forward_speculative`` from host inputs (replayed when the graph runner takes them).
        Run eagerly, draft steps whose other rows write nothing run on the lm_head rows alone
        (``lm_rows_only``: that choice per step, made by the caller when ranks must agree on it;
        None: made from ``sub_steps``). ``draft_logits`` (structured output's masks, computed on
        the host between draft steps) runs the step eagerly."""
        if draft_logits is None and self.graph_runner is not None and self.graph_runner.accepts(inputs, sub_steps):
            return self.graph_runner.forward_speculative(inputs, sub_steps, mtp_modules, hidden_states, lm_head_local_dp,
                                                         hidden_cache)
        narrow = lm_rows_only_steps(sub_steps) if lm_rows_only is None else lm_rows_only
        steps = [to_device(on_lm_rows(s) if n else s, self.device) for s, n in zip(sub_steps, narrow)]
        source = verify_source(inputs.q_lens, len(sub_steps), inputs.drafts_in_inputs)
        lm, *rest = to_device_packed(
            [np.ascontiguousarray(lm_head_local_dp, dtype=np.int64)] + ([] if source is None else [source])
            + ([] if hidden_cache is None else device_rows(hidden_cache, inputs.q_start_loc[:-1])), self.device)
        if source is not None:
            source, rest = rest[0], rest[1:]
        cache = None if hidden_cache is None else DeviceHiddenCache.of(hidden_cache.buffer, rest)
        return self.forward_speculative(to_device(inputs, self.device), steps, mtp_modules, hidden_states, lm, narrow,
                                        verify_source=source, draft_logits=draft_logits, hidden_cache=cache)

    def forward_tree(self, main: DeviceInputs, steps: list[TreeDraftStep], hidden_states: torch.Tensor,
                     shape: TreeShape, eagle: bool, padded: bool = False):
        """Tree speculation (tree_speculation.py): draft a tree per sequence with the MTP steps,
        verify it -> (ModelOutput with logits of every verification row, DraftTree). ``padded``:
        a step the graph runner padded to a static shape, compiled where the backend exports steps."""
        key = (shape.key, eagle)
        drafter = self._tree_drafters.get(key)
        if drafter is None:
            drafter = self._tree_drafters[key] = TreeDrafter(self.model, shape, eagle)
        if self.compiled and padded:
            return self.compiled.forward_tree(drafter, main, steps, hidden_states, self.caches)
        self.launch.fire()
        return verify_tree(self.model, drafter, main, steps, hidden_states, self.caches)

    def forward_tree_host(self, inputs: ModelInputs, steps: list[TreeStepHost], hidden_states: torch.Tensor,
                          shape: TreeShape, eagle: bool):
        """``forward_tree`` from host inputs (padded and replayed when the graph runner takes them)."""
        if self.graph_runner is not None and self.graph_runner.accepts_tree(inputs, steps):
            return self.graph_runner.forward_tree(inputs, steps, hidden_states, shape, eagle)
        device_steps = [s.to_device(self.device) for s in steps]
        return self.forward_tree(to_device(inputs, self.device), device_steps, hidden_states, shape, eagle)

    def copy_cache_entries(self, src_slots: np.ndarray, dst_slots: np.ndarray, num_layers: int) -> None:
        """Cache entries src_slots[i] -> dst_slots[i] in the first ``num_layers`` caches (the main
        model's: an accepted tree path moved into the sequence's contiguous slots)."""
        if len(src_slots) == 0:
            return
        src = torch.from_numpy(np.ascontiguousarray(src_slots, dtype=np.int64)).to(self.device)
        dst = torch.from_numpy(np.ascontiguousarray(dst_slots, dtype=np.int64)).to(self.device)
        for cache in self.caches[:num_layers]:
            self.backend.copy_cache_entries(cache, src, dst)

    @torch.inference_mode()
    def warmup(self, num_tokens: int = 4, max_seqs: Optional[int] = None) -> None:
        """One dummy prefill written into the reserved block, so first-request latency is not the
        place where lazy initialisation happens; nothing of a real sequence is touched. With a
        graph runner and ``max_seqs``, also capture the plain decode step of every batch-size
        bucket up to ``max_seqs`` sequences (with exported steps: compile or load their packages)."""
        cc = self.cache_config
        n = max(1, min(num_tokens, cc.block_size))
        host = build_model_inputs([[0] * n], [0], [[cc.dummy_block_id]], cc.block_size)
        self.forward(to_device(host, self.device))  # eagerly: no package for a prompt no request has
        if self.graph_runner is not None and max_seqs:
            self.graph_runner.capture_decode_buckets(max_seqs)
        self.backend.synchronize()

