"""What a compiled step traces, as a recipe a compile worker can rebuild on its own.

A package is a traced function of flat tensors (exported_step.py): it rebinds the forward's
metadata and caches from them and calls the model. The function is built here from a step's
kind and its arguments (the metadata templates, the MTP modules of each draft stage, a tree's
shape), given a model, a backend and caches. The serving process builds it for a step it
exports itself; for one a worker process exports, it saves a ``StepRecipe`` (those arguments,
example inputs, and how to load the model) and the worker loads the model, allocates caches of
the same shape and traces the same function: a shape first met while serving then costs the
serving thread a file write, not an export (seconds of tracing).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

import torch

from mindspec.backend import AttentionMetadata, keep_hidden_rows
from mindspec.modeling.hidden_cache import DeviceHiddenCache, speculative_step
from mindspec.text_generator.sampling.step_targets import decided_targets

DECODE, SPECULATIVE, TREE = "decode", "speculative", "tree"
PREFILL, PREFILL_MTP = "prefill", "prefill_mtp"  # padded prefills (prefill_padding.py)


@dataclass
class StepRecipe:
    """One step to export in a worker process: ``trace_fn(kind, model, backend, caches, args)``
    over ``inputs`` followed by the caches' tensors."""

    kind: str
    args: dict  # the kind's arguments (``trace_fn``), metadata templates included
    inputs: list[torch.Tensor]  # example inputs before the caches'
    dims: list[dict]  # dynamic dimensions of every input, the caches' included
    signature: tuple  # what the package is specialised on (exported_step._signature): checked on rebuild
    # how the worker gets the same model and caches
    model_dir: str
    dtype: torch.dtype
    backend: str
    num_mtp_modules: int
    num_blocks: int
    block_size: int
    cache_dtype: torch.dtype

    def save(self, path: Path) -> None:
        torch.save(portable(self), str(path))

    @staticmethod
    def load(path: Path) -> "StepRecipe":
        recipe = torch.load(str(path), weights_only=False)
        if not isinstance(recipe, StepRecipe):
            raise ValueError(f"{path} holds a {type(recipe).__name__}, not a step recipe")
        return recipe


def trace_fn(kind: str, model, backend, caches: list, args: dict) -> Callable:
    """The function a package of ``kind`` computes, over flat tensors."""
    builders = {DECODE: _decode, PREFILL: _decode, PREFILL_MTP: _prefill_mtp, SPECULATIVE: _speculative, TREE: _tree}
    if kind not in builders:
        raise ValueError(f"unknown step kind {kind!r}")
    return builders[kind](model, backend, caches, **args)


def _decode(model, b, caches, meta: AttentionMetadata, n_meta: int, tree: bool, targets: bool = False,
            keep: bool = False) -> Callable:
    """A plain decode step (``tree``: a tree verification's mask comes first after the inputs);
    it also gives each logits row's argmax (greedy sampling's token, no op after the step), or
    with ``targets`` (TargetRows.arrays() after the mask) each row's sampled token
    (step_targets.decided_targets). ``keep``: the drafter's hidden cache and each row's cache row
    come next, and the step writes its hidden states there (keep_hidden_rows)."""

    def run(ids, pos, lm, *rest):
        if tree:
            mask, rest = rest[0], rest[1:]
        sampling, rest = (rest[:4], rest[4:]) if targets else (None, rest)
        kept, rest = (rest[:2], rest[2:]) if keep else (None, rest)
        m = b.bind_step_tensors(meta, list(rest[:n_meta]))
        if tree:
            m.tree_mask = mask
        out = model.forward(ids, pos, b.bind_cache_tensors(caches, list(rest[n_meta:])), m, lm)
        if kept is not None:
            keep_hidden_rows(kept[0], out.hidden_states, kept[1])
        tokens = (out.logits.argmax(dim=-1) if sampling is None
                  else decided_targets(out.logits, sampling, b.steps_branch))
        return out.logits, out.hidden_states, tokens

    return run


def _prefill_mtp(model, b, caches, meta: AttentionMetadata, n_meta: int, mtp_modules: list[int],
                 next_tokens: bool) -> Callable:
    """A prefill of the main model and the MTP modules (``next_tokens``: the known next tokens
    come first after the lm_head rows)."""

    def run(ids, pos, lm, *rest):
        nxt, rest = (rest[0], rest[1:]) if next_tokens else (None, rest)
        m = b.bind_step_tensors(meta, list(rest[:n_meta]))
        cs = b.bind_cache_tensors(caches, list(rest[n_meta:]))
        out = model.forward_prefill_mtp(ids, pos, m, lm, mtp_modules, cs, nxt)
        return out.logits, out.hidden_states

    return run


def _speculative(model, b, caches, meta: AttentionMetadata, steps: list[tuple], sizes: list[int],
                 verify_source: bool = False, hidden_cache: int = 0) -> Callable:
    """Every MTP draft stage and the verification. ``steps``: (module, metadata, lm_rows_only) of
    each draft stage; ``sizes``: how many step tensors the verification and each stage take;
    ``verify_source``: each verification row's token source comes after the drafter's lm_head
    rows (sequences verifying host drafts, flash_causal_deepseekv2.forward_speculative);
    ``hidden_cache``: how many tensors stand for the first stage's hidden states (0: the states
    themselves; 5: the hidden cache and its rows, hidden_cache.DeviceHiddenCache.tensors), and
    then the greedy targets and accepted drafts come out too (hidden_cache.speculative_step)."""
    from mindspec.models.deepseekv2.flash_causal_deepseekv2 import DraftStep

    def run(ids, pos, lm, sub_ids, *rest):
        n = max(1, hidden_cache)
        first, (lm_local, *rest) = rest[:n], rest[n:]
        source = None
        if verify_source:
            source, rest = rest[0], rest[1:]
        parts, at = _split(rest, sizes)
        m = b.bind_step_tensors(meta, parts[0])
        draft_steps = [DraftStep(module, p[0], b.bind_step_tensors(step_meta, p[1:]), narrow)
                       for (module, step_meta, narrow), p in zip(steps, parts[1:])]
        cs = b.bind_cache_tensors(caches, list(rest[at:]))

        def forward(hidden):
            return model.forward_speculative(ids, pos, m, lm, sub_ids, hidden, lm_local, draft_steps, cs,
                                             verify_source=source)

        if not hidden_cache:
            out = forward(first[0])
            return out.logits, out.hidden_states, out.draft_tokens
        out = speculative_step(forward, DeviceHiddenCache.of(first[0], list(first[1:])), b.steps_branch, b)
        return out.logits, out.hidden_states, out.draft_tokens, out.greedy_tokens, out.accepted_drafts

    return run


def _tree(model, b, caches, shape, eagle: bool, meta: AttentionMetadata, steps: list[tuple],
          sizes: list[int]) -> Callable:
    """A padded tree step (tree_speculation.verify_tree). ``steps``: (module, metadata) of each
    draft step; each takes 8 tensors before its metadata's (tree_speculation.TreeDraftStep)."""
    from mindspec.modeling.forward_metadata import DeviceInputs
    from mindspec.modeling.tree_speculation import TreeDrafter, TreeDraftStep, verify_tree

    drafter = TreeDrafter(model, shape, eagle)

    def run(ids, pos, lm, hidden, *rest):
        parts, at = _split(rest, sizes)
        main = DeviceInputs(ids, pos, b.bind_step_tensors(meta, parts[0]), lm)
        bound = [TreeDraftStep(module, DeviceInputs(p[0], p[1], b.bind_step_tensors(step_meta, p[8:]), p[2]), *p[3:8])
                 for (module, step_meta), p in zip(steps, parts[1:])]
        out, tree = verify_tree(model, drafter, main, bound, hidden, b.bind_cache_tensors(caches, list(rest[at:])))
        return out.logits, out.hidden_states, tree.tokens, tree.parents, tree.depths

    return run


def _split(rest: tuple, sizes: list[int]) -> tuple[list[list[torch.Tensor]], int]:
    """``rest`` cut into consecutive parts of ``sizes`` -> (parts, where the caches' tensors start)."""
    parts, at = [], 0
    for n in sizes:
        parts.append(list(rest[at : at + n]))
        at += n
    return parts, at


def portable(value):
    """``value`` with every tensor it holds copied into storage of its own, metadata memos
    dropped: the graph runner's inputs are int32 and int64 views of one byte buffer, which
    ``torch.save`` refuses to write side by side."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, AttentionMetadata):
        return replace(value, scratch={}, **{f.name: portable(getattr(value, f.name)) for f in fields(value)
                                              if isinstance(getattr(value, f.name), torch.Tensor)})
    if isinstance(value, StepRecipe):
        return replace(value, args=portable(value.args), inputs=portable(value.inputs))
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v) for v in value)
    return value
