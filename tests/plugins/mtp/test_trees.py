"""MTP draft trees end to end: strict tree decoding emits exactly what decoding without
speculation emits (greedy, and seeded sampling), a chain-shaped tree is the chain, the accepted
path's KV is what a run without speculation writes, and typical acceptance keeps at least what
strict keeps."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from tests.support.checkpoints import make_checkpoint, make_self_predicting_checkpoint, tiny_v3_config

NUM_PROMPTS = 12
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

TREES = {
    "static": {"tree_choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]},
    "dynamic": {"tree": "dynamic", "num_speculative_tokens": 3, "tree_topk": 3, "num_draft_tokens": 8},
    "dynamic_wide": {"tree": "dynamic", "num_speculative_tokens": 2, "tree_topk": 4, "num_draft_tokens": 12},
}


@pytest.fixture(scope="module", params=["random", "self_predicting"])
def case(request, tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=3)
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "random":
        make_checkpoint(path, cfg, seed=11)
    else:
        make_self_predicting_checkpoint(path, cfg, seed=11, residual_scale=0.005)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 40, NUM_PROMPTS)]
    baseline = _llm(path).generate(prompts, GREEDY)
    return request.param, path, prompts, [o.token_ids for o in baseline]


def _llm(path, plugin_params=None, **kw):
    kw = {"cache_block_size": 4, "num_blocks": 512, **kw}
    return LLM(model=str(path), dtype="float32", progress=False, plugin_params=plugin_params, **kw)


def _tree_params(tree: str, mode: str, **extra) -> dict:
    return {"plugin_type": "mtp", "mtp_mode": mode, **TREES[tree], **extra}


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_tree_greedy_equals_no_speculation(case, mode, tree):
    kind, path, prompts, expected = case
    llm = _llm(path, _tree_params(tree, mode, adaptive_speculation=False))
    batched = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == expected
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts[:4]] == expected[:4]
    stats = [o.spec_decode for o in batched]
    if kind == "self_predicting":
        # the tree's paths are accepted, and sequences of one batch accept different lengths
        assert sum(s.num_accepted_tokens for s in stats) > 0.3 * sum(s.num_steps for s in stats)
        assert len({s.num_accepted_tokens for s in stats}) > 1
    # acceptance per position: one entry per depth, not per verified node
    assert len(llm.engine.spec_stats.accepted_per_position) == llm.engine.plugin_manager.plugins[0].k
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not llm.engine.plugin_manager.plugins[0].states


def test_tree_with_preemption_is_still_lossless(case):
    kind, path, prompts, expected = case
    llm = _llm(path, _tree_params("dynamic", "eagle"), num_blocks=70)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_preemptions for o in outs) > 0


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_chain_shaped_tree_is_the_chain(case, mode):
    """A static tree [[0], [0, 0], [0, 0, 0]] drafts what the K = 3 chain drafts: the same
    tokens and the same accepted drafts per position."""
    kind, path, prompts, expected = case
    chain = _llm(path, {"plugin_type": "mtp", "mtp_mode": mode, "num_speculative_tokens": 3,
                        "adaptive_speculation": False}).generate(prompts, GREEDY)
    tree = _llm(path, {"plugin_type": "mtp", "mtp_mode": mode, "tree_choices": [[0], [0, 0], [0, 0, 0]],
                       "adaptive_speculation": False})
    outs = tree.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert [o.spec_decode.accepted_per_position for o in outs] == [o.spec_decode.accepted_per_position for o in chain]


def test_seeded_sampling_is_the_same_with_a_tree(case):
    """Each row samples at its depth's output position with its path as penalty history, so a
    seeded request emits what it emits without speculation."""
    kind, path, prompts, _ = case
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2, seed=s,
                             max_tokens=16, ignore_eos=True) for s in range(len(prompts))]
    plain = [o.token_ids for o in _llm(path).generate(prompts, params)]
    for mode in ("eagle", "vanilla"):
        outs = _llm(path, _tree_params("dynamic", mode)).generate(prompts, params)
        assert [o.token_ids for o in outs] == plain


def test_accepted_path_kv_equals_a_run_without_speculation(tmp_path):
    """After a step, the accepted path's main-model KV sits in the sequence's slots, as if each
    token had been decoded alone (rejected nodes' entries are never read)."""
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=3)
    make_self_predicting_checkpoint(tmp_path, cfg, seed=11, residual_scale=0.005)
    prompt = [5, 9, 17, 33, 2, 8, 41, 7, 3]
    caches = {}
    for name, pp in [("plain", None), ("tree", _tree_params("static", "vanilla"))]:
        llm = _llm(tmp_path, pp, num_blocks=64)
        engine = llm.engine
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), request_id="r")
        seq = None
        while engine.has_unfinished():
            engine.step()
            running = engine.scheduler.running
            if running and running[0].num_output_tokens >= 24:
                seq = running[0]
                break
        n = seq.num_cached_tokens  # KV written and final for these positions
        slots = [seq.block_table[p // 4] * 4 + p % 4 for p in range(n)]
        main = engine.model_wrapper.caches[: cfg.num_hidden_layers]
        caches[name] = (seq.token_ids[:n], torch.stack([c.latent.view(-1, c.latent.shape[-1])[slots] for c in main]))
        if name == "tree":  # the tree's paths were accepted beyond their first node, so KV moved
            assert engine.spec_stats.accepted_per_position[1] > 0
    (plain_tokens, plain_kv), (tree_tokens, tree_kv) = caches["plain"], caches["tree"]
    n = min(len(plain_tokens), len(tree_tokens))
    assert plain_tokens[:n] == tree_tokens[:n]
    torch.testing.assert_close(tree_kv[:, :n], plain_kv[:, :n], rtol=1e-4, atol=1e-5)


def test_typical_tree_accepts_at_least_strict(case):
    kind, path, prompts, _ = case
    params = SamplingParams(temperature=0.7, max_tokens=NEW_TOKENS, ignore_eos=True, seed=1)
    accepted = {}
    for policy in ("strict", "typical"):
        # a tree on every step: adaptive tree-or-plain choices follow timings, which would make
        # the two runs' steps differ
        llm = _llm(path, _tree_params("dynamic", "vanilla", decoding_policy=policy, adaptive_speculation=False))
        outs = llm.generate(prompts, params)
        assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
        accepted[policy] = sum(o.spec_decode.num_accepted_tokens for o in outs) / sum(o.spec_decode.num_steps for o in outs)
    assert accepted["typical"] >= accepted["strict"]


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_tree_with_prefix_caching_and_split_fuse_is_lossless(case, mode):
    """Prompts sharing a prefix: later ones start from cached blocks (their MTP entries included)
    and are prefilled in chunks beside tree steps; the output is still the plain tokens."""
    kind, path, prompts, _ = case
    shared = prompts[0] + prompts[1] + prompts[2]
    batch = [shared + p for p in prompts[3:8]]
    expected = [o.token_ids for o in _llm(path).generate(batch, GREEDY)]
    params = {**_tree_params("dynamic", mode), "plugin_type": "mtp,prefix_cache,splitfuse"}
    llm = _llm(path, params, split_chunk_tokens=16)
    outs = [llm.generate([p], GREEDY)[0] for p in batch[:2]] + llm.generate(batch[2:], GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 4 * (len(shared) // 4) - 4 for o in outs[1:])


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_tree_under_async_scheduling_is_lossless(case, mode):
    """Async scheduling builds a tree step's layout when the running step's tokens are known
    (fill_in_model_result); greedy and seeded output stay those of plain decoding."""
    kind, path, prompts, expected = case
    llm = _llm(path, _tree_params("dynamic", mode), async_scheduling=True)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.async_stepper.stats.ahead_steps > 0
    seeded = [SamplingParams(temperature=0.8, top_k=20, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    assert [o.token_ids for o in llm.generate(prompts[:4], seeded)] == \
        [o.token_ids for o in _llm(path).generate(prompts[:4], seeded)]


def test_relaxed_tree_accepts_at_least_strict_inside_the_thinking_span(case):
    """Relaxed acceptance on a tree: with the whole output declared a thinking span it keeps at
    least the nodes strict keeps; with delta 0 it is strict (identical output)."""
    kind, path, prompts, expected = case
    think = {"decoding_policy": "relaxed", "relaxed_topk": 3, "think_start_token_id": 0, "think_end_token_id": 1}
    strict_zero = _llm(path, _tree_params("dynamic", "vanilla", **think, relaxed_delta=0.0))
    assert [o.token_ids for o in strict_zero.generate(prompts, GREEDY)] == expected
    prompts_in_think = [[0] + p for p in prompts]
    rates = {}
    for delta in (0.0, 0.3):
        llm = _llm(path, _tree_params("dynamic", "vanilla", **think, relaxed_delta=delta, adaptive_speculation=False))
        outs = llm.generate(prompts_in_think, GREEDY)
        rates[delta] = sum(o.spec_decode.num_accepted_tokens for o in outs) / sum(o.spec_decode.num_steps for o in outs)
    assert rates[0.3] >= rates[0.0]


def test_adaptive_tree_or_plain_steps_stay_lossless(case, monkeypatch):
    """Adaptive speculation alternates tree and plain steps (here forced to alternate): the
    plain steps' skipped MTP entries are written by the next tree step's window."""
    from mindspec.plugins.mtp.tree_choice import TreeOrPlain

    kind, path, prompts, expected = case
    flips = iter(range(10**6))
    monkeypatch.setattr(TreeOrPlain, "tree_step", lambda self, batch_size: next(flips) % 3 != 1)
    for mode in ("eagle", "vanilla"):
        llm = _llm(path, _tree_params("dynamic", mode))
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
