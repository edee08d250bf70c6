"""Greedy output with MTP on equals MTP off, token for token, for every prompt, batched and alone.

Two checkpoints: random MTP modules (drafts almost always rejected: exercises rollback) and
self-predicting ones (drafts accepted about half the time, in full and partial runs: exercises the
hit paths, the hidden-state cache and eagle's shifted slots).
"""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from tests.support.checkpoints import make_checkpoint, make_self_predicting_checkpoint, tiny_v3_config

NUM_PROMPTS = 16
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["random", "self_predicting"])
def case(request, tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=5)
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "random":
        make_checkpoint(path, cfg, seed=11)
    else:
        make_self_predicting_checkpoint(path, cfg, seed=11, residual_scale=0.005)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 40, NUM_PROMPTS)]
    baseline = _llm(path).generate(prompts, GREEDY)
    return request.param, path, prompts, [o.token_ids for o in baseline]


def _llm(path, plugin_params=None):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=512, progress=False,
               plugin_params=plugin_params)


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_mtp_greedy_equals_no_speculation(case, mode, k):
    kind, path, prompts, expected = case
    # every step verifies K drafts (adaptive speculation's varying counts: test_adaptive.py)
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode,
                      "adaptive_speculation": False})
    batched = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == expected
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert alone == expected
    stats = [o.spec_decode for o in batched]
    assert all(s.num_draft_tokens == s.num_steps * k for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    if kind == "self_predicting":
        assert accepted > 0.2 * sum(s.num_draft_tokens for s in stats)
        # per-sequence accept lengths differ inside one batch
        assert len({s.num_accepted_tokens for s in stats}) > 1
    # engine-wide counters sum the per-request ones (the "alone" runs add to them too)
    engine = llm.engine.spec_stats
    assert engine.num_accepted_tokens >= accepted and engine.num_draft_tokens == engine.num_steps * k
    assert sum(engine.accepted_per_position) == engine.num_accepted_tokens
    assert engine.accepted_per_position == sorted(engine.accepted_per_position, reverse=True)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not llm.engine.plugin_manager.plugins[0].states  # hidden-state cache cleared


def test_mtp_with_preemption_is_still_lossless(case):
    kind, path, prompts, expected = case
    llm = LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=60, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle"})
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_preemptions for o in outs) > 0
