"""logit_bias: validation, and the sampler adding it before greedy and sampled choices."""
import math

import pytest
import torch

from mindspec.text_generator.sampling import (
    Sampler,
    SamplingMetadata,
    SamplingParams,
    SamplingParamsError,
    penalised_logits,
)


def build(params, vocab, outputs=None):
    n = len(params)
    return SamplingMetadata.build(params, [[] for _ in range(n)], outputs or [[] for _ in range(n)], None, vocab, "cpu")


@pytest.mark.parametrize("bias", [
    {3: 100.5}, {3: -101}, {3: math.inf}, {3: math.nan}, {-1: 1.0}, {"x": 1.0}, {3: "1"}, {3: True}, [1, 2], {1.5: 2},
])
def test_bad_logit_bias_names_the_field(bias):
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(logit_bias=bias)
    assert exc.value.field == "logit_bias"
    assert "logit_bias" in str(exc.value)


def test_logit_bias_accepts_the_openai_range_and_json_keys():
    p = SamplingParams(logit_bias={"7": 100, 2: -100, "11": 0.5})
    assert p.logit_bias == {7: 100.0, 2: -100.0, 11: 0.5}
    assert all(isinstance(k, int) and isinstance(v, float) for k, v in p.logit_bias.items())
    assert SamplingParams(logit_bias={}).logit_bias == {}


def test_bias_is_added_to_the_penalised_logits_of_its_row_only():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 0.5]])
    md = build([SamplingParams(temperature=0, logit_bias={0: 5.0, 2: -1.5}), SamplingParams(temperature=0)], 4)
    out = penalised_logits(logits, md)
    assert out.tolist() == [[6.0, 2.0, 1.5, 0.5], [1.0, 2.0, 3.0, 0.5]]
    assert logits.tolist()[0] == [1.0, 2.0, 3.0, 0.5]  # the input is untouched


def test_bias_combines_with_penalties_and_min_tokens_bans():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    # frequency penalty 1 on token 1 (seen twice): 2 - 2 = 0; bias +4 on it: 4; eos 3 banned
    params = SamplingParams(temperature=0, frequency_penalty=1.0, logit_bias={1: 4.0, 3: 100.0}, min_tokens=5)
    md = SamplingMetadata.build([params], [[]], [[1, 1]], None, 4, "cpu", eos_token_ids=[3])
    out = penalised_logits(logits, md)
    assert out[0, :3].tolist() == [1.0, 4.0, 3.0]
    assert out[0, 3].item() == float("-inf")  # a ban wins over any bias
    assert Sampler()(logits, md).token_ids.tolist() == [1]


def test_plus_100_forces_and_minus_100_bans_greedy_and_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    top = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=0, logit_bias={17: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={17: 100.0}, seed=3),
        SamplingParams(temperature=0, logit_bias={int(top[2]): -100.0}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=5, logit_bias={int(top[4]): -100.0}, seed=1),
        SamplingParams(temperature=0, logit_bias={int(top[5]): -100.0}, logprobs=2),
    ]
    res = Sampler()(logits, build(params, 50))
    ids = res.token_ids.tolist()
    assert ids[0] == 17 and ids[1] == 17
    second = logits[2].topk(2).indices[1].item()
    assert ids[2] == second and ids[3] == top[3].item()
    assert ids[4] != top[4].item()
    # reported logprobs are those of the biased distribution (vLLM's "processed" logits)
    biased = logits[5].clone()
    biased[top[5]] -= 100.0
    assert res.logprobs[5].item() == pytest.approx(biased.log_softmax(-1)[ids[5]].item(), abs=1e-5)


def test_metadata_rejects_bias_outside_the_vocabulary():
    with pytest.raises(ValueError, match="logit_bias"):
        build([SamplingParams(logit_bias={9: 1.0})], 8)
