"""Adaptive speculation: the controller's choices, and losslessness when steps alternate between
speculative and plain decoding (the MTP caches catch up on the entries plain steps skipped)."""
import numpy as np
import torch
import pytest

from mindspec import LLM, SamplingParams
from mindspec.plugins.mtp import adaptive
from mindspec.plugins.mtp.adaptive import AdaptiveSpeculation, batch_bucket
from mindspec.plugins.mtp.mtp_plugin import CATCH_UP
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# ---- the controller -----------------------------------------------------------------------------
def _feed(ctl: AdaptiveSpeculation, batch: int, steps: int, on: tuple[float, float], off: tuple[float, float]):
    """Run `steps` decisions; each step yields (tokens, seconds) of its kind. Returns the choices."""
    choices = []
    for _ in range(steps):
        spec = ctl.speculate(batch)
        choices.append(spec)
        ctl.record(batch, spec, *(on if spec else off))
    return choices


def test_explores_both_kinds_then_keeps_the_faster():
    ctl = AdaptiveSpeculation()
    # speculation: 2.5 tokens in 2 s (1.25/s); plain: 1 token in 1 s
    first = _feed(ctl, 1, 2 * adaptive.MIN_SAMPLES, on=(2.5, 2.0), off=(1.0, 1.0))
    assert first.count(True) == first.count(False) == adaptive.MIN_SAMPLES
    assert first[0] is True  # speculation is tried first
    later = _feed(ctl, 1, 40, on=(2.5, 2.0), off=(1.0, 1.0))
    assert all(later)
    assert ctl.summary()[1] == {"speculate": True, "on": 1.25, "off": 1.0}


def test_switches_off_when_speculation_loses_and_back_when_it_wins():
    ctl = AdaptiveSpeculation()
    _feed(ctl, 32, 2 * adaptive.MIN_SAMPLES, on=(1.5, 2.0), off=(1.0, 1.0))
    assert not any(_feed(ctl, 32, 20, on=(1.5, 2.0), off=(1.0, 1.0)))  # 0.75/s against 1/s
    # Speculation becomes cheaper; the estimate follows as re-explored samples replace old ones
    # (one every REEXPLORE_EVERY steps; a window's worth is more than enough).
    choices = _feed(ctl, 32, adaptive.REEXPLORE_EVERY * adaptive.WINDOW, on=(3.0, 1.0), off=(1.0, 1.0))
    assert choices[-1] is True


def test_margin_prevents_flip_flopping_on_noise():
    ctl = AdaptiveSpeculation()
    _feed(ctl, 4, 2 * adaptive.MIN_SAMPLES, on=(1.01, 1.0), off=(1.0, 1.0))
    # 1% apart: inside the margin, the current choice (speculate) stays
    assert all(_feed(ctl, 4, 30, on=(1.0, 1.0), off=(1.01, 1.0))[:adaptive.REEXPLORE_EVERY - 10])


def test_reexplores_the_other_kind_now_and_then():
    ctl = AdaptiveSpeculation()
    choices = _feed(ctl, 8, 3 * adaptive.REEXPLORE_EVERY, on=(3.0, 1.0), off=(1.0, 1.0))
    plain_after_warmup = choices[2 * adaptive.MIN_SAMPLES:].count(False)
    assert 1 <= plain_after_warmup <= 3 * adaptive.REEXPLORE_BURST


def test_buckets_are_independent_and_disabled_always_speculates():
    ctl = AdaptiveSpeculation()
    _feed(ctl, 64, 30, on=(1.2, 2.0), off=(1.0, 1.0))
    assert ctl.speculate(1) is True  # a fresh bucket explores speculation first
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    off = AdaptiveSpeculation(enabled=False)
    assert all(_feed(off, 64, 10, on=(1.0, 9.0), off=(1.0, 1.0)))
    assert off.summary() == {}


# ---- losslessness under alternating steps ----------------------------------------------------------
class ScriptedSpeculation:
    """Stands in for the controller: speculate or not from a fixed pattern."""

    def __init__(self, pattern):
        self.pattern, self.i, self.log, self.recorded = list(pattern), 0, [], []

    def speculate(self, batch_size):
        spec = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        self.log.append(spec)
        return spec

    def record(self, batch_size, speculated, tokens, seconds):
        self.recorded.append(speculated)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=3)
    path = make_self_predicting_checkpoint(tmp_path_factory.mktemp("adaptive"), cfg, seed=5, residual_scale=0.005)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in rng.integers(2, 30, 8)]
    baseline = [o.token_ids for o in _llm(path).generate(prompts, GREEDY)]
    return path, prompts, baseline


def _llm(path, plugin_params=None):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=512, progress=False,
               plugin_params=plugin_params)


PATTERNS = {
    "alternate": [True, False],
    "plain runs": [True] * 2 + [False] * 5,
    "beyond catch-up": [True] + [False] * (CATCH_UP + 3),  # asks for more plain steps than CATCH_UP
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("mode,k", [("eagle", 2), ("vanilla", 3), ("vanilla", 1)])
def test_alternating_steps_are_lossless(case, mode, k, pattern):
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode})
    plugin = llm.engine.plugin_manager.plugins[0]
    plugin.adaptive = ScriptedSpeculation(PATTERNS[pattern])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert alone == expected
    assert True in plugin.adaptive.log and False in plugin.adaptive.log
    stats = [o.spec_decode for o in outs if o.spec_decode is not None]
    drafted = sum(s.num_draft_tokens for s in stats)
    # Speculative steps after plain ones still find the MTP caches up to date: drafts keep being
    # accepted (a stale cache would make this model's drafts miss).
    assert sum(s.num_accepted_tokens for s in stats) > 0.2 * drafted
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and not plugin.states


def test_adaptive_default_on_is_lossless(case):
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.plugin_manager.plugins[0].adaptive.enabled
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def _mtp_cache_rows(llm, prompt, pattern, margin):
    """Run one request under a speculation pattern; the first MTP module's cache rows of every
    position but the last ``margin`` (entries written from verified tokens only)."""
    engine = llm.engine
    plugin = engine.plugin_manager.plugins[0]
    plugin.adaptive = ScriptedSpeculation(pattern)
    for cache in engine.model_wrapper.caches:  # nothing left over from an earlier run
        cache.latent.zero_()
    state = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2 * CATCH_UP + 16, ignore_eos=True))
    table = []
    while not state.seq.is_finished:
        table = list(state.seq.block_table) or table  # freed when it finishes; the data stays
        engine.step()
    positions = np.arange(len(state.seq.token_ids) - margin)
    bs = engine.block_manager.block_size
    slots = np.asarray(table)[positions // bs] * bs + positions % bs
    cache = engine.model_wrapper.caches[engine.model_wrapper.config.num_hidden_layers]  # MTP module 0
    return cache.latent.view(-1, cache.latent.shape[-1])[slots].clone()


@pytest.mark.parametrize("mode,k", [("vanilla", 1), ("vanilla", 3), ("eagle", 2)])
def test_speculative_steps_catch_up_the_entries_plain_steps_skipped(case, mode, k):
    """The MTP cache entries written from verified tokens do not depend on which steps speculated:
    a speculative step after plain ones writes every entry they skipped."""
    path, prompts, _ = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode})
    margin = CATCH_UP + k + 2  # the newest entries may still hold draft-conditioned values
    always = _mtp_cache_rows(llm, prompts[0], [True], margin)
    assert always.abs().sum() > 0
    for pattern in ("plain runs", "beyond catch-up"):  # long plain runs are cut short: no entry is lost
        mixed = _mtp_cache_rows(llm, prompts[0], PATTERNS[pattern], margin)
        torch.testing.assert_close(mixed, always, atol=1e-5, rtol=1e-5)


def test_catch_up_steps_are_not_measured(case):
    """The first speculative step after plain ones writes the skipped MTP entries: it is no sample
    of steady speculation, so the controller never sees it."""
    path, prompts, _ = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 1, "mtp_mode": "vanilla"})
    plugin = llm.engine.plugin_manager.plugins[0]
    plugin.adaptive = ScriptedSpeculation([True, True, False, False, False])
    llm.generate(prompts[:1], GREEDY)
    log = plugin.adaptive.log
    # after two plain steps (3 entries behind, > K + 1 = 2) the next speculative step is a catch-up
    unmeasured = sum(1 for i in range(1, len(log)) if log[i] and log[i - 2:i] == [False, False])
    assert unmeasured > 0
    assert plugin.adaptive.recorded.count(True) == log.count(True) - unmeasured
    assert plugin.adaptive.recorded.count(False) == log.count(False)
