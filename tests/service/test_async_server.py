"""A real server with ScheduleConfig.asyncScheduling and MTP: concurrent openai clients get the
texts of a synchronous offline run; a client that hangs up mid-stream does not disturb the rest."""
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from mindspec import LLM, SamplingParams

from .conftest import Server, free_port, write_config

PROMPTS = ["def add(a, b):", "import os", "x = [", "class Node:", "for i in range(", "# sort a list", "print(", "y ="]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def async_server(tiny_model, tmp_path_factory):
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path_factory.mktemp("async_svc") / "config.json", tiny_model, ports,
                       **{"BackendConfig.ScheduleConfig.asyncScheduling": True,
                          "BackendConfig.ModelDeployConfig.ModelConfig.0.plugin_params":
                              {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "eagle"}})
    srv = Server(cfg, ports)
    yield srv
    assert srv.stop() == 0


def test_concurrent_clients_get_the_sync_texts(async_server, tiny_model):
    llm = LLM(model=str(tiny_model), dtype="float32", cache_block_size=16, num_blocks=200, progress=False)
    want = [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    client = openai.OpenAI(base_url=async_server.base + "/v1", api_key="unused")

    def complete(prompt):
        out = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                        extra_body={"ignore_eos": True})
        return out.choices[0].text

    def hang_up(prompt):  # read two chunks, then drop the stream
        stream = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=200,
                                           stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 1:
                stream.close()
                return None

    with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        dropped = [pool.submit(hang_up, p) for p in PROMPTS[:2]]
        got = list(pool.map(complete, PROMPTS))
        assert [f.result() for f in dropped] == [None, None]
    assert got == want
    assert async_server.healthy()
    assert complete(PROMPTS[0]) == want[0]


def test_logprobs_and_n_under_async_scheduling(async_server, server):
    """asyncScheduling builds step N+1 before step N's outputs are read: the logprobs each streamed
    chunk carries still line up with its tokens, and match a synchronous server's."""
    kw = dict(model="tiny", prompt="def add(a, b):", max_tokens=MAX_TOKENS, temperature=0, logprobs=2, n=2,
              extra_body={"ignore_eos": True})
    sync = openai.OpenAI(base_url=server.base + "/v1", api_key="unused").completions.create(**kw)
    client = openai.OpenAI(base_url=async_server.base + "/v1", api_key="unused")
    chunks = [c for chunk in client.completions.create(stream=True, **kw) for c in chunk.choices]
    for choice in sync.choices:
        mine = [c for c in chunks if c.index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
        offsets = [o for c in mine if c.logprobs for o in c.logprobs.text_offset]
        assert tokens == choice.logprobs.tokens and offsets == choice.logprobs.text_offset
        assert len(tokens) == MAX_TOKENS
