"""Relaxed and typical acceptance through the engine."""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

THINK, END_THINK = 200, 201
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=1)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("pol"), cfg, seed=11, residual_scale=0.01)


def _run(path, prompts, **policy):
    # Fixed K: adaptive speculation picks draft counts from measured step times, so accepted
    # counts would vary with the machine's load, not only with the policy.
    pp = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "eagle", "adaptive_speculation": False,
          **policy}
    llm = LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=256, progress=False, plugin_params=pp)
    return llm.generate(prompts, GREEDY)


def _prompts(think: bool):
    rng = np.random.default_rng(5)
    body = [rng.integers(2, 190, int(n)).tolist() for n in rng.integers(2, 20, 8)]
    return [([THINK] + p if think else p) for p in body]


def _accepted(outs):
    return sum(o.spec_decode.num_accepted_tokens for o in outs)


def test_relaxed_delta_zero_equals_strict(checkpoint):
    prompts = _prompts(think=True)
    strict = _run(checkpoint, prompts)
    relaxed = _run(checkpoint, prompts, decoding_policy="relaxed", relaxed_topk=10, relaxed_delta=0.0,
                   think_start_token_id=THINK, think_end_token_id=END_THINK)
    assert [o.token_ids for o in relaxed] == [o.token_ids for o in strict]


def test_relaxed_only_relaxes_inside_the_think_span(checkpoint):
    kw = dict(decoding_policy="relaxed", relaxed_topk=10, relaxed_delta=0.6,
              think_start_token_id=THINK, think_end_token_id=END_THINK)
    outside = _prompts(think=False)
    assert [o.token_ids for o in _run(checkpoint, outside, **kw)] == [o.token_ids for o in _run(checkpoint, outside)]
    inside = _prompts(think=True)
    assert _accepted(_run(checkpoint, inside, **kw)) > _accepted(_run(checkpoint, inside))


def test_typical_accepts_at_least_what_strict_accepts(checkpoint):
    prompts = _prompts(think=False)
    typical = _run(checkpoint, prompts, decoding_policy="typical", posterior_threshold=0.09, posterior_alpha=0.3)
    assert _accepted(typical) >= _accepted(_run(checkpoint, prompts))
