"""Whole decode steps compiled ahead of time (AOTInductor), one per padded shape, cached on disk:
for backends whose ops run eagerly on the host (cpu).

At the shipped model's size a decode step is host dispatch: ~900 torch ops through Python for
~1 ms of arithmetic. Here the whole step, every layer and (for a speculative step) every MTP draft
stage plus the verification forward, is traced once with ``torch.export`` and compiled by
AOTInductor into one C++ function: no Python, no Dynamo guards and no per-op dispatch at run time.

Shapes. The graph runner (graph_runner.py) pads every decode batch to a batch-size bucket and
every MTP draft step's sequences to the same rows, so a step's token, sequence and lm_head row
counts are fixed per bucket; the context length is the one size that changes from step to step,
and the backend marks it dynamic (``step_tensors``). A prefill reads no cache, so one padded to
its row bucket (prefill_padding.py) has no dynamic size at all.

Cache. A package is keyed by the model (config.json and the weight files' names, sizes and
modification times), dtype, backend, thread count (generated loops are parallelised for it),
input shapes (the KV cache's included), torch version and the source of the model, the backend
and the backend interface; it lives in ``step_cache_dir()``: a restart loads it in milliseconds
instead of compiling again (tens of seconds per package on two cores). An unreadable package is
compiled again; the directory is kept under a size limit (step_cache.py). The weights are
constants inside the package. A package runs through its model library's C ABI with the GIL
released (aoti_runner.py), so async scheduling's host thread works while it computes; torch's
loader, which holds the GIL, where that does not apply.

With ``workers`` > 0 a shape not in the cache is exported and compiled in a worker process
(background_compiles.py), which loads the model itself from the step's recipe (step_recipes.py),
while the step runs eagerly; without, it is exported and compiled on the calling thread, the
step waiting for it (a prefill bucket, and the draft rows of a step catching MTP entries up,
only once its eager runs have cost as long: eager_runs.py).

Any failure (no C++ toolchain, an op export cannot trace) logs one warning per shape and that
shape runs eagerly from then on: serving never depends on the compiler.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from mindspec.modeling.aoti_runner import ReleasedRunner, open_released
from mindspec.modeling.background_compiles import DONE, PENDING, BackgroundCompiles
from mindspec.modeling.eager_runs import DEFAULT_COMPILE_S, EagerRuns, prefills_compile_at_once
from mindspec.modeling.gguf_file import split_files
from mindspec.modeling.graph_runner import catches_up
from mindspec.modeling.hidden_cache import speculative_step
from mindspec.modeling.launch_signal import LaunchSignal
from mindspec.modeling.model_path import is_gguf
from mindspec.modeling.prefill_padding import compiled_prefill_rows
from mindspec.modeling.random_checkpoint import MANIFEST
from mindspec.modeling.step_cache import cache_limit_bytes, mark_used, prune
from mindspec.modeling.step_accounting import outside_accounting
from mindspec.modeling.step_recipes import DECODE, PREFILL, PREFILL_MTP, SPECULATIVE, TREE, StepRecipe, trace_fn

log = logging.getLogger(__name__)

CACHE_ENV = "MINDSPEC_CACHE_DIR"
FORMAT = 3  # bump when what a package computes changes without the inputs of its key changing

# Every GEMM of a step is a choice between ATen's kernel and Inductor's C++ micro-GEMM template,
# timed at compile time. At a decode step's shapes (1-32 rows against a few hundred columns) the
# template's kernels, inlined into the package, run 2-8x faster than a library call (the shipped
# model's plain step: 1.2-1.3 ms against 2.0-2.5 ms), for ~3 s of compile time per GEMM shape.
# The timings stay out of the server's log. MINDSPEC_AUTOTUNE_GEMMS=0 leaves every GEMM to ATen:
# packages compile in about a third of the time and run slower.
INDUCTOR_CONFIGS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                    "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
AUTOTUNE_ENV = "MINDSPEC_AUTOTUNE_GEMMS"


def inductor_configs() -> dict:
    """The Inductor options packages compile with (part of their cache key)."""
    return {} if os.environ.get(AUTOTUNE_ENV) == "0" else dict(INDUCTOR_CONFIGS)


def compile_configs(kernels: dict) -> dict:
    """``inductor_configs`` and the backend's kernels' C shims (a fresh dict: torch adds to it)."""
    configs = inductor_configs()
    if kernels:
        configs["aot_inductor.custom_ops_to_c_shims"] = dict(kernels)
    return configs


def step_cache_dir() -> Path:
    """$MINDSPEC_CACHE_DIR, else $XDG_CACHE_HOME/mindspec, else ~/.cache/mindspec; then /steps."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mindspec")
    return Path(root) / "steps"


def model_fingerprint(model_dir: Path) -> str:
    """config.json's and a random-weights manifest's bytes, and each weight file's name, size
    and modification time (a GGUF model: each of its files')."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    for name in ("config.json", MANIFEST):
        f = model_dir / name
        h.update(f.read_bytes() if f.is_file() else b"")
    files = split_files(model_dir) if is_gguf(model_dir) else []
    for f in files + sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


@dataclass
class ExportStats:
    compiled: int = 0  # packages compiled by this process (or its workers)
    loaded: int = 0  # packages found in the cache directory
    failed: int = 0  # shapes that run eagerly after a failed export or compile
    compiling: int = 0  # shapes whose package a worker is compiling (they run eagerly meanwhile)
    calls: int = 0  # steps that ran compiled
    export_s: float = 0.0  # on the calling thread
    compile_s: float = 0.0  # export and compile on the calling thread, or a worker's wall time
    load_s: float = 0.0
    by_key: dict = field(default_factory=dict)  # package name -> "compiled" | "loaded" | "failed" | "compiling"


class _Graph(torch.nn.Module):
    """What export traces: ``run`` rebuilds the model's inputs from flat tensors and calls it."""

    def __init__(self, run: Callable):
        super().__init__()
        self.run = run

    def forward(self, *tensors):
        return self.run(*tensors)


@dataclass
class _Compiling:
    """A shape whose package a worker is compiling."""

    path: Path


class ExportedSteps:
    """The model's decode entry points (``forward``, ``forward_speculative``, ``forward_tree``)
    and its prefills (``forward_prefill``, ``forward_prefill_mtp``) as compiled packages, one per
    shape; callers pass bucket-padded inputs only (the graph runner, the model wrapper's prefills).
    ``workers`` > 0: compile new shapes in that many worker processes."""

    def __init__(self, model, backend, model_dir: Path, dtype: torch.dtype, workers: int = 0,
                 launch: Optional[LaunchSignal] = None):
        self.model, self.backend = model, backend
        self.launch = launch or LaunchSignal()  # fired as each step's package (or eager fallback) starts
        self.model_dir, self.dtype = Path(model_dir), dtype  # what a worker loads to export a step itself
        self.stats = ExportStats()
        # shape key -> loaded package, _Compiling, or None (eager)
        self._runners: dict[tuple, object] = {}
        self.background = BackgroundCompiles(workers, torch.get_num_threads()) if workers else None
        # Steps of a shape with no package run eagerly this many times before it is compiled: the
        # engine raises it after its warm-up, so that shapes met rarely while serving (long
        # catch-ups, passing batch sizes) cost no compile (minutes of a core, ~140 MB of cache).
        self.export_after = 1
        self._misses: dict[tuple, int] = {}  # shape key -> steps run eagerly without a package
        self.prefill_max_rows = compiled_prefill_rows()  # prefills padded to more rows run eagerly
        self.cache_limit = cache_limit_bytes()  # bytes of packages step_cache_dir() keeps
        # Without workers a prefill bucket, or a catch-up step's shape, compiles once its eager
        # runs have cost a compile's time.
        self.prefill_at_once = prefills_compile_at_once()
        self.eager_runs = EagerRuns()
        self._identity = {
            "format": FORMAT, "model": model_fingerprint(model_dir), "dtype": str(dtype),
            "backend": backend.name, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "code": _code_fingerprint(model, backend), "mtp_modules": model.num_mtp_modules,
            "inductor": inductor_configs(),
            "kernels": sorted(str(op) for op in backend.step_kernels()),  # builds and loads them
        }

    # ---- entry points --------------------------------------------------------------------------
    def forward(self, input_ids, positions, caches, meta, lm_head_indices, targets=None, keep=None):
        """A padded decode step; ``targets`` (``TargetRows.arrays()``): its rows' tokens sampled
        inside (``greedy_tokens``, -1 where undecided; else the argmax), a package of its own.
        ``keep`` (hidden cache, rows): the package writes its hidden states there
        (``keep_hidden_rows``; the cache's row count a dynamic size); run eagerly, the caller does."""
        from mindspec.models.deepseekv2.flash_causal_deepseekv2 import ModelOutput

        b = self.backend
        tree = [] if meta.tree_mask is None else [(meta.tree_mask, {})]  # a tree verification's mask
        sampling = [(t, {}) for t in targets or []]
        kept = [] if keep is None else [(keep[0], {0: "cache_rows"}), (keep[1], {})]
        tensors, dims = _flatten([
            (input_ids, {}), (positions, {}), (lm_head_indices, {}), *tree, *sampling, *kept,
            *b.step_tensors(meta, "m"), *b.cache_tensors(caches),
        ])
        key = (DECODE, _signature(tensors, dims)) + (("keep",) if kept else ())
        n_meta = len(tensors) - 3 - len(tree) - len(sampling) - len(kept) - len(caches)
        args = {"meta": meta, "n_meta": n_meta, "tree": bool(tree), "targets": bool(sampling), "keep": bool(kept)}
        outputs = self._run(key, args, caches, tensors, dims)
        if outputs is None:  # eagerly: the caller keeps and samples the targets (no greedy_tokens)
            return self.eagerly(lambda: self.model.forward(input_ids, positions, caches, meta, lm_head_indices))
        return ModelOutput(logits=outputs[0], hidden_states=outputs[1], greedy_tokens=outputs[2])

    def forward_prefill(self, input_ids, positions, caches, meta, lm_head_indices):
        """A prefill padded to its bucket (prefill_padding.py): every size static. None when no
        package runs it now: the caller runs the prefill eagerly, without the padding rows."""
        from mindspec.models.deepseekv2.flash_causal_deepseekv2 import ModelOutput

        tensors, meta_tensors = self._prefill_tensors(input_ids, positions, lm_head_indices, [], meta, caches)
        dims = _static(tensors)
        key = (PREFILL, _signature(tensors, dims))
        args = {"meta": meta, "n_meta": meta_tensors, "tree": False}
        outputs = self._run(key, args, caches, tensors, dims)
        return None if outputs is None else ModelOutput(logits=outputs[0], hidden_states=outputs[1])

    def forward_prefill_mtp(self, input_ids, positions, meta, lm_head_indices, mtp_modules, caches, next_tokens=None):
        """The model's ``forward_prefill_mtp`` over a padded prefill: the main model and every MTP
        module's pass over the prompt in one package; None as for ``forward_prefill``."""
        from mindspec.models.deepseekv2.flash_causal_deepseekv2 import ModelOutput

        extra = [] if next_tokens is None else [next_tokens]
        tensors, meta_tensors = self._prefill_tensors(input_ids, positions, lm_head_indices, extra, meta, caches)
        dims = _static(tensors)
        key = (PREFILL_MTP, _signature(tensors, dims), tuple(mtp_modules))
        args = {"meta": meta, "n_meta": meta_tensors, "mtp_modules": list(mtp_modules), "next_tokens": bool(extra)}
        outputs = self._run(key, args, caches, tensors, dims)
        return None if outputs is None else ModelOutput(logits=outputs[0], hidden_states=outputs[1])

    def _prefill_tensors(self, input_ids, positions, lm_head_indices, extra: list, meta, caches):
        """-> (the flat inputs: ids, positions, lm_head rows, ``extra``, metadata, caches; how many
        are metadata)."""
        b = self.backend
        meta_pairs = b.step_tensors(meta, "m")
        tensors, _ = _flatten([(input_ids, {}), (positions, {}), (lm_head_indices, {}), *[(t, {}) for t in extra],
                               *meta_pairs, *b.cache_tensors(caches)])
        return tensors, len(meta_pairs)

    def forward_speculative(self, input_ids, positions, meta, lm_head_indices, sub_input_ids, sub_hidden_states,
                            lm_head_local_dp, steps, caches, verify_source=None, hidden_cache=None):
        """``verify_source`` [R]: each verification row's token (the model's argument: sequences
        verifying host drafts beside MTP's); a package of its own. ``hidden_cache``
        (hidden_cache.DeviceHiddenCache) instead of ``sub_hidden_states``: the package reads the
        cache (its row count a dynamic size), accepts greedily and keeps the accepted rows' hidden
        states (none where every keep row is 0: the host accepts then)."""
        from mindspec.models.deepseekv2.flash_causal_deepseekv2 import ModelOutput

        b = self.backend
        main = b.step_tensors(meta, "m")
        per_step = [[(s.positions, {}), *b.step_tensors(s.meta, f"d{i}")] for i, s in enumerate(steps)]
        source = [] if verify_source is None else [(verify_source, {})]
        cache = [] if hidden_cache is None else hidden_cache.tensors()
        first = [(sub_hidden_states, {})] if hidden_cache is None else \
            [(cache[0], {0: "cache_rows"})] + [(t, {}) for t in cache[1:]]
        tensors, dims = _flatten([
            (input_ids, {}), (positions, {}), (lm_head_indices, {}), (sub_input_ids, {}), *first,
            (lm_head_local_dp, {}), *source, *main, *[t for s in per_step for t in s], *b.cache_tensors(caches),
        ])
        sizes = [len(main)] + [len(s) for s in per_step]
        key = (SPECULATIVE, _signature(tensors, dims), tuple(sizes),
               tuple((s.module_idx, s.lm_rows_only) for s in steps)) + (("source",) if source else ())
        args = {"meta": meta, "steps": [(s.module_idx, s.meta, s.lm_rows_only) for s in steps], "sizes": sizes,
                "verify_source": bool(source), "hidden_cache": len(cache)}
        passing = catches_up(sub_input_ids.shape[0] // lm_head_local_dp.shape[0])  # rows per sequence
        outputs = self._run(key, args, caches, tensors, dims, passing)
        if outputs is None:
            def run(hidden):
                return self.model.forward_speculative(input_ids, positions, meta, lm_head_indices, sub_input_ids,
                                                      hidden, lm_head_local_dp, steps, caches, verify_source=verify_source)

            if hidden_cache is None:
                return self.eagerly(lambda: run(sub_hidden_states))
            return self.eagerly(lambda: speculative_step(run, hidden_cache, self.backend.steps_branch, self.backend))
        accepted = {} if len(outputs) == 3 else {"greedy_tokens": outputs[3], "accepted_drafts": outputs[4]}
        return ModelOutput(logits=outputs[0], hidden_states=outputs[1], draft_tokens=outputs[2], **accepted)

    def forward_tree(self, drafter, main, steps, first_hidden, caches):
        """A padded tree step (tree_speculation.verify_tree) -> (ModelOutput, DraftTree). The
        tree masks are drafted inside the package: the metadata are planned with a stand-in mask
        (the plan exports the mask's columns; ``with_tree`` applies the real one inside)."""
        from mindspec.models.deepseekv2.flash_causal_deepseekv2 import ModelOutput
        from mindspec.modeling.tree_speculation import DraftTree, verify_tree

        b = self.backend
        for meta in [main.meta] + [s.inputs.meta for s in steps[1:]]:
            if meta.tree_mask is None:
                q = meta.max_q_len
                meta.tree_mask = torch.ones(meta.num_seqs, q, q, dtype=torch.bool, device=main.input_ids.device)
        per_step = [[(s.inputs.input_ids, {}), (s.inputs.positions, {}), (s.inputs.lm_head_indices, {}),
                     (s.window_src, {}), (s.window_lens, {}), (s.tree_first, {}), (s.root_src, {}),
                     (s.tree_visible, {}), *b.step_tensors(s.inputs.meta, f"d{i}")] for i, s in enumerate(steps)]
        main_meta = b.step_tensors(main.meta, "m")
        tensors, dims = _flatten([
            (main.input_ids, {}), (main.positions, {}), (main.lm_head_indices, {}), (first_hidden, {}),
            *main_meta, *[t for s in per_step for t in s], *b.cache_tensors(caches),
        ])
        sizes = [len(main_meta)] + [len(s) for s in per_step]
        key = (TREE, _signature(tensors, dims), tuple(sizes), drafter.shape.key, drafter.eagle,
               tuple(s.module_idx for s in steps))
        args = {"shape": drafter.shape, "eagle": drafter.eagle, "meta": main.meta,
                "steps": [(s.module_idx, s.inputs.meta) for s in steps], "sizes": sizes}
        outputs = self._run(key, args, caches, tensors, dims)
        if outputs is None:
            return self.eagerly(lambda: verify_tree(self.model, drafter, main, steps, first_hidden, caches))
        return ModelOutput(logits=outputs[0], hidden_states=outputs[1]), DraftTree(*outputs[2:])

    # ---- packages ------------------------------------------------------------------------------
    def _run(self, key: tuple, args: dict, caches: list, tensors: list[torch.Tensor], dims: list[dict],
             passing: bool = False):
        """The package's outputs for ``tensors``, or None: run this step eagerly. ``args``: what
        step_recipes.trace_fn builds the traced function of ``key[0]`` from. ``passing``: a shape
        met in passing (a catch-up step's)."""
        self.eager_runs.renting = None
        if key not in self._runners:
            if not self._due(key, passing):
                return None
            with outside_accounting():  # loading, exporting or compiling is no step's work
                self._runners[key] = self._package(key, args, caches, tensors, dims)
        runner = self._runners[key]
        if isinstance(runner, _Compiling):
            runner = self._runners[key] = self._arrived(runner)
        if runner is None or isinstance(runner, _Compiling):
            self.launch.fire()  # the caller runs the step eagerly
            return None
        self.stats.calls += 1
        with outside_accounting():
            if isinstance(runner, ReleasedRunner):
                return runner(*tensors, before_run=self.launch.fire)
            self.launch.fire()
            return runner(*tensors)

    def _due(self, key: tuple, passing: bool) -> bool:
        """Whether a shape met again is to be loaded or compiled now: at once when a package is
        in the cache, else from its ``export_after``-th step on; on the calling thread (no
        workers), a prefill bucket or a shape met in passing once its eager runs have cost what a
        compile takes (``eager_runs``)."""
        rented = not self.prefill_at_once if key[0] in (PREFILL, PREFILL_MTP) else passing
        if self.background is None and rented:
            return self.package_path(key).is_file() or self.eager_runs.due(key, self._compile_s())
        if self.export_after <= 1:
            return True
        seen = self._misses[key] = self._misses.get(key, 0) + 1
        return seen >= self.export_after or self.package_path(key).is_file()

    def eagerly(self, run: Callable):
        """``run()``, a step's eager fallback (a decode step's here, a prefill's in the model
        wrapper), its seconds credited to the shape ``_due`` turned down (the cpu backend runs
        eager ops synchronously: the wall time is the step's)."""
        start = time.perf_counter()
        out = run()
        self.eager_runs.ran_eagerly(time.perf_counter() - start)
        return out

    def _compile_s(self) -> float:
        """What compiling one more package is expected to take: this process's mean so far, else
        DEFAULT_COMPILE_S."""
        return self.stats.compile_s / self.stats.compiled if self.stats.compiled else DEFAULT_COMPILE_S

    def wait_for_compiles(self) -> None:
        """Block until the workers have compiled every shape met so far, and load the packages."""
        if self.background is None:
            return
        self.background.wait()
        for key, runner in self._runners.items():
            if isinstance(runner, _Compiling):
                self._runners[key] = self._arrived(runner)

    def close(self) -> None:
        if self.background is not None:
            self.background.close()

    def package_path(self, key: tuple) -> Path:
        blob = json.dumps({**self._identity, "key": key}, sort_keys=True, default=str)
        return step_cache_dir() / f"{key[0]}-{hashlib.sha256(blob.encode()).hexdigest()[:32]}.pt2"

    def _package(self, key: tuple, args: dict, caches: list, tensors: list[torch.Tensor], dims: list[dict]):
        path = self.package_path(key)
        try:
            if path.is_file():
                runner = self._load(path)
                if runner is not None:
                    self.stats.loaded += 1
                    self.stats.by_key[path.stem] = "loaded"
                    return runner
                path.unlink(missing_ok=True)  # unreadable (a torch or toolchain change, a cut write): compile again
                path.with_suffix(".so").unlink(missing_ok=True)
            if self.background is not None and _worker_can_load():
                return self._submit(path, self._recipe(key, args, caches, tensors, dims))
            start = time.perf_counter()
            program = _export(trace_fn(key[0], self.model, self.backend, caches, args), tensors, dims)
            self.stats.export_s += time.perf_counter() - start
            compile_package(program, path, self.backend.step_kernels())
            self.stats.compile_s += time.perf_counter() - start
            runner = open_released(path) or torch._inductor.aoti_load_package(str(path))
            self.stats.compiled += 1
            self.stats.by_key[path.stem] = "compiled"
            self._prune()
            return runner
        except Exception as exc:  # no toolchain, an untraceable op: run this shape eagerly
            return self._failed(path, first_line(exc))

    def _recipe(self, key: tuple, args: dict, caches: list, tensors: list[torch.Tensor], dims: list[dict]) -> StepRecipe:
        cache = caches[0]
        return StepRecipe(
            kind=key[0], args=args, inputs=tensors[: len(tensors) - len(caches)], dims=dims, signature=key[1],
            model_dir=str(self.model_dir), dtype=self.dtype, backend=self.backend.name,
            num_mtp_modules=self.model.num_mtp_modules, num_blocks=cache.num_blocks, block_size=cache.block_size,
            cache_dtype=cache.c_kv.dtype,
        )

    def _submit(self, path: Path, recipe: StepRecipe) -> _Compiling:
        """A worker exports and compiles the step: the calling thread only writes its recipe."""
        staged = path.parent / ".recipes" / f"{path.stem}.{os.getpid()}.recipe"
        staged.parent.mkdir(parents=True, exist_ok=True)
        recipe.save(staged)
        self.background.submit(staged, path)
        self.stats.compiling += 1
        self.stats.by_key[path.stem] = "compiling"
        log.info("compiling the %s step %s in a worker process; it runs eagerly until then", _kind(path), path.stem)
        return _Compiling(path)

    def _arrived(self, pending: _Compiling):
        """The loaded package once its worker is done; ``pending`` meanwhile; None if it failed."""
        state = self.background.state(pending.path)
        if state == PENDING:
            return pending
        self.stats.compiling -= 1
        job = self.background.jobs[pending.path]
        self.stats.compile_s += job.seconds
        runner = self._load(pending.path) if state == DONE else None
        if runner is None:
            return self._failed(pending.path, job.error or "no package")
        self.stats.compiled += 1
        self.stats.by_key[pending.path.stem] = "compiled"
        self._prune()
        log.info("the %s step %s compiled in %.0f s (worker process); it runs compiled from now on",
                 _kind(pending.path), pending.path.stem, job.seconds)
        return runner

    def _prune(self) -> None:
        """After a package is written: the cache cut back to its limit, sparing what this process runs."""
        prune(step_cache_dir(), self.cache_limit, [n for n, state in self.stats.by_key.items() if state != "failed"])

    def _failed(self, path: Path, reason: str) -> None:
        log.warning("compiling the %s step %s failed (%s); it runs eagerly", _kind(path), path.stem, reason)
        self.stats.failed += 1
        self.stats.by_key[path.stem] = "failed"
        return None

    def _load(self, path: Path):
        start = time.perf_counter()
        try:
            runner = open_released(path) or torch._inductor.aoti_load_package(str(path))
        except Exception as exc:
            log.warning("the compiled step %s cannot be loaded (%s); compiling it again", path, first_line(exc))
            return None
        self.stats.load_s += time.perf_counter() - start
        mark_used(path)
        return runner


def _worker_can_load() -> bool:
    """Whether a worker process loading the checkpoint gets this model: not with expert
    parallelism, where each rank holds a slice of the experts and calls collectives (such a
    step is compiled on the calling thread, if it exports at all)."""
    from mindspec.distributed import parallel_state

    return parallel_state.current().ep_size == 1


def export_recipe(recipe: StepRecipe) -> torch.export.ExportedProgram:
    """Export the step ``recipe`` describes, with the model loaded from its checkpoint and caches
    of the same shape (a compile worker's side of ``_submit``)."""
    from mindspec.backend import get_backend
    from mindspec.modeling.loader import read_hf_config
    from mindspec.modeling.registry import model_class, supported_model_types

    backend = get_backend(recipe.backend)
    model_type = read_hf_config(recipe.model_dir, supported_model_types())["model_type"]
    model = model_class(model_type).load(recipe.model_dir, backend, recipe.dtype, num_mtp_modules=recipe.num_mtp_modules,
                                         progress=False, keep_quantized=False)
    caches = model.allocate_caches(recipe.num_blocks, recipe.block_size, recipe.cache_dtype)
    tensors = [t.to(backend.device) for t in recipe.inputs] + [t for t, _ in backend.cache_tensors(caches)]
    if _signature(tensors, recipe.dims) != recipe.signature:
        raise ValueError(f"the rebuilt {recipe.kind} step's inputs {_signature(tensors, recipe.dims)} differ from "
                         f"the serving process's {recipe.signature}")
    return _export(trace_fn(recipe.kind, model, backend, caches, recipe.args), tensors, recipe.dims)


def _export(run: Callable, tensors: list[torch.Tensor], dims: list[dict]) -> torch.export.ExportedProgram:
    named: dict[str, torch.export.Dim] = {}
    spec = tuple({i: named.setdefault(n, torch.export.Dim(n, min=2, max=1 << 24)) for i, n in d.items()} or None
                 for d in dims)
    with torch.inference_mode(False), torch.no_grad():
        return torch.export.export(_Graph(run), tuple(tensors), dynamic_shapes=(spec,), strict=False)


# Deprecation warnings torch raises against its own code while compiling (a graph's deepcopy makes
# LeafSpecs; the GEMM timing reads a TypedStorage): nothing a user of mindspec can act on.
TORCH_COMPILE_NOISE = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (r"TypedStorage is deprecated", UserWarning),
)


def compile_package(program: torch.export.ExportedProgram, path: Path, kernels: dict) -> None:
    """AOTInductor-compile ``program`` into the package ``path``, written atomically (another
    process compiling the same step writes the same file); ``kernels``: the backend's
    ``step_kernels``, which the package calls directly."""
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        for message, category in TORCH_COMPILE_NOISE:
            warnings.filterwarnings("ignore", message=message, category=category)
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp),
                                                  inductor_configs=compile_configs(kernels))
    os.replace(tmp, path)
    log.info("compiled the %s step %s in %.1f s -> %s", _kind(path), path.name,
             time.perf_counter() - start, path)


def _kind(path: Path) -> str:
    """A package's step kind ("decode", "speculative", "tree"): the first part of its name."""
    return path.stem.split("-")[0]


def first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _signature(tensors: list[torch.Tensor], dims: list[dict]) -> tuple:
    """What a package is specialised on: each input's dtype and static sizes (-1: dynamic).
    Computed every step over ~40 tensors: dtypes stay objects (``package_path`` writes them as
    str, the same text) and shapes without dynamic dims are taken whole."""
    return tuple((t.dtype, tuple(-1 if i in d else n for i, n in enumerate(t.shape)) if d else tuple(t.shape))
                 for t, d in zip(tensors, dims))


def _static(tensors: list[torch.Tensor]) -> list[dict]:
    """No dynamic size: a padded prefill's every size is fixed by its bucket."""
    return [{} for _ in tensors]


def _flatten(pairs: list[tuple[torch.Tensor, dict]]) -> tuple[list[torch.Tensor], list[dict]]:
    return [t for t, _ in pairs], [d for _, d in pairs]


# Files of this package that no traced step runs (the host's padding, buffers, compile workers,
# accounting, converters): editing them leaves every package valid, so they are not part of the
# code fingerprint (tests/modeling/test_step_recipes.py checks that exports never run them).
HOST_ONLY_FILES = frozenset({
    "aoti_runner.py", "background_compiles.py", "compile_worker.py", "fp8_convert.py", "gguf_convert.py",
    "eager_runs.py", "graph_runner.py", "launch_signal.py", "packed_transfer.py", "prefill_padding.py",
    "random_checkpoint.py", "step_accounting.py", "step_cache.py", "tree_padding.py",
})


def fingerprinted_files(model, backend) -> list[Path]:
    """The source of what a package computes: the model's and the backend's packages, the backend
    interface, the expert-parallel routing the MoE layers call, this package (the steps' recipes,
    acceptance, the hidden cache, the weights' loaders) but its host-only files, and the sampler's
    (targets sampled inside a step)."""
    import inspect

    from mindspec import backend as interface
    from mindspec.distributed import expert_parallel, parallel_state
    from mindspec.text_generator.sampling import step_targets

    files = [Path(inspect.getfile(m)) for m in (interface, expert_parallel, parallel_state)]
    for module_file in (inspect.getfile(type(model)), inspect.getfile(type(backend)), __file__,
                        inspect.getfile(step_targets)):
        files += sorted(Path(module_file).parent.glob("*.py")) + sorted(Path(module_file).parent.glob("*.cpp"))
    here = Path(__file__).parent
    return [f for f in files if not (f.parent == here and f.name in HOST_ONLY_FILES)]


def _code_fingerprint(model, backend) -> str:
    """A hash of ``fingerprinted_files``: a source checkout edited in place changes it."""
    h = hashlib.sha256()
    for f in fingerprinted_files(model, backend):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()
