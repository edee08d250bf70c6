"""Tree speculation steps through the graph runner (tree_padding.py), run eagerly over its static
buffers on the cpu backend: a step padded to a bucket and to fixed rows per draft step gives the
unpadded step's trees and logits, writes no cache entry but the real sequences' slots and the
dummy block, and decoding with the runner emits the tokens decoding without it emits."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.modeling.draft_tree import TreeShape
from mindspec.modeling.graph_runner import DecodeGraphRunner
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.modeling.tree_padding import TreePad, draft_rows, pad_tree_step
from mindspec.plugins.mtp import decode_inputs as di
from mindspec.plugins.mtp import tree_inputs as ti
from mindspec.plugins.tree_verify import verification_inputs
from tests.modeling.test_graph_runner import (
    BLOCK_SIZE, NUM_BLOCKS, _assert_cache_contract, _prefill, _restore, _snapshot, _tables, _written_mask,
)
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

DEPTH = 3
SEQ_LENS = [5, 9, 14, 2]  # the last is shorter than a path: its deepest MTP Vanilla rows write nothing
LAST_ACCEPTED = [1, 4, 2, 1]
SHAPES = {
    "static": TreeShape.static([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]),
    "dynamic": TreeShape.dynamic_tree(DEPTH, 3, 8),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=DEPTH)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, seed=4, residual_scale=0.01), cfg


@pytest.fixture
def wrapper(checkpoint):
    path, _ = checkpoint
    w = ModelWrapper(path, backend="cpu", dtype="float32", num_mtp_modules=DEPTH, progress=False)
    w.allocate_cache(NUM_BLOCKS, BLOCK_SIZE)
    return w


def _tree_step(cfg, shape: TreeShape, eagle: bool, tables):
    rng = np.random.default_rng(1)
    tokens = [rng.integers(2, cfg.vocab_size, s).tolist() for s in SEQ_LENS]
    num_tokens = np.array(SEQ_LENS)
    layout = di.decode_layout(num_tokens, np.array(LAST_ACCEPTED), DEPTH, "eagle" if eagle else "vanilla")
    table_arr = di.block_tables(tables)
    main = verification_inputs(np.array([t[-1] for t in tokens]), num_tokens, table_arr, BLOCK_SIZE, shape.num_nodes)
    tails = [t[di.window_offset(int(start)):] for t, start in zip(tokens, layout.start)]
    steps = ti.draft_steps(tails, layout, table_arr, BLOCK_SIZE, shape, eagle, np.zeros(len(tokens), dtype=np.int64),
                           NUM_BLOCKS - 1)
    hidden = torch.randn(steps[0].inputs.num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    return tokens, main, steps, hidden


@pytest.mark.parametrize("eagle", [False, True], ids=["vanilla", "eagle"])
@pytest.mark.parametrize("tree", sorted(SHAPES))
@pytest.mark.parametrize("buckets", [(4,), (8,)])
def test_tree_step_padded_equals_unpadded(wrapper, checkpoint, eagle, tree, buckets):
    _, cfg = checkpoint
    shape = SHAPES[tree]
    tables = _tables(SEQ_LENS, shape.lookahead + DEPTH + 1)
    tokens, main, steps, hidden = _tree_step(cfg, shape, eagle, tables)
    _prefill(wrapper, [t[:-1] for t in tokens], tables)
    before = _snapshot(wrapper)

    def step():
        with torch.inference_mode():
            return wrapper.forward_tree_host(main, steps, hidden, shape, eagle)

    expected, expected_tree = step()
    after_eager = _snapshot(wrapper)
    _restore(wrapper, before)
    runner = wrapper.graph_runner = DecodeGraphRunner(wrapper, buckets=buckets, capture=False)
    for _ in range(2):  # the second call reuses the shape's static buffers
        got, got_tree = step()
        for name in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(got_tree, name), getattr(expected_tree, name)), name
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.logits.argmax(-1), expected.logits.argmax(-1))
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, atol=1e-5, rtol=1e-5)
        _assert_cache_contract(wrapper, before, after_eager, _written_mask([main.slots] + [s.inputs.slots for s in steps]))
    assert runner.stats.replays == 2 and [k[0] for k in runner.shape_keys] == ["tree"]


def test_padded_rows_are_static_and_re_based():
    shape = SHAPES["static"]
    cfg = tiny_v3_config(num_nextn_predict_layers=DEPTH)
    tables = _tables(SEQ_LENS, shape.lookahead + DEPTH + 1)
    _, main, steps, _ = _tree_step(cfg, shape, False, tables)
    rows = draft_rows(steps, DEPTH, eagle=False)
    # the most a window can need (4 accepted, 2 of history, one fewer per step) and the tree rows
    assert rows == (6, 5 + 2, 4 + 4)
    eagle_steps = _tree_step(cfg, shape, True, tables)[2]
    assert draft_rows(eagle_steps, DEPTH, eagle=True) == (4, 2, 4)  # MTP Eagle's later steps: tree rows alone
    pad = TreePad(num_seqs=8, rows=rows, verify_rows=shape.num_nodes + 1, width=12, dummy_block=NUM_BLOCKS - 1, block_size=BLOCK_SIZE)
    padded_main, padded, hidden_map = pad_tree_step(main, steps, pad)
    assert padded_main.num_tokens == 8 * (shape.num_nodes + 1)
    real = len(SEQ_LENS)
    for d, (old, new) in enumerate(zip(steps, padded)):
        assert new.inputs.num_tokens == 8 * rows[d] and (new.inputs.q_lens == rows[d]).all()
        assert new.inputs.block_tables.shape == (8, 12)
        # each real sequence's rows come first in its block of rows, the rest write nothing
        q = old.inputs.q_lens
        for b in range(real):
            start = int(q[:b].sum())
            block = slice(b * rows[d], b * rows[d] + int(q[b]))
            assert np.array_equal(new.inputs.input_ids[block], old.inputs.input_ids[start : start + q[b]])
            assert np.array_equal(new.inputs.slots[block], old.inputs.slots[start : start + q[b]])
            assert (new.inputs.slots[b * rows[d] + int(q[b]) : (b + 1) * rows[d]] == -1).all()
            assert new.tree_first[b] == b * rows[d] + old.window_lens[b]
        assert (new.inputs.slots[real * rows[d] :] == -1).all()  # padding sequences write nothing
        assert (new.inputs.block_tables[real:] == NUM_BLOCKS - 1).all()
        # the real lm_head rows map to the same tokens; a padding sequence's follow its tree rows
        assert np.array_equal(new.inputs.input_ids[new.inputs.lm_head_indices[: len(old.inputs.lm_head_indices)]],
                              old.inputs.input_ids[old.inputs.lm_head_indices])
        assert len(new.inputs.lm_head_indices) == 8 * len(old.inputs.lm_head_indices) // real
        if d:  # window rows read the same previous rows, re-based
            prev_map = np.repeat(np.arange(real), steps[d - 1].inputs.q_lens) * rows[d - 1] + \
                np.concatenate([np.arange(n) for n in steps[d - 1].inputs.q_lens])
            src = old.window_src[old.window_src >= 0]
            assert np.array_equal(new.window_src[new.window_src >= 0], prev_map[src])
    assert len(hidden_map) == steps[0].inputs.num_tokens


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_decoding_with_padded_tree_steps_is_lossless(checkpoint, mode):
    path, cfg = checkpoint
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in (3, 17, 8, 30, 1)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def llm(runner: bool):
        pp = {"plugin_type": "mtp", "mtp_mode": mode, "tree": "dynamic", "num_speculative_tokens": DEPTH,
              "tree_topk": 3, "num_draft_tokens": 8, "adaptive_speculation": False}
        engine = LLM(model=str(path), dtype="float32", progress=False, cache_block_size=4, num_blocks=256,
                     plugin_params=pp)
        if runner:
            w = engine.engine.model_wrapper
            w.graph_runner = DecodeGraphRunner(w, buckets=(1, 2, 4, 8), capture=False)
        return engine

    plain = LLM(model=str(path), dtype="float32", progress=False, cache_block_size=4, num_blocks=256)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    padded = llm(True)
    assert [o.token_ids for o in padded.generate(prompts, params)] == expected
    assert [padded.generate([p], params)[0].token_ids for p in prompts[:2]] == expected[:2]
    keys = padded.engine.model_wrapper.graph_runner.shape_keys
    assert any(k[0] == "tree" and k[1] == 8 for k in keys) and any(k[0] == "tree" and k[1] == 1 for k in keys)
