"""``mindspec bench --scenario prefix-cache``: shared-prefix workloads with and without prefix
caching, side by side (JSON + PNG).

    mindspec bench --scenario prefix-cache --out benchmarks/results/prefix_cache_cpu

- chat: ``--conversations`` conversations x ``--turns`` turns over one ~``--system-tokens``
  system prompt; a turn's prompt is the system prompt, every earlier user message and answer,
  and its own message (what chat clients resend). Turn t of every conversation is submitted at
  once, so turns run as batches of conversations.
- few-shot: one prompt of ``--shots`` worked examples followed by each of ``--queries``
  questions, one request at a time.

Every text comes from the held-out corpus files. Engines with and without the cache run
interleaved, one round each in turn (the cache is reset before each round). Per request: the time
to its first token; per round: tokens per second (prompt and output tokens over wall time).
Outputs are checked equal (greedy).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mindspec.bench.corpus import heldout_prompts
from mindspec.text_generator.sampling.params import SamplingParams


@dataclass
class Workload:
    name: str
    turns: list[list[list[int]]]  # [turn][request] prompt prefix without the history
    follow_history: bool  # a turn's prompt continues the same request's previous prompt and answer


def chat_workload(tokenizer, conversations: int, turns: int, system_tokens: int, message_tokens: int) -> Workload:
    system = heldout_prompts(tokenizer, 1, system_tokens, seed=11)[0]
    messages = heldout_prompts(tokenizer, conversations * turns, message_tokens, seed=12)
    first = [system + messages[c][1:] for c in range(conversations)]
    later = [[messages[t * conversations + c][1:] for c in range(conversations)] for t in range(1, turns)]
    return Workload("chat", [first] + later, follow_history=True)


def few_shot_workload(tokenizer, shots: int, queries: int, shot_tokens: int, query_tokens: int) -> Workload:
    examples = heldout_prompts(tokenizer, shots, shot_tokens, seed=21)
    prefix = [tok for ex in examples for tok in ex[1:]]
    questions = heldout_prompts(tokenizer, queries, query_tokens, seed=22)
    return Workload("few-shot", [[[examples[0][0]] + prefix + q[1:]] for q in questions], follow_history=False)


def run_workload(llm, workload: Workload, new_tokens: int) -> dict:
    """One round: per request its first-token time and tokens; the round's wall time."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    history: list[list[int]] = []
    ttft, outputs, cached, prompt_tokens = [], [], [], 0
    start = time.perf_counter()
    for t, turn in enumerate(workload.turns):
        prompts = [h + m for h, m in zip(history, turn)] if workload.follow_history and history else turn
        submitted = time.perf_counter()
        states = [engine.add_request(p, params) for p in prompts]
        first: dict[str, float] = {}
        finals = {}
        while len(finals) < len(states):
            for out in engine.step():
                if out.token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - submitted
                if out.finished:
                    finals[out.request_id] = out
        outs = [finals[s.request_id] for s in states]
        ttft.append([first[s.request_id] for s in states])
        outputs.append([o.token_ids for o in outs])
        cached.append([o.num_cached_tokens for o in outs])
        prompt_tokens += sum(len(p) for p in prompts)
        history = [p + o.token_ids for p, o in zip(prompts, outs)]
    wall = time.perf_counter() - start
    produced = sum(len(o) for turn in outputs for o in turn)
    return {"ttft_s": ttft, "outputs": outputs, "cached_tokens": cached, "wall_s": wall,
            "tokens_per_s": (prompt_tokens + produced) / wall, "prompt_tokens": prompt_tokens}


def compare(llms: dict, workload: Workload, rounds: int, new_tokens: int) -> dict:
    """llms: {"cache off": LLM, "cache on": LLM} of one configuration, run interleaved."""
    runs = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            if llm.engine.prefix_caching:
                llm.engine.reset_prefix_cache()
            runs[name].append(run_workload(llm, workload, new_tokens))
    off, on = runs["cache off"], runs["cache on"]
    identical = all(r["outputs"] == off[0]["outputs"] for rs in runs.values() for r in rs)
    # per request: its median TTFT over rounds, cached against uncached
    shape = [len(t) for t in workload.turns]
    med = {name: [[statistics.median(r["ttft_s"][t][i] for r in rs) for i in range(n)] for t, n in enumerate(shape)]
           for name, rs in runs.items()}
    ratios = [[a / b for a, b in zip(med["cache on"][t], med["cache off"][t])] for t in range(len(shape))]
    hit = [[c > 0 for c in turn] for turn in on[0]["cached_tokens"]]
    hit_ratios = [r for t in range(len(shape)) for r, h in zip(ratios[t], hit[t]) if h]
    # Turns after the first find their own history cached; a first turn at most the shared system
    # prompt, and only when a request before it in the same wave has computed it already.
    later = [r for t in range(1, len(shape)) for r in ratios[t]]
    tps = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    return {
        "identical_outputs": identical,
        "ttft_median_s": {name: [statistics.median(turn) for turn in m] for name, m in med.items()},
        "ttft_ratio_per_request": ratios,
        "ttft_ratio_cached_requests": _summary(hit_ratios),
        "ttft_ratio_later_turns": _summary(later),
        "cached_tokens": on[0]["cached_tokens"],
        "prompt_tokens_per_round": on[0]["prompt_tokens"],
        "tokens_per_s_median": tps,
        "throughput_ratio": tps["cache on"] / tps["cache off"],
        "rounds_wall_s": {name: [r["wall_s"] for r in rs] for name, rs in runs.items()},
    }


def _summary(ratios: list[float]) -> Optional[dict]:
    return {"median": statistics.median(ratios), "worst": max(ratios), "count": len(ratios)} if ratios else None


def run(args, make_llm, tokenizer) -> dict:
    """The report for every configuration in ``args.configs`` (plugin_params by name)."""
    workloads = [
        chat_workload(tokenizer, args.conversations, args.turns, args.system_tokens, args.message_tokens),
        few_shot_workload(tokenizer, args.shots, args.queries, args.shot_tokens, args.message_tokens),
    ]
    report = {"scenario": "prefix-cache", "rounds": args.rounds, "new_tokens": args.new_tokens, "results": {}}
    for config, plugin_params in args.prefix_configs.items():
        llms = {"cache off": make_llm(plugin_params, False), "cache on": make_llm(plugin_params, True)}
        for workload in workloads:
            t = time.time()
            row = compare(llms, workload, args.rounds, args.new_tokens)
            report["results"][f"{workload.name}, {config}"] = row
            hit, later = row["ttft_ratio_cached_requests"], row["ttft_ratio_later_turns"]
            print(f"{workload.name}, {config} ({time.time() - t:.0f} s): TTFT cache on/off, requests with a hit: "
                  f"median {hit['median']:.2f} worst {hit['worst']:.2f}; turns after the first: median "
                  f"{later['median']:.2f} worst {later['worst']:.2f}; throughput {row['throughput_ratio']:.2f}x; "
                  f"identical {row['identical_outputs']}", flush=True)
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(rows)
    ttft = [[r for turn in rows[n]["ttft_ratio_per_request"] for r in turn] for n in names]
    axes[0].boxplot(ttft, showfliers=True)
    axes[0].set_xticks(range(1, len(names) + 1), names, rotation=20, ha="right", fontsize=8)
    axes[0].axhline(0.2, color="#c44e52", lw=0.8, ls="--", label="target 0.2x")
    axes[0].set_ylabel("time to first token, cache on / off (per request)")
    axes[0].legend(fontsize=8)
    axes[1].bar(range(len(names)), [rows[n]["throughput_ratio"] for n in names], color="#4c72b0")
    axes[1].axhline(1.5, color="#c44e52", lw=0.8, ls="--", label="target 1.5x")
    axes[1].set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    axes[1].set_ylabel("tokens/s (prompt + output), cache on / off")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"prefix caching, greedy, {report.get('device', 'cpu')}, medians of {report['rounds']} rounds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
