"""huggingface_hub's InferenceClient with base_url against a real server of the shipped model:
text_generation (plain, details, stream, stream with details) on TGI's root route and
chat_completion on /v1/chat/completions."""
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import BadRequestError
from transformers import AutoTokenizer

from mindspec.config.defaults import DEFAULT_MODEL_DIR

from .conftest import Server, free_port, write_config

NAME = "mindspec-default"
PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def shipped_server(tmp_path_factory):
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path_factory.mktemp("hf_svc") / "config.json", DEFAULT_MODEL_DIR, ports,
                       **{"BackendConfig.ModelDeployConfig.ModelConfig.0.modelName": NAME,
                          "BackendConfig.ModelDeployConfig.ModelConfig.0.plugin_params":
                              {"plugin_type": "mtp", "num_speculative_tokens": 3}})
    srv = Server(cfg, ports)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def hf(shipped_server):
    return InferenceClient(base_url=shipped_server.base, timeout=120)


def test_text_generation_plain_and_details(hf):
    text = hf.text_generation(PROMPT, max_new_tokens=12)
    out = hf.text_generation(PROMPT, max_new_tokens=12, details=True, decoder_input_details=True)
    assert isinstance(text, str) and out.generated_text == text
    d = out.details
    assert d.finish_reason in ("length", "eos_token") and d.generated_tokens == len(d.tokens) <= 12
    assert "".join(t.text for t in d.tokens if not t.special) == text
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    assert [t.id for t in d.prefill] == tok(PROMPT)["input_ids"]
    assert tok.decode([t.id for t in d.tokens], skip_special_tokens=True) == text


def test_text_generation_stream_with_and_without_details(hf):
    text = hf.text_generation(PROMPT, max_new_tokens=12)
    pieces = list(hf.text_generation(PROMPT, max_new_tokens=12, stream=True))
    events = list(hf.text_generation(PROMPT, max_new_tokens=12, stream=True, details=True))
    assert [e.token.text for e in events] == pieces
    assert "".join(e.token.text for e in events if not e.token.special) == text
    assert events[-1].generated_text == text and events[-1].details.generated_tokens == len(events)
    assert all(e.details is None for e in events[:-1])


def test_text_generation_rejects_best_of(hf):
    with pytest.raises(BadRequestError, match="best_of"):
        hf.text_generation(PROMPT, max_new_tokens=4, best_of=2, do_sample=True)


def test_chat_completion_with_the_served_name(hf):
    messages = [{"role": "user", "content": "write a function that adds two numbers"}]
    out = hf.chat_completion(model=NAME, messages=messages, max_tokens=10, temperature=0)
    choice = out.choices[0]
    assert out.model == NAME and choice.message.role == "assistant" and choice.message.content
    assert out.usage.completion_tokens <= 10 and choice.finish_reason in ("length", "stop")
    streamed = hf.chat_completion(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == choice.message.content
