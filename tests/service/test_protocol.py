"""Request bodies: chat content parts and vLLM's sampling extras, checked without a server."""
import pytest

from mindspec.service.errors import ApiError
from mindspec.service.protocol import ChatCompletionRequest, CompletionRequest


def test_text_and_refusal_parts_reach_the_template_in_order():
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "text", "text": "!"}]},
    ])
    body.check_supported()
    assert [m.template_dict()["content"] for m in body.messages] == ["a b", "no!"]


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}, {"text": "no type"}])
def test_a_part_the_model_cannot_read_is_named(part):
    body = ChatCompletionRequest(messages=[{"role": "system", "content": "s"},
                                           {"role": "user", "content": [{"type": "text", "text": "t"}, part]}])
    with pytest.raises(ApiError) as err:
        body.check_supported()
    assert err.value.param == "messages[1].content[1].type" and "text only" in str(err.value)


def test_vllm_extras_reach_the_sampling_params():
    params = CompletionRequest(prompt="a", max_tokens=8, min_tokens=3, skip_special_tokens=False).sampling_params(16)
    assert params.min_tokens == 3 and params.skip_special_tokens is False
    default = CompletionRequest(prompt="a").sampling_params(16)
    assert default.min_tokens == 0 and default.skip_special_tokens is True
