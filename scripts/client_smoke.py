"""The clients people already use, unchanged, against a running mindspec server.

    python scripts/client_smoke.py http://127.0.0.1:1025 [--model mindspec-default]

Runs, with the official libraries: openai (completions, chat, streaming, logprobs, n=2, echo,
models.retrieve, a JSON schema response_format), text_generation.Client (generate, generate_stream with details),
huggingface_hub.InferenceClient (text_generation streamed and not, chat_completion), MindIE's
documented POST / and /infer requests, and GET /health. Prints one line per check; exits 1 on
the first failure. scripts/fresh_install_check.sh runs it against the wheel installed without
extras; the same calls are tests in tests/service/test_clients_*.py.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request

PROMPT = "def fibonacci(n):"
MINDIE_EXAMPLE = {
    "inputs": "My name is Olivier and I",
    "parameters": {"decoder_input_details": True, "details": True, "do_sample": True, "max_new_tokens": 20,
                   "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5,
                   "top_k": 10, "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False},
    "stream": False,
}


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail != "" else ""))
    if not ok:
        sys.exit(1)


def post_json(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def openai_checks(base: str, model: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    check("openai models.retrieve", client.models.retrieve(model).id == model)
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    check("openai completion logprobs are text pieces", "".join(lp.tokens) == c.choices[0].text, lp.tokens[:4])
    check("openai text_offset", lp.text_offset[0] == 0 and len(lp.text_offset) == len(lp.tokens))
    n2 = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=0.8, seed=1)
    check("openai n=2", sorted(ch.index for ch in n2.choices) == [0, 1])
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    check("openai echo", echo.choices[0].text == PROMPT and echo.choices[0].logprobs.token_logprobs[0] is None)
    pieces = [ch.choices[0].text for ch in client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                                                      temperature=0, stream=True) if ch.choices]
    check("openai streaming equals non-streaming", "".join(pieces) == c.choices[0].text)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=2)
    check("openai chat with logprobs", len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    doc = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=32,
                                         temperature=0, response_format={"type": "json_schema", "json_schema": {
                                             "name": "reply", "schema": schema}}).choices[0].message.content
    check("openai response_format json_schema (structured output)", set(json.loads(doc)) == {"n", "ok"}, doc)


def tgi_checks(base: str) -> None:
    from text_generation import Client

    client = Client(base, timeout=300)
    r = client.generate(PROMPT, max_new_tokens=12, decoder_input_details=True, top_n_tokens=2)  # details always on
    check("text_generation generate with details", r.details.generated_tokens == len(r.details.tokens))
    streamed = [resp for resp in client.generate_stream(PROMPT, max_new_tokens=12)]
    check("text_generation generate_stream", streamed[-1].generated_text == r.generated_text
          and streamed[-1].details is not None)


def hf_checks(base: str, model: str) -> None:
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=base, timeout=300)
    out = client.text_generation(PROMPT, max_new_tokens=12, details=True)
    check("huggingface_hub text_generation", out.details.generated_tokens >= 1)
    text = "".join(client.text_generation(PROMPT, max_new_tokens=12, stream=True))
    check("huggingface_hub text_generation stream", text == out.generated_text)
    chat = client.chat_completion(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12)
    check("huggingface_hub chat_completion", isinstance(chat.choices[0].message.content, str))


def mindie_checks(base: str) -> None:
    root = post_json(base + "/", MINDIE_EXAMPLE)
    check("MindIE POST /", isinstance(root, list) and root[0]["details"]["generated_tokens"] >= 1)
    infer = post_json(base + "/infer", MINDIE_EXAMPLE)
    check("MindIE POST /infer", infer["details"]["generated_tokens"] >= 1)
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        check("GET /health on the serving port", r.status == 200)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", help="the server's base URL, e.g. http://127.0.0.1:1025")
    p.add_argument("--model", default="mindspec-default", help="the served model name")
    args = p.parse_args(argv)
    base = args.base.rstrip("/")
    openai_checks(base, args.model)
    tgi_checks(base)
    hf_checks(base, args.model)
    mindie_checks(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
