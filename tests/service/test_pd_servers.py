"""PD disaggregation over the network: three real `mindspec serve` processes (a prefill node, a
decode node, a router) on 127.0.0.1; a request through router -> prefill node -> decode node gives
the same greedy output as one standard instance, MTP on; a node that hangs or dies is one clear
error for the client within the configured timeouts, and the router stays up."""
import os
import signal
import time

import httpx
import pytest

from mindspec import LLM, SamplingParams
from tests.distributed.serving import completion, free_port, served_model, start_servers, write_config

MTP = {"plugin_type": "mtp", "num_speculative_tokens": 2}
PROMPTS = ["hello world", "the quick brown fox", "a", "numbers 1 2 3 4 5 6 7 8 9 and more words to read"]
TOKEN_TIMEOUT = 15  # long enough for a loaded machine; the hung-node test waits this long


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return served_model(tmp_path_factory.mktemp("pd_model"), seed=5)


@pytest.fixture(scope="module")
def pd(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd_srv")
    p_ic, d_ic = free_port(), free_port()
    node = {"inferMode": "dmi", "kv_trans_timeout": 10}
    specs = [
        write_config(tmp / "prefill.json", model_dir, server={**node, "pdRole": "prefill", "interCommPort": p_ic},
                     model={"plugin_params": MTP}),
        write_config(tmp / "decode.json", model_dir, server={**node, "pdRole": "decode", "interCommPort": d_ic},
                     model={"plugin_params": MTP}),
        write_config(tmp / "router.json", model_dir,
                     server={"inferMode": "dmi", "pdRole": "router", "pdPrefillAddress": f"127.0.0.1:{p_ic}",
                             "pdDecodeAddress": f"127.0.0.1:{d_ic}", "tokenTimeout": TOKEN_TIMEOUT},
                     model={"plugin_params": MTP, "kv_link_timeout": 5}),
    ]
    servers = start_servers([(cfg, ports, tmp / f"{name}.log") for (cfg, ports), name
                             in zip(specs, ["prefill", "decode", "router"])])
    yield dict(zip(["prefill", "decode", "router"], servers), decode_ic=f"http://127.0.0.1:{d_ic}")
    for s in servers:
        s.stop(signal.SIGKILL if s.proc.poll() is None and s is servers[1] else signal.SIGTERM)


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", cache_block_size=4, num_blocks=400, progress=False,
              plugin_params=MTP)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params)]


@pytest.mark.slow
def test_router_prefill_decode_equals_one_standard_instance(pd, expected):
    router, decode = pd["router"], pd["decode"]
    got = []
    for prompt in PROMPTS:
        resp = completion(router.base, prompt)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 16
        got.append(body["choices"][0]["text"])
    assert got == expected
    # the decode node speculated (MTP) and accepted drafts; the prefill node ran prefills only
    assert decode.metric("mindspec_spec_accepted_tokens_total") > 0
    assert pd["prefill"].metric("mindspec_spec_draft_tokens_total") == 0
    # streaming through the router: the same text, token by token
    with httpx.stream("POST", router.base + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as resp:
        chunks = [line for line in resp.iter_lines() if line.startswith("data: {")]
    import json

    assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == expected[1]
    reset = httpx.post(router.mgmt + "/reset_prefix_cache", timeout=30)  # the router holds no cache
    assert reset.status_code == 400 and "runs no model" in reset.json()["error"]["message"]


@pytest.mark.slow
def test_a_bad_handoff_is_refused_by_the_decode_node(pd):
    resp = httpx.post(pd["decode_ic"] + "/v1/pd/decode", content=b"not a hand-off", timeout=10)
    assert resp.status_code == 400 and "hand-off" in resp.json()["error"]["message"]
    assert pd["decode"].health() == 200


@pytest.mark.slow
def test_a_hung_prefill_node_is_a_timeout_not_a_hang(pd):
    router, prefill = pd["router"], pd["prefill"]
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        resp = completion(router.base, "hello", timeout=60)
        assert time.monotonic() - start < TOKEN_TIMEOUT + 10
        assert resp.status_code in (408, 503), resp.text
        assert "tokenTimeout" in resp.json()["error"]["message"]
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    assert completion(router.base, "hello").status_code == 200  # and it recovers
    assert router.health() == 200


@pytest.mark.slow
def test_a_dead_decode_node_is_reported_to_the_client(pd):
    router, decode = pd["router"], pd["decode"]
    decode.proc.kill()
    decode.proc.wait(10)
    start = time.monotonic()
    resp = completion(router.base, "hello")
    assert time.monotonic() - start < 10
    assert resp.status_code == 503
    message = resp.json()["error"]["message"]
    assert "decode node" in message and "unreachable" in message, message
    assert router.health() == 200
