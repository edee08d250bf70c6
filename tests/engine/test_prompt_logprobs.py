"""Prompt logprobs on the shipped model, checked against transformers' DeepseekV3 on the same
checkpoint (float32), with MTP on and off; max_tokens 0 scores the prompt only."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.config.defaults import default_model_dir
from mindspec.text_generator import prompt_logprobs as plp
from mindspec.text_generator.sampling import SamplingParamsError
from tests.support.checkpoints import load_hf_model
from tests.support.hf_reference import hf_logits

ATOL = 1e-4
PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n\n\ndef main():", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def hf():
    return load_hf_model(default_model_dir(), torch.float32)


@pytest.fixture(scope="module")
def mtp_on():
    return LLM(progress=False, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3,
                                              "adaptive_speculation": False})


@pytest.fixture(scope="module")
def mtp_off():
    return LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=16, num_blocks=512, progress=False)


def reference(hf, ids):
    """[L-1, V] log p(. | ids[:i]) for i = 1..L-1 from transformers."""
    return hf_logits(hf, ids)[:-1].log_softmax(dim=-1)


def check_against_reference(hf, out, k):
    ids = out.prompt_token_ids
    ref = reference(hf, ids)
    assert len(out.prompt_logprobs) == len(ids) == len(out.prompt_top_logprobs)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    want = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    np.testing.assert_allclose(out.prompt_logprobs[1:], want.numpy(), atol=ATOL, rtol=0)
    for i, top in enumerate(out.prompt_top_logprobs[1:]):
        assert top[ids[i + 1]] == pytest.approx(out.prompt_logprobs[i + 1])
        expected_ids = set(ref[i].topk(k).indices.tolist()) if k else set()
        assert set(top) == expected_ids | {ids[i + 1]}
        for t, v in top.items():
            assert v == pytest.approx(ref[i, t].item(), abs=ATOL)


@pytest.mark.parametrize("which", ["mtp_on", "mtp_off"])
@pytest.mark.parametrize("k", [0, 5])
def test_prompt_logprobs_match_transformers(hf, which, k, request):
    llm = request.getfixturevalue(which)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=k)
    outs = llm.generate(PROMPTS, params)  # one batched prefill of three prompts
    for out in outs:
        check_against_reference(hf, out, k)


def test_long_prompt_spans_several_lm_head_chunks(hf, mtp_on):
    ids = np.random.default_rng(0).integers(2, 4096, plp.CHUNK_ROWS + 77).tolist()
    out = mtp_on.generate([ids, PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    check_against_reference(hf, out[0], 2)
    check_against_reference(hf, out[1], 2)


def test_generated_tokens_do_not_change(mtp_on, mtp_off):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=3, logprobs=2)
    expected = [o.token_ids for o in mtp_off.generate(PROMPTS, plain)]
    for llm in (mtp_on, mtp_off):
        outs = llm.generate(PROMPTS, scored)
        assert [o.token_ids for o in outs] == expected
        assert all(o.prompt_logprobs is not None for o in outs)


def test_streamed_outputs_carry_them_from_the_prefill_on(mtp_off):
    engine = mtp_off.engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1), request_id="s")
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3), request_id="plain")
    seen = []
    while engine.has_unfinished():
        seen.extend(engine.step())
    scored = [o for o in seen if o.request_id == "s"]
    assert len(scored) == 3 and all(o.prompt_logprobs is not None for o in scored)
    assert all(o.prompt_logprobs is None and o.prompt_top_logprobs is None for o in seen if o.request_id == "plain")


@pytest.mark.parametrize("which", ["mtp_on", "mtp_off"])
def test_max_tokens_zero_scores_the_prompt_only(hf, which, request):
    llm = request.getfixturevalue(which)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=0))
    for out in outs:
        assert out.finished and out.finish_reason == "length"
        assert out.token_ids == [] and out.text == ""
        check_against_reference(hf, out, 0)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not llm.engine.requests
    assert not any(getattr(p, "states", None) for p in llm.engine.plugin_manager.plugins)


def test_one_token_prompt_has_one_empty_entry(mtp_off):
    out = mtp_off.generate([[17]], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == [None] and out.prompt_top_logprobs == [None] and out.token_ids == []


def test_prompt_logprobs_survive_a_preemption(hf, tmp_path):
    # 14 usable 4-token blocks for four requests that each grow to 3 blocks and more: some are
    # preempted and recomputed; their prompt logprobs stay those of the first prefill.
    llm = LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=4, num_blocks=15, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 2, "adaptive_speculation": False})
    prompts = [PROMPTS[2], PROMPTS[2] + " ", "y = 2", "z = 3"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1))
    assert sum(o.num_preemptions for o in outs) > 0
    for out in outs:
        check_against_reference(hf, out, 1)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_names_the_field(bad):
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(prompt_logprobs=bad)
    assert exc.value.field == "prompt_logprobs"


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(max_tokens=0)
    assert exc.value.field == "max_tokens"
    with pytest.raises(SamplingParamsError):
        SamplingParams(max_tokens=-1, prompt_logprobs=0)


def test_async_scheduling_mixes_scoring_and_generating(hf, mtp_off):
    llm = LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=16, num_blocks=128, progress=False,
              async_scheduling=True, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 2})
    params = [SamplingParams(max_tokens=0, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)]
    outs = llm.generate(PROMPTS, params)
    assert outs[0].token_ids == [] and outs[0].finish_reason == "length"
    check_against_reference(hf, outs[0], 2)
    check_against_reference(hf, outs[2], 0)
    assert outs[1].prompt_logprobs is None
    expected = mtp_off.generate(PROMPTS[1:], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in expected]
