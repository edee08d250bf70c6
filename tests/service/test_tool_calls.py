"""OpenAI tool calls: DeepSeek's tool-call syntax parsed out of text (V3 and V3.1, several calls,
malformed markers left as content), the stream deltas, the checks of tools and tool_choice, and
a real server answering tool_choice "required", a named function, "auto" and "none" (streamed:
the official client's stream accumulation rebuilds the calls)."""
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from mindspec.service.errors import ApiError
from mindspec.service.tool_calls import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, Tool, ToolPlan,
                                         ToolStream, parse_deepseek, parse_required, tool_plan)

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
# strict: the client's stream helper only accumulates strict tools
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema,
                                           "strict": True}} for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def v3_call(name, args):
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31_call(name, args):
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


# ---- parsing DeepSeek's syntax ------------------------------------------------------------------

@pytest.mark.parametrize("call", [v3_call, v31_call], ids=["v3", "v3.1"])
def test_parse_several_calls(call):
    calls = call("get_weather", json.dumps({"city": "Paris"})) + "\n" + call("add", json.dumps({"a": 1}))
    text = f"Let me look.{CALLS_BEGIN}{calls}{CALLS_END}"
    content, calls = parse_deepseek(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_deepseek(f"{CALLS_BEGIN}{call('add', '{}')}{CALLS_END}")[0] is None  # no text before: null content


@pytest.mark.parametrize("text", [
    "plain text, no markers",
    f"cut short {CALLS_BEGIN}{v31_call('add', '{}')}",  # no end marker
    f"{CALLS_BEGIN}{CALL_BEGIN}add{SEP}{{\"a\": 1",  # unterminated call
    f"{CALLS_BEGIN}{CALL_BEGIN}add {{}}{CALL_END}{CALLS_END}",  # no separator
    f"{CALLS_BEGIN}{CALLS_END}",  # no calls
    f"{CALLS_BEGIN}junk{v31_call('add', '{}')}{CALLS_END}",
])
def test_malformed_markers_stay_content(text):
    assert parse_deepseek(text) == (text, [])


def test_auto_stream_holds_back_what_may_be_a_marker():
    text = f"Sure<{CALLS_BEGIN}{v3_call('add', json.dumps({'a': 2, 'b': 3}))}{CALLS_END}"
    reader = ToolStream(ToolPlan(mode="auto"))
    deltas = [d for i in range(1, len(text) + 1) for d in reader.update(text[:i])]
    assert "".join(d["content"] for d in deltas) == "Sure<"  # the "<" was held until it was not the marker
    last, reason = reader.finish(text, "stop")
    assert reason == "tool_calls" and [list(d) for d in last] == [["tool_calls"], ["tool_calls"]]
    head, args = last[0]["tool_calls"][0], last[1]["tool_calls"][0]
    assert head["function"] == {"name": "add", "arguments": ""} and head["index"] == args["index"] == 0
    assert json.loads(args["function"]["arguments"]) == {"a": 2, "b": 3}
    # malformed: the held text comes out as content at the end
    reader = ToolStream(ToolPlan(mode="auto"))
    bad = f"a{CALLS_BEGIN}{CALL_BEGIN}add"
    sent = [d for i in range(1, len(bad) + 1) for d in reader.update(bad[:i])]
    last, reason = reader.finish(bad, "length")
    assert "".join(d["content"] for d in sent + last) == bad and reason == "length"


def test_named_stream_sends_the_head_then_the_arguments():
    reader = ToolStream(ToolPlan(tools=[Tool.model_validate(TOOLS[1])], mode="named", name="add"))
    deltas = reader.update("") + reader.update('{"a": ') + reader.update('{"a": 4, "b": 5}')
    last, reason = reader.finish('{"a": 4, "b": 5}', "stop")
    head, *pieces = deltas + last
    assert head["tool_calls"][0]["function"] == {"name": "add", "arguments": ""} and head["tool_calls"][0]["id"]
    assert "".join(p["tool_calls"][0]["function"]["arguments"] for p in pieces) == '{"a": 4, "b": 5}'
    assert reason == "tool_calls" and reader.finish('{"a": 4', "length")[1] == "length"


def test_required_schema_and_parse():
    plan = tool_plan([Tool.model_validate(t) for t in TOOLS], "required", parallel=False)
    schema = plan.required_schema()
    good = [{"name": "add", "parameters": {"a": 1, "b": 2}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"city": "Paris", "days": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate(good * 2, schema)
    content, calls = parse_required('[{"name": "add", "parameters": {"a": 1, "b": 2}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert parse_required('[{"name": "add", "param') == ('[{"name": "add", "param', [])  # cut short: content


def test_plan_checks_name_the_field():
    tools = [Tool.model_validate(t) for t in TOOLS]
    for tools_, choice, param in [
        (tools, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (tools, "nope", "tool_choice"),  # TGI's client sends a bare name
        (tools, {"type": "function"}, "tool_choice"),
        (None, "required", "tool_choice"),
        (tools + tools[:1], "auto", "tools"),  # a name twice
        ([Tool(type="code_interpreter", function=tools[0].function)], "auto", "tools"),
    ]:
        with pytest.raises(ApiError) as err:
            tool_plan(tools_, choice, None)
        assert err.value.status == 400 and err.value.param == param
    assert tool_plan(tools, None, None).mode == "auto" and tool_plan(None, None, None).mode == "none"
    assert tool_plan(tools, "add", None).name == "add"


def test_tools_reach_the_chat_template(tiny_model):
    from mindspec.text_generator.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model)
    tok.hf_tokenizer.chat_template = ("{% for t in tools %}[{{ t.function.name }}:{{ t.function.parameters | tojson }}]"
                                      "{% endfor %}{{ messages[0].content }}")
    plan = tool_plan([Tool.model_validate(t) for t in TOOLS], "auto", None)
    text = tok.render_chat_template(MESSAGES, tools=plan.template_tools())
    assert text.startswith("[get_weather:{") and "[add:{" in text and text.endswith(MESSAGES[0]["content"])


# ---- a real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120)


def chat(client, **kw):
    kw = {"max_tokens": 200, "temperature": 0, **kw}
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, **kw)


def check_calls(message, names=tuple(SCHEMAS)):
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_returns_calls_of_the_tools(client):
    out = chat(client, tool_choice="required")
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message)
    assert len(out.choices[0].message.tool_calls) == 2  # what the tiny model writes: both tools, one each


def test_required_with_n_choices_one_call_each(client):
    out = chat(client, tool_choice="required", n=3, temperature=1.0, seed=11, parallel_tool_calls=False)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        check_calls(c.message)


def test_named_function(client):
    out = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message, names=("get_weather",))
    cut = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_named_function_from_a_pydantic_tool(client):
    class Lookup(BaseModel):
        city: str = Field(max_length=6)
        days: int = Field(ge=1, le=7)

    out = client.chat.completions.parse(model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(Lookup)],
                                        tool_choice={"type": "function", "function": {"name": "Lookup"}},
                                        max_tokens=48, temperature=0)
    assert isinstance(out.choices[0].message.tool_calls[0].function.parsed_arguments, Lookup)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_streamed_calls_accumulate_in_the_client(client, tool_choice):
    whole = chat(client, tool_choice=tool_choice).choices[0].message
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                        max_tokens=200, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    check_calls(final.message)
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert any(e.type == "tool_calls.function.arguments.done" for e in events)
    assert all(c.function.parsed_arguments == json.loads(c.function.arguments) for c in final.message.tool_calls)


def test_named_stream_chunks_are_openais(client):
    chunks = [c.choices[0] for c in chat(client, tool_choice={"type": "function", "function": {"name": "add"}},
                                         stream=True) if c.choices]
    deltas = [c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "add" and deltas[0].function.arguments == ""
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 3  # the arguments came as they were generated
    assert chunks[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_and_none_answer_with_content(client, tool_choice, stream):
    kw = {} if tool_choice is None else {"tool_choice": tool_choice}
    out = chat(client, max_tokens=12, stream=stream, **kw)
    if stream:
        chunks = [c.choices[0] for c in out if c.choices]
        content, reason = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
        assert not any(c.delta.tool_calls for c in chunks)
    else:
        message = out.choices[0].message
        content, reason = message.content, out.choices[0].finish_reason
        assert message.tool_calls is None
    assert content and reason in ("stop", "length")  # the tiny model writes no tool-call markers


def test_a_conversation_with_tool_results(client):
    call = chat(client, tool_choice="required").choices[0].message.tool_calls[0]
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.choices[0].message.content


MSG = [{"role": "user", "content": "hi"}]
BAD_TOOLS = [  # (body fields, the param the 400 names)
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, "tools.0.function.parameters"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize("fields, param", BAD_TOOLS, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_TOOLS)])
def test_bad_tools_are_one_400_naming_the_field(server, fields, param):
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and server.healthy()
