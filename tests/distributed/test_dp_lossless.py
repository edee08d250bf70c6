"""dp = 2 with gloo in two local processes (this one and a spawned rank) gives the same outputs as
dp = 1: greedy with MTP (vanilla K = 2, eagle K = 3 with expert parallel), without MTP, with
suffix drafts (alone, and with MTP), seeded sampling, and steps where one rank has no sequence
(it runs a dummy)."""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.config.mindie_config import ConfigError
from mindspec.plugins.mtp.mtp_plugin import SUFFIX_MAX_BATCH
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config, write_medusa_heads
from tests.support.draft_counts import record_draft_counts, record_mtp_steps

NUM_PROMPTS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CASES = {
    "vanilla-k2": dict(moe_ep=1, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "vanilla"}),
    "eagle-k3-ep2": dict(moe_ep=2, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle"}),
    "no-mtp-ep2": dict(moe_ep=2, plugin_params=None),
    "tree-vanilla": dict(moe_ep=1, plugin_params={"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 2,
                                                  "tree_topk": 2, "num_draft_tokens": 5, "mtp_mode": "vanilla"}),
    # with expert parallelism a rank's trees are padded to the most sequences of any rank
    "tree-eagle-ep2": dict(moe_ep=2, plugin_params={"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 3,
                                                    "tree_topk": 2, "num_draft_tokens": 6, "mtp_mode": "eagle"}),
    "medusa": dict(moe_ep=1, plugin_params={"plugin_type": "medusa"}),
    "medusa-ep2": dict(moe_ep=2, plugin_params={"plugin_type": "medusa"}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    path = make_self_predicting_checkpoint(tmp_path_factory.mktemp("dp"), cfg, seed=11, residual_scale=0.005)
    write_medusa_heads(path, cfg, num_heads=2, seed=1)  # skipped by the model loader; the medusa case drafts with them
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(2, 250, int(n)).tolist() for n in rng.integers(1, 30, NUM_PROMPTS)]


def _llm(path, dp=1, moe_ep=1, plugin_params=None, **kw):
    tree = plugin_params is not None and "tree" in plugin_params  # trees never adapt
    if plugin_params is not None and "mtp" in plugin_params["plugin_type"] and not tree:  # every rank must decide alike
        plugin_params = {**plugin_params, "adaptive_speculation": False}
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=400, progress=False,
               plugin_params=plugin_params, dp=dp, moe_ep=moe_ep, dist_timeout=60, **kw)


def _uneven():
    """Two sequences that end at different steps: rank 0's ends first, then rank 0 idles."""
    return [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_dp2_equals_dp1(checkpoint, prompts, case):
    opts = CASES[case]
    single = _llm(checkpoint, plugin_params=opts["plugin_params"])
    expected = [o.token_ids for o in single.generate(prompts, GREEDY)]
    expected_uneven = [o.token_ids for o in single.generate(prompts[:2], _uneven())]
    expected_alone = single.generate(prompts[5], GREEDY)[0].token_ids
    with _llm(checkpoint, dp=2, **opts) as llm:
        got = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == expected
        if opts["plugin_params"] is not None and not case.startswith("medusa"):  # (random Medusa heads are rarely right)
            assert sum(o.spec_decode.num_accepted_tokens for o in got) > 0  # drafts were verified
        stats = llm.engine.dp_stats()
        assert all(s.sequences > 0 for s in stats)  # both ranks served sequences
        assert [o.token_ids for o in llm.generate(prompts[:2], _uneven())] == expected_uneven
        assert llm.generate(prompts[5], GREEDY)[0].token_ids == expected_alone  # rank 1 idle all along
        stats = llm.engine.dp_stats()
        assert all(s.idle_steps > 0 for s in stats)  # each rank had steps with no sequence
        if not case.startswith(("tree", "medusa")):  # tree steps count no padding
            assert all(s.padded_tokens > 0 for s in stats)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks


SUFFIX_CASES = {
    "mtp-suffix-vanilla-k2": dict(moe_ep=1, plugin_params={
        "plugin_type": "mtp,suffix", "num_speculative_tokens": 2, "mtp_mode": "vanilla", "suffix_min_match": 1,
        "suffix_max_drafts": 6}),
    "suffix-k5-ep2": dict(moe_ep=2, plugin_params={"plugin_type": "suffix", "num_speculative_tokens": 5, "min_match": 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SUFFIX_CASES))
def test_dp2_with_suffix_drafts_equals_no_speculation(checkpoint, prompts, case, monkeypatch):
    """Suffix drafts under dp = 2: sequences verify unequal numbers of drafts, so the ranks'
    main rows differ and a dummy of its own rows equalises them; with MTP, steps of suffix
    drafts alone (no draft step) too. Rank 0 (this process) records the steps."""
    opts = SUFFIX_CASES[case]
    batch = prompts[:SUFFIX_MAX_BATCH]  # larger batches of MTP+suffix only propose suffix drafts
    off = _llm(checkpoint)
    expected = [o.token_ids for o in off.generate(batch, GREEDY)]
    expected_alone = off.generate(prompts[5], GREEDY)[0].token_ids
    draft_steps = []
    mtp_steps, suffix_counts = record_mtp_steps(monkeypatch, draft_steps), record_draft_counts(monkeypatch)
    with _llm(checkpoint, dp=2, **opts) as llm:
        got = llm.generate(batch, GREEDY)
        assert [o.token_ids for o in got] == expected
        assert sum(o.spec_decode.num_accepted_tokens for o in got) > 0
        assert llm.generate(prompts[5], GREEDY)[0].token_ids == expected_alone
        assert all(s.sequences > 0 for s in llm.engine.dp_stats())
    if opts["plugin_params"]["plugin_type"] == "suffix":
        assert any(len(set(c)) > 1 for c in suffix_counts)
    else:
        assert any(host and len(host) < len(counts) for counts, host in mtp_steps) and 0 in draft_steps


@pytest.mark.slow
def test_dp2_unseeded_sampling_keeps_the_ranks_together(checkpoint, prompts):
    """Unseeded rows draw from the sampler's host keys: every rank must draw the leader's, or the
    ranks' sequences part (each step compares a digest of its tokens: RankDivergence)."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    with _llm(checkpoint, dp=2, **CASES["vanilla-k2"]) as llm:
        assert [len(o.token_ids) for o in llm.generate(prompts, params)] == [12] * len(prompts)


@pytest.mark.slow
def test_dp2_seeded_sampling_equals_dp1(checkpoint, prompts):
    opts = CASES["vanilla-k2"]
    params = [SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    expected = [o.token_ids for o in _llm(checkpoint, plugin_params=opts["plugin_params"]).generate(prompts, params)]
    with _llm(checkpoint, dp=2, **opts) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_bad_parallel_settings_are_one_config_error(checkpoint):
    with pytest.raises(ConfigError, match=r"moe_ep: 3 does not divide worldSize \(2\)"):
        _llm(checkpoint, dp=2, moe_ep=3)
    with pytest.raises(ConfigError, match=r"moe_ep: 3 does not divide the checkpoint's 8 routed experts"):
        _llm(checkpoint, dp=3, moe_ep=3)
    with pytest.raises(ConfigError, match=r"dp: must be an integer >= 1, got 0"):
        _llm(checkpoint, dp=0)
    with pytest.raises(ConfigError, match=r"plugin_params.adaptive_speculation: must be false with dp > 1"):
        LLM(model=str(checkpoint), dtype="float32", num_blocks=64, progress=False, dp=2,
            plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 1, "adaptive_speculation": True})
    with pytest.raises(ConfigError, match=r"SplitFuse, or plugin_type splitfuse\): not available with dp > 1"):
        _llm(checkpoint, dp=2, plugin_params={"plugin_type": "splitfuse"})


@pytest.mark.slow
def test_dp2_with_prefix_caching_equals_dp1_without(checkpoint, prompts):
    """Per-rank caches: a cached block's KV lives on the rank that computed it, and a sequence
    that starts with a cached block runs on that block's rank (dp_plan keys owners by the first
    block). Two rounds over prompts sharing a 21-token prefix: the first computes and publishes
    (both ranks compute the prefix, one copy is registered), the second finds it."""
    shared = prompts[0][:5] * 4 + [7]
    batch = [shared + p for p in prompts[:8]]
    plugin = {"plugin_type": "mtp,prefix_cache", "num_speculative_tokens": 2, "mtp_mode": "vanilla"}
    expected = [o.token_ids for o in _llm(checkpoint).generate(batch, GREEDY)]
    with _llm(checkpoint, dp=2, plugin_params=plugin) as llm:
        assert [o.token_ids for o in llm.generate(batch, GREEDY)] == expected
        again = llm.generate(batch[::-1], GREEDY)
        assert [o.token_ids for o in again] == expected[::-1]
        assert all(o.num_cached_tokens >= 16 for o in again), [(len(o.prompt_token_ids), o.num_cached_tokens) for o in again]
        assert all(s.sequences > 0 for s in llm.engine.dp_stats())
        bm = llm.engine.block_manager
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks

