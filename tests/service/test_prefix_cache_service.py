"""Prefix caching over HTTP: a server whose plugin_params say "mtp,prefix_cache" reports the
prompt tokens it found cached in usage.prompt_tokens_details.cached_tokens (official openai
client), counts hits in /metrics, forgets them on POST /reset_prefix_cache, and answers the same
text with and without a cached prefix."""
import httpx
import openai
import pytest

from tests.service.conftest import Server, free_port, write_config

BLOCK = 16
SYSTEM = "You are a careful assistant. Answer briefly and cite every source. "
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cached_server(tiny_model, tmp_path_factory):
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path_factory.mktemp("svc_pc") / "config.json", tiny_model, ports, **{
        "BackendConfig.ModelDeployConfig.ModelConfig.0.plugin_params":
            {"plugin_type": "mtp,prefix_cache", "num_speculative_tokens": 1},
        "BackendConfig.ScheduleConfig.cacheBlockSize": BLOCK,
    })
    srv = Server(cfg, ports)
    yield srv
    assert srv.stop() == 0


def test_cached_tokens_metrics_and_reset(cached_server, server):
    client = openai.OpenAI(base_url=cached_server.base + "/v1", api_key="unused", timeout=120)
    first = client.completions.create(model="tiny", prompt=SYSTEM + "Question one?", **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="tiny", prompt=SYSTEM + "Question two?", **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and cached < second.usage.prompt_tokens
    assert cached_server.metric("mindspec_prefix_cache_hits_total", unit="tokens") == cached
    assert cached_server.metric("mindspec_prefix_cache_queries_total", unit="tokens") == (
        first.usage.prompt_tokens + second.usage.prompt_tokens)
    assert 0 < cached_server.metric("mindspec_prefix_cache_hit_rate", unit="blocks") < 1

    # the same prompt again: served from the cache, the same text as the uncached server's
    again = client.completions.create(model="tiny", prompt=SYSTEM + "Question one?", **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and again.choices[0].text == first.choices[0].text
    plain = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120)
    reference = plain.completions.create(model="tiny", prompt=SYSTEM + "Question one?", **GREEDY)
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert reference.choices[0].text == first.choices[0].text

    reset = httpx.post(cached_server.mgmt + "/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200 and reset.json()["forgotten_blocks"] > 0
    assert cached_server.metric("mindspec_kv_blocks_cached_idle") == 0
    after = client.completions.create(model="tiny", prompt=SYSTEM + "Question one?", **GREEDY)
    assert after.usage.prompt_tokens_details.cached_tokens == 0 and after.choices[0].text == first.choices[0].text


def test_chat_usage_reports_cached_tokens(cached_server):
    client = openai.OpenAI(base_url=cached_server.base + "/v1", api_key="unused", timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    turn = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert turn.usage.prompt_tokens_details.cached_tokens > 0


def test_reset_without_prefix_caching_is_a_clear_400(server):
    r = httpx.post(server.mgmt + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 400 and "prefix caching is off" in r.json()["error"]["message"]
