"""logit_bias through the whole engine on the shipped model, with MTP on and off."""
import pytest

from mindspec import LLM, SamplingParams
from mindspec.config.defaults import default_model_dir
from mindspec.engine.errors import RequestRejected

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def mtp_on():
    # the shipped default (MTP, K = 3), speculating on every step so drafts are always verified
    return LLM(progress=False, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3,
                                              "adaptive_speculation": False})


@pytest.fixture(scope="module")
def mtp_off():
    return LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=16, num_blocks=256, progress=False)


def greedy(n=12, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_plus_100_forces_a_token(mtp_on, mtp_off):
    for llm in (mtp_on, mtp_off):
        out = llm.generate(PROMPTS, greedy(logit_bias={500: 100.0}))
        assert all(o.token_ids == [500] * 12 for o in out)


def test_minus_100_bans_the_token_greedy_picks(mtp_on, mtp_off):
    plain = mtp_off.generate(PROMPTS, greedy())
    for prompt, ref in zip(PROMPTS, plain):
        banned = ref.token_ids[0]
        for llm in (mtp_on, mtp_off):
            out = llm.generate([prompt], greedy(logit_bias={banned: -100.0}))[0]
            assert banned not in out.token_ids
            assert out.token_ids[0] != ref.token_ids[0]


def test_bias_keeps_mtp_lossless(mtp_on, mtp_off):
    # A moderate bias changes the text without pinning it: MTP's drafts (unbiased) then disagree
    # with the biased targets at times, which verification must reject.
    plain = mtp_off.generate(PROMPTS, greedy(32))
    bias = {plain[0].token_ids[2]: -100.0, 309: 3.0, 13: 2.5}
    off = mtp_off.generate(PROMPTS, greedy(32, logit_bias=bias))
    on = mtp_on.generate(PROMPTS, greedy(32, logit_bias=bias))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.token_ids for o in off] != [o.token_ids for o in plain]
    assert sum(o.spec_decode.num_draft_tokens for o in on) > 0


def test_seeded_sampling_with_bias_is_the_same_with_mtp_on_and_off(mtp_on, mtp_off):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logit_bias={309: 4.0, 200: -100.0})
    off = mtp_off.generate(PROMPTS, params)
    on = mtp_on.generate(PROMPTS, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert all(200 not in o.token_ids for o in off)


def test_token_ids_outside_the_vocabulary_are_rejected(mtp_on):
    engine = mtp_on.engine
    vocab = engine.model_wrapper.config.vocab_size
    with pytest.raises(RequestRejected, match="logit_bias"):
        engine.add_request("x", SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
