"""Structured output's token masks in the sampler: every choice (greedy, sampling, the
speculative targets' probabilities) sees only the allowed tokens; a min_tokens ban that would
leave a row nothing gives way to the format."""
import pytest
import torch

from mindspec.text_generator.sampling.metadata import SamplingMetadata
from mindspec.text_generator.sampling.params import SamplingParams, SamplingParamsError
from mindspec.text_generator.sampling.sampler import Sampler, penalised_logits, processed_probs

V = 40


def _bitmask(rows: list[list[int]]) -> torch.Tensor:
    words = torch.zeros(len(rows), (V + 31) // 32, dtype=torch.int64)
    for r, tokens in enumerate(rows):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)  # wraps bit 31 like xgrammar's int32 words


def _md(params, outputs=None):
    n = len(params)
    return SamplingMetadata.build(params, [[] for _ in range(n)], outputs or [[] for _ in range(n)], None, V, "cpu",
                                  eos_token_ids=[1])


def test_rows_take_only_allowed_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0, regex="x"), SamplingParams(temperature=1.0, seed=3, regex="x"),
              SamplingParams(temperature=0)]
    md = _md(params)
    md.constrain(_bitmask([[5, 31], [2, 33, 39]]), [0, 1])  # row 2 is free
    pen = penalised_logits(logits, md)
    assert torch.isfinite(pen[0]).nonzero().flatten().tolist() == [5, 31]
    assert torch.isfinite(pen[1]).nonzero().flatten().tolist() == [2, 33, 39]
    assert torch.equal(pen[2], logits[2])
    probs = processed_probs(logits, md)
    assert set(probs[1].nonzero().flatten().tolist()) <= {2, 33, 39}
    assert abs(float(probs[1].sum()) - 1) < 1e-6
    for _ in range(20):
        out = Sampler()(logits, md).token_ids.tolist()
        assert out[0] == max((5, 31), key=lambda t: logits[0, t]) and out[1] in (2, 33, 39)
        assert out[2] == int(logits[2].argmax())


def test_the_format_wins_over_a_min_tokens_ban():
    logits = torch.zeros(2, V)
    params = [SamplingParams(temperature=0, min_tokens=5, choice=["a"]), SamplingParams(temperature=0, min_tokens=5, choice=["a"])]
    md = _md(params)
    md.constrain(_bitmask([[1], [1, 7]]), [0, 1])  # row 0: the format is complete, only EOS (1) is allowed
    pen = penalised_logits(logits, md)
    assert torch.isfinite(pen[0]).nonzero().flatten().tolist() == [1]  # ended although min_tokens bans EOS
    assert torch.isfinite(pen[1]).nonzero().flatten().tolist() == [7]  # the ban holds where it leaves a token


@pytest.mark.parametrize("kwargs, field", [
    (dict(regex="a", choice=["b"]), "choice"),
    (dict(json_schema="{not json"), "json_schema"),
    (dict(json_schema=[1]), "json_schema"),
    (dict(regex=""), "regex"),
    (dict(grammar=3), "grammar"),
    (dict(choice=[]), "choice"),
    (dict(choice=["a", ""]), "choice"),
    (dict(json_object="yes"), "json_object"),
])
def test_structured_fields_are_validated(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_a_format_turns_off_the_plain_greedy_path():
    assert SamplingParams(temperature=0).plain_greedy
    assert not SamplingParams(temperature=0, json_object=True).plain_greedy
    assert SamplingParams(json_schema={"type": "object"}).structured == ("json_schema", '{"type": "object"}')
    assert SamplingParams(json_schema='{"type": "object"}').structured == ("json_schema", '{"type": "object"}')
