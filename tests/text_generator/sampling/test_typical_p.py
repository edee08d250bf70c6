"""typical_p (locally typical sampling) against transformers' TypicalLogitsWarper, its place in
the filter chain, and the sampled distribution."""
import pytest
import torch

from mindspec.text_generator.sampling import Sampler, SamplingMetadata, SamplingParams, SamplingParamsError, filter_logits


def build(params, vocab):
    n = len(params)
    return SamplingMetadata.build(params, [[] for _ in range(n)], [[] for _ in range(n)], None, vocab, "cpu")


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_kept_set_equals_transformers_typical_warper(mass):
    from transformers.generation.logits_process import TypicalLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 3
    md = build([SamplingParams(temperature=1.0, typical_p=mass)] * 8, 50)
    ours = torch.isfinite(filter_logits(logits, md))
    ref = torch.isfinite(TypicalLogitsWarper(mass=mass)(None, logits.clone()))
    assert torch.equal(ours, ref)


def test_applies_after_top_k_and_only_to_rows_that_ask():
    from transformers.generation.logits_process import TopKLogitsWarper, TypicalLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(2, 40) * 2
    md = build([SamplingParams(temperature=1.0, top_k=10, typical_p=0.5), SamplingParams(temperature=1.0)], 40)
    ours = torch.isfinite(filter_logits(logits, md))
    ref = TypicalLogitsWarper(mass=0.5)(None, TopKLogitsWarper(top_k=10)(None, logits[:1].clone()))
    assert torch.equal(ours[0], torch.isfinite(ref[0]))
    assert ours[1].all()


def test_samples_follow_the_typical_distribution():
    torch.manual_seed(2)
    logits = torch.randn(1, 12) * 2
    md = build([SamplingParams(temperature=1.0, typical_p=0.6)] * 20000, 12)
    from transformers.generation.logits_process import TypicalLogitsWarper

    target = TypicalLogitsWarper(mass=0.6)(None, logits.clone()).softmax(-1)[0]
    counts = torch.bincount(Sampler()(logits.expand(20000, 12), md).token_ids, minlength=12).float() / 20000
    assert (counts - target).abs().max() < 0.015
    assert counts[target == 0].sum() == 0


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan"), "x"])
def test_invalid_typical_p_is_named(bad):
    with pytest.raises(SamplingParamsError, match="typical_p"):
        SamplingParams(typical_p=bad)


def test_seeded_typical_sampling_is_the_same_with_mtp_on_and_off():
    from mindspec import LLM
    from mindspec.config.defaults import default_model_dir

    prompts = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]
    params = SamplingParams(temperature=0.7, top_k=10, typical_p=0.5, seed=3, max_tokens=24, ignore_eos=True)
    on = LLM(progress=False, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3, "adaptive_speculation": False})
    off = LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=16, num_blocks=256, progress=False)
    outs_on, outs_off = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    assert sum(o.spec_decode.num_accepted_tokens for o in outs_on) > 0
