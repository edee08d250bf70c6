"""Sampled requests are sampled inside plain decode steps and accept inside the speculative step (the targets sampled there: sampling/
step_targets.py): the tokens MTP off samples, seeded or not, beside greedy requests; top-p sets
past the ranked head are done over the whole row inside, or, where steps are captured graphs,
on the host; requests that ask for more than temperature, top-k and top-p are sampled and
accepted on the host, with the same tokens."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.plugins.mtp import adaptive
from mindspec.text_generator import plugin_manager
from mindspec.text_generator.sampling import step_targets
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
from tests.support.in_step_acceptance import record_acceptance, record_plain_sampling

MTP = {"plugin_type": "mtp", "num_speculative_tokens": 2, "adaptive_speculation": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("sampled"), cfg, seed=5, residual_scale=0.005)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(2, 200, int(n)).tolist() for n in (4, 9, 2, 13, 6, 3)]


def _llm(path, plugin_params=None, **kw):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=256, progress=False,
               plugin_params=plugin_params, **kw)


def _params(**kw):
    """Seeded sampling, unseeded sampling with the torch seed set, greedy, top-k: one per prompt."""
    base = dict(max_tokens=14, ignore_eos=True, **kw)
    return [SamplingParams(temperature=0.8, top_p=0.9, seed=1, **base), SamplingParams(temperature=1.0, seed=2, **base),
            SamplingParams(temperature=0, **base), SamplingParams(temperature=0.6, top_k=12, top_p=0.95, seed=3, **base),
            SamplingParams(temperature=1.2, seed=4, **base), SamplingParams(temperature=0.7, top_k=5, seed=5, **base)]


def _tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_sampled_steps_accept_inside_and_give_mtp_off_s_tokens(checkpoint, prompts, mode, monkeypatch):
    expected = _tokens(_llm(checkpoint), prompts, _params())
    seen = record_acceptance(monkeypatch)
    llm = _llm(checkpoint, {**MTP, "mtp_mode": mode})
    assert _tokens(llm, prompts, _params()) == expected
    assert seen["sampled"] > 0 and seen["host"] == seen["undecided"] == 0
    accepted = sum(o.spec_decode.num_accepted_tokens for o in llm.generate(prompts, _params()))
    assert accepted > 0


def test_unseeded_sampling_follows_the_torch_seed(checkpoint, prompts, monkeypatch):
    """Unseeded rows are keyed by the sampler's host draws, in the step as on the host: the same
    torch seed, the same tokens, with MTP on and off."""
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * len(prompts)
    seen = record_acceptance(monkeypatch)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(_tokens(_llm(checkpoint, MTP), prompts, params))
    assert runs[0] == runs[1] and seen["sampled"] > 0
    torch.manual_seed(124)
    assert _tokens(_llm(checkpoint, MTP), prompts, params) != runs[0]


@pytest.mark.parametrize("whole_rows", [True, False], ids=["whole-rows", "captured"])
def test_top_p_sets_past_the_head_are_decided_over_whole_rows_or_on_the_host(checkpoint, prompts, whole_rows,
                                                                             monkeypatch):
    """With a ranked head of 2 logits in the step most top-p sets reach past it. On the cpu
    backend the step does those rows over the whole vocabulary itself; where steps are captured
    graphs (``whole_rows`` off) those steps keep nothing and say so, and the host samples and
    accepts them. The tokens stay MTP off's either way."""
    expected = _tokens(_llm(checkpoint), prompts, _params())
    monkeypatch.setattr(step_targets, "RANK_CANDIDATES", 2)
    seen = record_acceptance(monkeypatch)
    llm = _llm(checkpoint, MTP)
    assert llm.engine.model_wrapper.whole_rows  # cpu: no captured graphs
    llm.engine.model_wrapper.whole_rows = whole_rows
    assert _tokens(llm, prompts, _params()) == expected
    if whole_rows:
        assert seen["sampled"] > 0 and seen["undecided"] == seen["host"] == 0
    else:
        assert seen["undecided"] > 0


def test_a_request_with_penalties_puts_its_steps_on_the_host(checkpoint, prompts, monkeypatch):
    params = _params()
    params[4] = SamplingParams(temperature=1.2, seed=4, repetition_penalty=1.2, max_tokens=14, ignore_eos=True)
    expected = _tokens(_llm(checkpoint), prompts, params)
    seen = record_acceptance(monkeypatch)
    assert _tokens(_llm(checkpoint, MTP), prompts, params) == expected
    assert seen["host"] > 0


@pytest.mark.parametrize("plugin_params", [None, {**MTP, "adaptive_speculation": True}], ids=["mtp-off", "adaptive"])
def test_plain_steps_sample_inside_with_the_host_sampler_s_tokens(checkpoint, prompts, plugin_params, monkeypatch):
    """MTP off, and the plain steps adaptive speculation chooses: the tokens the host sampler
    gives when the steps are given no target rows."""
    monkeypatch.setattr(plugin_manager, "samples_in_step", lambda params: False)
    host = _tokens(_llm(checkpoint, plugin_params), prompts, _params())
    monkeypatch.undo()
    seen = record_plain_sampling(monkeypatch)
    monkeypatch.setattr(adaptive, "SETTLE", 0)  # arms timed in runs of MIN_SAMPLES: plain steps within 14 tokens
    llm = _llm(checkpoint, plugin_params)
    assert _tokens(llm, prompts, _params()) == host
    assert seen["in_step"] > 0 and seen["host"] == seen["undecided"] == 0


@pytest.mark.parametrize("whole_rows", [True, False], ids=["whole-rows", "captured"])
def test_plain_steps_past_the_head_are_decided_over_whole_rows_or_on_the_host(checkpoint, prompts, whole_rows,
                                                                             monkeypatch):
    expected = _tokens(_llm(checkpoint), prompts, _params())
    monkeypatch.setattr(step_targets, "RANK_CANDIDATES", 2)
    seen = record_plain_sampling(monkeypatch)
    llm = _llm(checkpoint)
    llm.engine.model_wrapper.whole_rows = whole_rows
    assert _tokens(llm, prompts, _params()) == expected
    if whole_rows:
        assert seen["in_step"] > 0 and seen["undecided"] == seen["host"] == 0
    else:
        assert seen["undecided"] > 0
