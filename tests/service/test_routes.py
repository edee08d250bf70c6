"""The official openai client and httpx against a real server."""
import asyncio
import json
import time

import httpx
import openai
import pytest

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def _client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused")


def test_openai_completions_plain_and_streamed(server):
    client = _client(server)
    full = client.completions.create(model="tiny", prompt="def add(a, b):", **GREEDY)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt="def add(a, b):", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_openai_chat_plain_and_streamed(server):
    client = _client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "print hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 12
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content


def test_tgi_vllm_and_mindie_routes(server):
    body = {"inputs": "import os", "parameters": {"max_new_tokens": 6, "details": True, "ignore_eos": True}}
    tgi = httpx.post(server.base + "/generate", json=body, timeout=60).json()
    assert tgi["details"]["generated_tokens"] == 6
    events = []
    with httpx.stream("POST", server.base + "/generate_stream", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    assert len(events) == 6 and events[-1]["generated_text"] == tgi["generated_text"]
    infer = httpx.post(server.base + "/infer", json={**body, "stream": False}, timeout=60).json()
    assert infer["generated_text"] == tgi["generated_text"] and infer["details"]["generated_tokens"] == 6
    vllm = httpx.post(server.base + "/generate", json={"prompt": "import os", "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60).json()
    assert vllm["text"] == ["import os" + tgi["generated_text"]]


def test_health_and_metrics_move(server):
    assert httpx.get(server.mgmt + "/v2/health/live").status_code == 200
    assert httpx.get(server.mgmt + "/v2/health/ready").status_code == 200
    before = server.metric("mindspec_requests_total", status="success")
    tokens_before = server.metric("mindspec_generation_tokens_total")
    _client(server).completions.create(model="tiny", prompt="x = 1", **GREEDY)
    assert server.metric("mindspec_requests_total", status="success") == before + 1
    assert server.metric("mindspec_generation_tokens_total") == tokens_before + 12
    assert server.metric("mindspec_spec_draft_tokens_total") > 0
    assert server.metric("mindspec_time_to_first_token_seconds_count") >= 1


def test_32_concurrent_streams_equal_single_requests(server):
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(32)]
    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused")

    async def one(prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, stream=True, temperature=0,
                                                 max_tokens=16, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in prompts))

    together = asyncio.run(all_at_once())
    sync = _client(server)
    alone = [sync.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=16,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert together == alone
    assert server.metric("mindspec_kv_blocks_used") == 0
    assert server.metric("mindspec_num_requests_running") == 0 and server.metric("mindspec_num_requests_waiting") == 0


def test_disconnect_mid_stream_frees_blocks(server):
    aborted = server.metric("mindspec_requests_total", status="aborted")
    body = {"model": "tiny", "prompt": "while True:", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 60  # the engine loop sees the hang-up on its next pass
    while time.monotonic() < deadline and not (
            server.metric("mindspec_requests_total", status="aborted") > aborted
            and server.metric("mindspec_kv_blocks_used") == 0):
        time.sleep(0.1)
    assert server.metric("mindspec_requests_total", status="aborted") == aborted + 1
    assert server.metric("mindspec_kv_blocks_used") == 0
    assert server.healthy()
