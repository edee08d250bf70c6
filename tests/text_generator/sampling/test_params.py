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


def test_plain_greedy_is_an_argmax_with_nothing_else_asked():
    assert SamplingParams(temperature=0).plain_greedy and SamplingParams(top_k=1).plain_greedy
    assert not SamplingParams(temperature=0.7).plain_greedy
    for extra in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(logit_bias={3: 1.0}),
                  dict(min_tokens=2), dict(logprobs=0)):
        assert not SamplingParams(temperature=0, **extra).plain_greedy, extra


def test_plain_greedy_steps_skip_the_sampling_metadata_with_the_same_tokens(monkeypatch):
    """A batch where every row is plain greedy samples by argmax alone; a row that asks for more
    (a penalty here) takes the full sampler. Both give the tokens the sampler would."""
    from mindspec import LLM
    from mindspec.config.defaults import default_model_dir
    from mindspec.text_generator.plugin_manager import PluginManager

    built = []
    original = PluginManager.sampling_metadata
    monkeypatch.setattr(PluginManager, "sampling_metadata", lambda *a, **k: built.append(1) or original(*a, **k))
    llm = LLM(model=str(default_model_dir()), backend="cpu", dtype="float32", cache_block_size=16, num_blocks=32,
              progress=False, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 2})
    prompt = list(range(5, 30))
    fast = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    assert not built
    # a negligible presence penalty: the same argmax here, but through the full sampler
    slow = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                 presence_penalty=1e-6))[0].token_ids
    assert built and fast == slow
