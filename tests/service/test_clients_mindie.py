"""MindIE's documented text-inference examples (POST / and /infer) with httpx, health on the
serving port, and the error object of unknown routes and wrong methods."""
import json

import httpx
import pytest

# MindIE's documented request (its curl example), unchanged.
MINDIE_EXAMPLE = {
    "inputs": "My name is Olivier and I",
    "parameters": {"decoder_input_details": False, "details": True, "do_sample": True, "max_new_tokens": 20,
                   "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5,
                   "top_k": 10, "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False, "priority": 5, "timeout": 10},
    "stream": False,
}


def _events(url, body):
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


@pytest.mark.parametrize("route", ["/", "/infer"])
def test_mindie_example_non_stream(server, route):
    r = httpx.post(server.base + route, json=MINDIE_EXAMPLE, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    answer = body[0] if route == "/" else body  # TGI's root answers a list of one
    details = answer["details"]
    assert details["finish_reason"] in ("length", "eos_token") and 1 <= details["generated_tokens"] <= 20
    assert isinstance(details["seed"], int) and len(details["tokens"]) == details["generated_tokens"]
    replay = {**MINDIE_EXAMPLE, "parameters": {**MINDIE_EXAMPLE["parameters"], "seed": details["seed"]}}
    again = httpx.post(server.base + route, json=replay, timeout=120).json()
    assert (again[0] if route == "/" else again)["generated_text"] == answer["generated_text"]


@pytest.mark.parametrize("route", ["/", "/infer"])
def test_mindie_example_stream(server, route):
    seeded = {**MINDIE_EXAMPLE, "stream": True, "parameters": {**MINDIE_EXAMPLE["parameters"], "seed": 11}}
    events = _events(server.base + route, seeded)
    whole = httpx.post(server.base + route, json={**seeded, "stream": False}, timeout=120).json()
    whole = whole[0] if route == "/" else whole
    assert events[-1]["generated_text"] == whole["generated_text"]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert events[-1]["details"]["generated_tokens"] == len(events)


def test_unsupported_mindie_parameters_are_named(server):
    for name, value in (("typical_p", 1.5), ("priority", 9), ("timeout", 0), ("adapter_id", "lora1")):
        body = {**MINDIE_EXAMPLE, "parameters": {**MINDIE_EXAMPLE["parameters"], name: value}}
        r = httpx.post(server.base + "/infer", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_health_on_the_serving_port(server):
    for path, status in (("/health", "healthy"), ("/v2/health/live", "live"), ("/v2/health/ready", "ready")):
        r = httpx.get(server.base + path, timeout=10)
        assert r.status_code == 200 and r.json() == {"status": status}
        assert httpx.get(server.mgmt + path, timeout=10).json() == {"status": status}


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing", 404), ("POST", "/nothing", 404), ("GET", "/v1/completions", 405),
    ("GET", "/", 405), ("DELETE", "/v1/chat/completions", 405), ("POST", "/health", 405),
])
def test_unknown_routes_and_wrong_methods_get_the_error_object(server, method, path, status):
    r = httpx.request(method, server.base + path, timeout=10)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == status and path in error["message"] and set(r.json()) == {"error"}
    if status == 405:
        assert method in error["message"] and r.headers["allow"]


def test_management_port_unknown_route_is_the_error_object(server):
    r = httpx.get(server.mgmt + "/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
