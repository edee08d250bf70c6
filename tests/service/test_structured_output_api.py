"""Structured output through the HTTP APIs against a real server: OpenAI's response_format (the
official client's parse with a Pydantic model), vLLM's guided_* and structured_outputs on chat
and completions, streamed and not, TGI's parameters.grammar through its own client, and one 400
naming the field for every format the engine cannot compile (the server answers on)."""
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from text_generation import Client
from text_generation.errors import BadRequestError
from text_generation.types import FinishReason, Grammar, GrammarType

from mindspec.service.errors import ApiError
from mindspec.service.structured_request import StructuredFormat, add_response_format, add_tgi_grammar

MESSAGES = [{"role": "user", "content": "Describe a pet."}]
PROMPT = "def add(a, b):"
# no free strings: the tiny model fills them with noise, bounded integers end
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}
REGEX = r"[a-z]{2,4}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma"]
GRAMMAR = 'root ::= item (", " item)?\nitem ::= "x" | "y" [0-9]'
GRAMMAR_RE = r"(x|y[0-9])(, (x|y[0-9]))?"


class Pet(BaseModel):
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=6)


@pytest.mark.parametrize("spec, expected", [
    ({"type": "text"}, {}),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}, {"json_schema": SCHEMA}),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, {"json_object": True}),  # OpenAI's schema is optional
    ({"type": "json", "value": SCHEMA}, {"json_schema": SCHEMA}),  # TGI's chat route spells it so
    ({"type": "regex", "value": REGEX}, {"regex": REGEX}),
])
def test_response_format_spellings(spec, expected):
    fmt = StructuredFormat()
    add_response_format(fmt, spec)
    assert fmt.values() == expected and fmt.param == ("response_format" if expected else None)


def test_engine_errors_name_the_request_field():
    fmt = StructuredFormat()
    add_tgi_grammar(fmt, {"type": "regex", "value": "a("})
    err = fmt.renamed(ApiError(400, "invalid regex: the parenthesis is not closed"))
    assert (err.message, err.param) == ("invalid parameters.grammar: the parenthesis is not closed", "parameters.grammar")
    other = ApiError(400, "prompt is too long")
    assert fmt.renamed(other) is other


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120)


def test_parse_returns_the_pydantic_model(client):
    """openai 3.x: client.chat.completions.parse (client.beta.chat.completions.parse is the same method)."""
    out = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=60,
                                        temperature=0)
    message = out.choices[0].message
    assert isinstance(message.parsed, Pet) and out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), Pet.model_json_schema())
    assert message.content == json.dumps(json.loads(message.content), ensure_ascii=False)  # compact JSON


def _check_schema(text) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return text == json.dumps(json.loads(text))  # compact: ", " and ": ", no other whitespace


FORMATS = {  # name: (request fields, check of the output text)
    "json_object": ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}},
                    _check_schema),
    "guided_json": ({"guided_json": SCHEMA}, _check_schema),
    "guided_json_text": ({"guided_json": json.dumps(SCHEMA)}, _check_schema),
    "guided_regex": ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    "guided_choice": ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    "guided_grammar": ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
    "structured_outputs": ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
}


def _generate(client, route: str, stream: bool, extra: dict, **kw) -> tuple[list[str], list[str]]:
    """(texts, finish reasons) of every choice, joined from the stream's chunks where streamed."""
    common = dict(model="tiny", max_tokens=48, stream=stream, extra_body=extra, **kw)
    if route == "chat":
        resp = client.chat.completions.create(messages=MESSAGES, **common)
    else:
        resp = client.completions.create(prompt=PROMPT, **common)
    if not stream:
        return ([c.message.content if route == "chat" else c.text for c in resp.choices],
                [c.finish_reason for c in resp.choices])
    texts, reasons = {}, {}
    for chunk in resp:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + ((c.delta.content if route == "chat" else c.text) or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_formats_on_chat_and_completions(client, name, route, stream):
    fields, check = FORMATS[name]
    texts, reasons = _generate(client, route, stream, fields, temperature=0)
    assert reasons == ["stop"], texts
    assert check(texts[0]), texts


def test_n_choices_each_follow_the_format(client):
    texts, reasons = _generate(client, "completions", False, {"guided_choice": CHOICES}, n=4, temperature=1.0, seed=5)
    assert len(texts) == 4 and all(t in CHOICES for t in texts) and reasons == ["stop"] * 4


def test_tgi_client_grammar(server):
    tgi = Client(server.base, timeout=120)
    r = tgi.generate(PROMPT, max_new_tokens=48, grammar=Grammar(type=GrammarType.Json, value=SCHEMA))
    _check_schema(r.generated_text)
    assert r.details.finish_reason == FinishReason.EndOfSequenceToken
    r = tgi.generate(PROMPT, max_new_tokens=48, grammar=Grammar(type=GrammarType.Regex, value=REGEX))
    assert re.fullmatch(REGEX, r.generated_text)
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=48, grammar=Grammar(type=GrammarType.Json,
                                                                                 value=json.dumps(SCHEMA))))
    _check_schema(events[-1].generated_text)
    assert "".join(e.token.text for e in events if not e.token.special) == events[-1].generated_text
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 48, "grammar": {"type": "json_object"}}}
    assert isinstance(json.loads(httpx.post(server.base + "/generate", json=body, timeout=120).json()["generated_text"]),
                      dict)
    with pytest.raises(BadRequestError, match="parameters.grammar"):
        tgi.generate(PROMPT, max_new_tokens=8, grammar=Grammar(type=GrammarType.Regex, value="a("))


MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [  # (route, body, the param the 400 names)
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MSG, "guided_json": {"type": "objectx"}, "stream": True}, "guided_json"),
    ("/v1/chat/completions", {"messages": MSG, "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a("}, "guided_regex"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a(", "n": 3}, "guided_regex"),
    ("/v1/completions", {"prompt": "a", "guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "a", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex"),
    ("/generate", {"inputs": "a", "parameters": {"grammar": {"type": "json", "value": {"type": "objectx"}}}},
     "parameters.grammar"),
    ("/generate_stream", {"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": "a("}}},
     "parameters.grammar"),
    ("/", {"inputs": "a", "parameters": {"grammar": {"type": "ebnf", "value": "x"}}}, "parameters.grammar"),
]


@pytest.mark.parametrize("route, body, param", BAD_REQUESTS, ids=[p for _, _, p in BAD_REQUESTS])
def test_a_bad_format_is_one_400_naming_its_field(server, route, body, param):
    r = httpx.post(server.base + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and server.healthy()


def test_the_openai_client_sees_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, extra_body={"guided_regex": "a("})
    assert err.value.body["param"] == "guided_regex" and "parenthesis" in err.value.body["message"]
