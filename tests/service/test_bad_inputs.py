"""Bad HTTP requests and bad configs: each gets its documented error; the server stays healthy."""
import subprocess
import sys
import time

import httpx
import pytest

from tests.service.conftest import Server, free_port, write_config

LONG_PROMPT = "x " * 400  # over maxInputTokenLen 128 tokens

# (route, body or raw bytes, status, substring of the error message)
HTTP_CASES = [
    ("/v1/completions", b"{bad json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n must be in [1, 128]"),
    ("/v1/completions", {"prompt": "a", "n": 129}, 400, "n must be in [1, 128]"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 128}, 400, "choices per request"),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "a", "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"3": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "maxInputTokenLen"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "stream": True}, 400, "maxInputTokenLen"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "seed": -3}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": []}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": "a" * 1_200_000}, 413, "maxRequestLength"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     400, "messages[0].content[1].type 'image_url' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 200}, 400, "n must be"),
    ("/generate", {"text": "hi"}, 422, "'inputs'"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/", {"inputs": "hi", "parameters": {"top_n_tokens": 50}}, 400, "top_n_tokens"),
    ("/", {"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "a("}}}, 400, "grammar"),
    ("/", {"inputs": "hi", "parameters": {"truncate": 0}}, 400, "truncate"),
    ("/", {"parameters": {}}, 422, "inputs"),
    ("/generate", {"inputs": 5}, 422, "inputs"),
    ("/generate_stream", {"inputs": "hi", "parameters": {"temperature": -2, "do_sample": True}}, 400, "temperature"),
    ("/infer", {"inputs": ["a"]}, 422, "inputs"),
    ("/v1/nothing", {"prompt": "a"}, 404, "no route /v1/nothing"),
]


@pytest.mark.parametrize("route, body, status, message", HTTP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HTTP_CASES)])
def test_bad_request_gets_its_error_and_server_stays_healthy(server, route, body, status, message):
    if isinstance(body, bytes):
        r = httpx.post(server.base + route, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(server.base + route, json=body, timeout=60)
    assert r.status_code == status, r.text
    if message:
        error = r.json()["error"]
        assert message in error["message"] and error["code"] == status
        assert "Traceback" not in r.text
    assert server.healthy()


def test_api_key(tiny_model, tmp_path):
    ports = (free_port(), free_port(), free_port())
    srv = Server(write_config(tmp_path / "c.json", tiny_model, ports), ports, api_key="sekret")
    try:
        body = {"prompt": "a", "max_tokens": 2}
        assert httpx.post(srv.base + "/v1/completions", json=body).status_code == 401
        assert httpx.post(srv.base + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = httpx.post(srv.base + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}, timeout=60)
        assert ok.status_code == 200 and srv.healthy()
    finally:
        assert srv.stop() == 0


CONFIG_CASES = [
    ({"ServerConfig.port": 70000}, "ServerConfig.port"),
    ({"ServerConfig.ipAddress": "0.0.0.0"}, "allowAllZeroIpListening"),
    ({"BackendConfig.ModelDeployConfig.ModelConfig.0.plugin_params": "{oops"}, "plugin_params"),
    ({"BackendConfig.ModelDeployConfig.ModelConfig.0.modelWeightPath": "/no/such/model"}, "does not exist"),
    ({"BackendConfig.ScheduleConfig.cacheBlockSize": 0}, "cacheBlockSize"),
    ({"BackendConfig.ModelDeployConfig.ModelConfig.0.backendType": "tpu"}, "backendType"),
]


@pytest.mark.parametrize("overrides, message", CONFIG_CASES, ids=[m for _, m in CONFIG_CASES])
def test_bad_config_is_one_clear_error(tiny_model, tmp_path, overrides, message):
    cfg = write_config(tmp_path / "c.json", tiny_model, (free_port(), free_port(), free_port()), **overrides)
    res = subprocess.run([sys.executable, "-m", "mindspec.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_e2e_timeout_ends_a_long_request(tiny_model, tmp_path):
    ports = (free_port(), free_port(), free_port())
    # 32000 tokens take the tiny model far longer than the 1 s timeout on any CPU (maxIterTimes,
    # 512 by default, would cap the request at a length a fast machine finishes in time)
    cfg = write_config(tmp_path / "c.json", tiny_model, ports, **{"ServerConfig.e2eTimeout": 1,
                                                                   "BackendConfig.ModelDeployConfig.maxSeqLen": 32768,
                                                                   "BackendConfig.ScheduleConfig.maxIterTimes": 32000,
                                                                   "BackendConfig.ScheduleConfig.numBlocks": 2100})
    srv = Server(cfg, ports)
    try:
        body = {"prompt": "a", "max_tokens": 32000, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 408 and "e2eTimeout" in r.json()["error"]["message"]
        deadline = time.monotonic() + 60  # the abort frees the blocks on the engine's next pass
        while srv.metric("mindspec_kv_blocks_used") != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.metric("mindspec_kv_blocks_used") == 0 and srv.healthy()
    finally:
        assert srv.stop() == 0
