"""llama.cpp side by side (``mindspec bench --compare llama.cpp``): the same checkpoint converted
to GGUF by llama.cpp's own ``convert_hf_to_gguf.py``, the same prompts, greedy, one sequence at a
time, timed in the same rounds as mindspec's configurations, through ``llama-cpp-python``.

The converter comes from a llama.cpp source tree (``--llama-cpp-src`` or ``$LLAMA_CPP_SRC``; the
``llama-cpp-python`` sdist carries one as ``vendor/llama.cpp``); ``--gguf`` takes a converted file
instead. llama.cpp recognises a tokenizer's pre-tokenizer by hashing what it makes of a fixed
text; a checkpoint it has never seen (the shipped model's byte-level BPE) is mapped to ``gpt-2``,
whose split is the same. The MTP modules are not converted (llama.cpp does not run them).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SRC_ENV = "LLAMA_CPP_SRC"

# Runs convert_hf_to_gguf.main() with an unknown pre-tokenizer mapped to gpt-2.
_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src + "/gguf-py", src]
import convert_hf_to_gguf as c
try:
    from conversion.base import TextModel  # newer trees split the converter into a package
except ImportError:
    TextModel = c.TextModel
base = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return base(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = pre
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
c.main()
"""


class LlamaCppError(RuntimeError):
    """llama.cpp cannot be compared here (not installed, no converter, a failed conversion)."""


def require_llama_cpp() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise LlamaCppError("--compare llama.cpp needs llama-cpp-python (pip install llama-cpp-python)")


def converter_dir(src: Optional[str]) -> Path:
    given = src or os.environ.get(SRC_ENV, "")
    path = Path(given)
    if not given or not (path / "convert_hf_to_gguf.py").is_file():
        raise LlamaCppError(f"converting to GGUF needs a llama.cpp source tree with convert_hf_to_gguf.py "
                            f"(--llama-cpp-src DIR or ${SRC_ENV}; the llama-cpp-python sdist has one in "
                            f"vendor/llama.cpp), or pass --gguf FILE")
    return path


def convert(model_dir: str, out: Path, src: Path, outtype: str = "f32") -> Path:
    """The checkpoint as a GGUF file at ``out`` (kept: a second run reuses it)."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", _CONVERT, str(src), str(model_dir), "--outfile", str(out), "--outtype", outtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise LlamaCppError(f"convert_hf_to_gguf.py failed on {model_dir}: {' | '.join(tail)}")
    return out


# The worker: loads the GGUF file, then per input line {"prompts", "lengths", "batch"} answers one
# line {"outs", "seconds", "first", "last"}; it imports nothing of mindspec (whose import sets
# OpenMP's wait policy). Batch 1 decodes one prompt at a time through Llama.generate; a larger batch
# decodes groups of that many prompts as parallel sequences of one context (llama.cpp's own
# "batched" example: one llama_decode per step with a token of every live sequence), seconds timed
# per group, and per prompt the seconds from its group's start to its first and its last token.
_WORKER = """
import json, sys, time
gguf, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    import numpy as np
    import llama_cpp as lc
    from llama_cpp import Llama
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    sys.exit(0)
model = llm._model.model
n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
contexts = {}


def one(prompt, n, start):
    out, first = [], None
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        first = first or time.perf_counter() - start
        if len(out) == n:
            break
    return out, first, time.perf_counter() - start


def context(batch, per_seq, prompt_tokens):
    key = (batch, per_seq, prompt_tokens)
    if key not in contexts:
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_seq_max = batch * per_seq, batch
        p.n_batch, p.n_ubatch = max(prompt_tokens, batch), min(max(prompt_tokens, batch), 512)
        p.n_threads = p.n_threads_batch = threads
        ctx = lc.llama_init_from_model(model, p)
        contexts[key] = (ctx, lc.llama_batch_init(p.n_batch, 0, 1))
    return contexts[key]


def group(prompts, lengths, per_seq, prompt_tokens, start):
    ctx, batch = context(len(prompts), per_seq, prompt_tokens)
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    rows = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
    outs, pos = [[] for _ in prompts], [len(p) for p in prompts]
    first, last = [None] * len(prompts), [None] * len(prompts)
    while rows:
        batch.n_tokens = len(rows)
        for i, (t, j, s, want) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, j, 1, want
            batch.seq_id[i][0] = s
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        picks = [(i, s) for i, (_, _, s, want) in enumerate(rows) if want]
        rows = []
        for i, s in picks:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
            outs[s].append(int(logits.argmax()))
            last[s] = time.perf_counter() - start
            first[s] = first[s] or last[s]
            if len(outs[s]) < lengths[s]:
                rows.append((outs[s][-1], pos[s], s, True))
                pos[s] += 1
    return list(zip(outs, first, last))


print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    prompts, lengths, size = job["prompts"], job["lengths"], job.get("batch", 1)
    done, seconds = [], []
    per_seq = max(len(p) for p in prompts) + max(lengths) + 8
    for at in range(0, len(prompts), size):
        part, lens = prompts[at : at + size], lengths[at : at + size]
        start = time.perf_counter()
        done += [one(p, n, start) for p, n in zip(part, lens)] if size == 1 else group(part, lens, per_seq, sum(map(len, part)), start)
        seconds.append(time.perf_counter() - start)
    outs, first, last = (list(c) for c in zip(*done))
    print(json.dumps({"outs": outs, "seconds": seconds, "first": first, "last": last}), flush=True)
"""


class LlamaCppRunner:
    """llama.cpp in a worker process, decoding greedily ``lengths[i]`` tokens per prompt, EOS
    ignored.

    A separate process, because mindspec makes OpenMP's threads wait passively in its own process
    (mindspec/__init__.py), which costs llama.cpp's thread pool a wake-up at every barrier: at 2
    threads, 28 tok/s in-process against 501 alone on the shipped model. The worker gets the
    environment without that setting (a user's own OMP_WAIT_POLICY is kept)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int):
        require_llama_cpp()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(gguf), str(threads), str(n_ctx)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_environ_for_worker(),
        )
        ready = self._reply()
        if "ready" not in ready:
            self.close()
            raise LlamaCppError(f"llama.cpp could not load {gguf}: {ready.get('error', ready)}")

    def generate(self, prompts: list[list[int]], lengths: list[int], batch: int = 1) -> "LlamaCppRound":
        """One round, timed in the worker."""
        self._proc.stdin.write(json.dumps({"prompts": prompts, "lengths": lengths, "batch": batch}) + "\n")
        self._proc.stdin.flush()
        reply = self._reply()
        return LlamaCppRound(reply["outs"], reply["seconds"], reply["first"], reply["last"])

    def _reply(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise LlamaCppError(f"the llama.cpp worker exited (code {self._proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def _environ_for_worker() -> dict:
    import mindspec

    env = dict(os.environ)
    if mindspec.WAIT_POLICY_SOURCE != "user":
        env.pop("OMP_WAIT_POLICY", None)
    return env


@dataclass
class LlamaCppRound:
    outs: list[list[int]]  # each prompt's tokens
    seconds: list[float]  # each group of ``batch`` prompts
    first: list[float]  # per prompt: seconds from its group's start to its first token
    last: list[float]  # ... and to its last token


def run_llama_cpp(runner: LlamaCppRunner, prompts: list[list[int]], lengths: list[int], m, batch: int = 1) -> None:
    """One round over ``prompts`` in groups of ``batch`` parallel sequences, into the Measurement ``m``
    (per request: no queue, the first token's time, and the time per output token after it)."""
    r = runner.generate(prompts, lengths, batch)
    m.tokens_per_s.append(sum(lengths) / sum(r.seconds))
    group_lens = [max(lengths[i : i + batch]) for i in range(0, len(lengths), batch)]
    m.latency_per_token_ms.append(1e3 * sum(s / n for s, n in zip(r.seconds, group_lens)) / len(group_lens))
    m.group_seconds.append(list(r.seconds))  # per group, as mindspec's static runs (batch 1: per request)
    m.queue_s.append([0.0] * len(prompts))
    m.ttft_s.append(list(r.first))
    m.tpot_s.append([(end - first) / (len(out) - 1) if len(out) > 1 else None
                     for first, end, out in zip(r.first, r.last, r.outs)])
    m.token_ids = r.outs
