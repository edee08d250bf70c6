import pytest

from mindspec.text_generator.sampling import SamplingParams, SamplingParamsError


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert p.temperature == 1.0 and p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy
    assert not SamplingParams(top_k=-1).greedy


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("stop", [1]),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["x"]),
        ("ignore_eos", 1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("skip_special_tokens", None),
    ],
)
def test_validation_names_field_and_value(field, value):
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**{field: value})
    assert exc.value.field == field
    assert field in str(exc.value)
    assert repr(value) in str(exc.value) or field == "stop"
    assert isinstance(exc.value, ValueError)


def test_min_tokens_above_max_tokens():
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=1.0),
        dict(top_k=1, top_p=1e-6, min_p=0.0),
        dict(presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=1e-3),
        dict(seed=0, logprobs=0),
        dict(seed=2**63 - 1, logprobs=20, max_tokens=1, min_tokens=1),
    ],
)
def test_boundary_values_accepted(kwargs):
    SamplingParams(**kwargs)
