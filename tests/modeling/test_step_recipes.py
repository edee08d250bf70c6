"""A step saved as a recipe (what a compile worker exports from, step_recipes.py) and exported
from it with the model loaded again from the checkpoint computes what the serving process's
step computes: plain, MTP speculative and draft-tree steps, on the inputs the engine padded."""
import gc
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.modeling import exported_step
from mindspec.modeling.exported_step import ExportedSteps, export_recipe
from mindspec.modeling.prefill_padding import PREFILL_ENV
from mindspec.modeling.step_recipes import (
    DECODE, PREFILL, PREFILL_MTP, SPECULATIVE, TREE, StepRecipe, portable, trace_fn,
)
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

K = 2
VANILLA = {"plugin_type": "mtp", "num_speculative_tokens": K, "adaptive_speculation": False}
TREE_PARAMS = {"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": K, "tree_topk": 2,
               "num_draft_tokens": 4, "adaptive_speculation": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_hidden_layers=2, num_nextn_predict_layers=K)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("recipes"), cfg, seed=3, residual_scale=0.005)


def _first_steps(checkpoint, plugin_params, monkeypatch) -> dict:
    """kind -> (llm, key, args, caches, tensors, dims) of the first step of that kind a compiled
    engine meets, copied when it was met; every step then runs eagerly (nothing is compiled)."""
    seen = {}

    def record(self, key, args, caches, tensors, dims):
        if key[0] not in seen:
            copies = [c.clone() for c in tensors]
            seen[key[0]] = (key, portable(args), caches, copies, dims)
        return None

    monkeypatch.setattr(ExportedSteps, "_package", record)
    llm = LLM(model=str(checkpoint), dtype="float32", cache_block_size=4, num_blocks=32, progress=False,
              plugin_params=plugin_params, decode_graphs=True, max_batch_size=2)
    prompts = [np.random.default_rng(s).integers(2, 60, n).tolist() for s, n in ((0, 5), (1, 9))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return {kind: (llm, *step) for kind, step in seen.items()}


def _check_round_trip(llm, key, args, caches, tensors, dims, tmp_path):
    compiled = llm.engine.model_wrapper.compiled
    path = tmp_path / f"{key[0]}.recipe"
    compiled._recipe(key, args, caches, tensors, dims).save(path)
    recipe = StepRecipe.load(path)
    assert recipe.kind == key[0] and recipe.signature == key[1] and len(recipe.inputs) == len(tensors) - len(caches)

    with _files_run() as ran:
        program = export_recipe(recipe)  # what a worker does: its own model, its own caches
    fingerprinted = {str(f) for f in exported_step.fingerprinted_files(compiled.model, compiled.backend)}
    assert ran and ran <= fingerprinted, sorted(ran - fingerprinted)

    # Both run on the serving process's inputs over copies of one cache state (a step writes its
    # new entries before reading them, so both see the same cache).
    n_inputs = len(recipe.inputs)
    inputs, cache_rows = tensors[:n_inputs], tensors[n_inputs:]
    with torch.inference_mode():
        expected = trace_fn(key[0], compiled.model, compiled.backend, caches, args)(
            *inputs, *[r.clone() for r in cache_rows])
        got = program.module()(*[t.clone() for t in inputs], *[r.clone() for r in cache_rows])
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


_REPO = Path(__file__).resolve().parents[2]


class _files_run:
    """The paths of the repository's source files whose functions are called on this thread
    inside the block: what an export runs besides torch. (A trace function sees only new frames,
    so it costs far less than a profile function, which also sees every return and C call.)"""

    def __enter__(self) -> set:
        names: set[str] = set()
        repo, tests = f"{_REPO}{os.sep}", f"{_REPO / 'tests'}{os.sep}"

        def trace(frame, event, arg):
            name = frame.f_code.co_filename
            # (a finalizer the garbage collector runs here belongs to an earlier object, not to the export)
            if name.startswith(repo) and not name.startswith(tests) and frame.f_code.co_name != "__del__":
                names.add(name)
            return None  # no line events

        gc.collect()
        sys.settrace(trace)
        return names

    def __exit__(self, *exc) -> None:
        sys.settrace(None)


@pytest.mark.slow
def test_plain_and_speculative_steps_rebuilt_from_recipes_compute_the_same(checkpoint, tmp_path, monkeypatch):
    steps = _first_steps(checkpoint, VANILLA, monkeypatch)
    assert set(steps) == {DECODE, SPECULATIVE}  # warm-up's plain step and the MTP steps
    for kind in (DECODE, SPECULATIVE):
        _check_round_trip(*steps[kind], tmp_path)


@pytest.mark.slow
def test_a_tree_step_rebuilt_from_its_recipe_computes_the_same(checkpoint, tmp_path, monkeypatch):
    steps = _first_steps(checkpoint, TREE_PARAMS, monkeypatch)
    _check_round_trip(*steps[TREE], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("plugin_params, kind", [(None, PREFILL), (VANILLA, PREFILL_MTP)])
def test_padded_prefills_rebuilt_from_recipes_compute_the_same(checkpoint, tmp_path, monkeypatch, plugin_params, kind):
    monkeypatch.setenv(PREFILL_ENV, "1")
    steps = _first_steps(checkpoint, plugin_params, monkeypatch)
    llm, key, *_ = steps[kind]
    assert key[1][0][1] == (32,)  # the prompts of 5 and 9 tokens, 16 rows each
    _check_round_trip(*steps[kind], tmp_path)


def test_the_host_only_files_left_out_of_the_code_fingerprint_exist():
    here = Path(exported_step.__file__).parent
    assert sorted(n for n in exported_step.HOST_ONLY_FILES if not (here / n).is_file()) == []


def test_a_recipe_file_must_hold_a_recipe(tmp_path):
    path = tmp_path / "x.recipe"
    torch.save({"kind": DECODE}, str(path))
    with pytest.raises(ValueError, match="holds a dict, not a step recipe"):
        StepRecipe.load(path)


def test_unknown_step_kinds_are_refused():
    with pytest.raises(ValueError, match="unknown step kind 'warmup'"):
        trace_fn("warmup", None, None, [], {})


def test_rebuilt_inputs_must_match_the_serving_process(checkpoint, tmp_path, monkeypatch):
    llm, key, args, caches, tensors, dims = _first_steps(checkpoint, None, monkeypatch)[DECODE]
    recipe = llm.engine.model_wrapper.compiled._recipe(key, args, caches, tensors, dims)
    recipe.num_blocks += 1  # caches of another size than the package is specialised on
    with pytest.raises(ValueError, match="rebuilt decode step's inputs"):
        export_recipe(recipe)
