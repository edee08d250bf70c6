"""``mindspec bench --scenario split-fuse``: a long prompt arriving while streams decode, with and
without SplitFuse, side by side (JSON + PNG).

    mindspec bench --scenario split-fuse --out benchmarks/results/split_fuse_cpu

``--streams`` held-out prompts decode ``--stream-tokens`` tokens each; once every stream has its
first ``--arrive-after`` tokens, a ``--long-prompt-tokens`` prompt arrives. Per stream, the gaps
between the steps that brought it tokens; reported per configuration: the median, p99 and
largest gap over all streams, the long prompt's time to first token, and the run's wall time.
Engines run interleaved, one round each in turn; medians over rounds. Outputs are checked equal
across configurations (greedy).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from mindspec.bench.corpus import heldout_prompts
from mindspec.text_generator.sampling.params import SamplingParams


def run_round(llm, streams: list[list[int]], long_prompt: list[int], stream_tokens: int, arrive_after: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=stream_tokens, ignore_eos=True)
    states = [engine.add_request(p, params) for p in streams]
    ids = {s.request_id for s in states}
    seen: dict[str, list[float]] = {s.request_id: [] for s in states}
    counts = {s.request_id: 0 for s in states}
    finals, long_state, arrived, first_long = {}, None, None, None
    start = time.perf_counter()
    while len(finals) < len(states) + 1:
        if long_state is None and all(c >= arrive_after for c in counts.values()):
            arrived = time.perf_counter()
            long_state = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in ids and out.new_token_ids:
                seen[out.request_id].append(now)
                counts[out.request_id] = len(out.token_ids)
            if long_state is not None and out.request_id == long_state.request_id and out.token_ids and first_long is None:
                first_long = now - arrived
            if out.finished:
                finals[out.request_id] = out
        if long_state is None and not outs and not engine.has_unfinished():
            raise RuntimeError("the streams ended before the long prompt could arrive")
    gaps = np.concatenate([np.diff(t) for t in seen.values()])
    return {
        "gap_median_s": float(np.median(gaps)), "gap_p99_s": float(np.percentile(gaps, 99)),
        "gap_max_s": float(gaps.max()), "long_prompt_ttft_s": first_long, "wall_s": time.perf_counter() - start,
        "outputs": [finals[s.request_id].token_ids for s in states] + [finals[long_state.request_id].token_ids],
    }


def run(args, make_llm, tokenizer) -> dict:
    streams = heldout_prompts(tokenizer, args.streams, args.prompt_tokens, seed=31)
    long_prompt = heldout_prompts(tokenizer, 1, args.long_prompt_tokens, seed=32)[0]
    chunks = [int(c) for c in args.chunk_tokens.split(",")]
    configs = {}
    for name, plugin_params in args.split_configs.items():
        configs[name] = make_llm(plugin_params, None)
        for c in chunks:
            configs[f"{name} +splitfuse {c}"] = make_llm(plugin_params, c)
    runs = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, llm in configs.items():
            runs[name].append(run_round(llm, streams, long_prompt, args.stream_tokens, args.arrive_after))
    reference = next(iter(runs.values()))[0]["outputs"]
    results = {}
    for name, rs in runs.items():
        row = {key: statistics.median(r[key] for r in rs)
               for key in ("gap_median_s", "gap_p99_s", "gap_max_s", "long_prompt_ttft_s", "wall_s")}
        row["p99_over_median"] = row["gap_p99_s"] / row["gap_median_s"]
        row["max_over_median"] = row["gap_max_s"] / row["gap_median_s"]
        row["identical_outputs"] = all(r["outputs"] == reference for r in rs)
        results[name] = row
        print(f"{name}: gap median {row['gap_median_s'] * 1e3:.1f} ms, p99 {row['p99_over_median']:.1f}x, "
              f"max {row['max_over_median']:.1f}x; long prompt TTFT {row['long_prompt_ttft_s']:.2f} s; "
              f"identical {row['identical_outputs']}", flush=True)
    return {"scenario": "split-fuse", "rounds": args.rounds, "streams": args.streams,
            "stream_prompt_tokens": args.prompt_tokens, "stream_tokens": args.stream_tokens,
            "long_prompt_tokens": len(long_prompt), "arrive_after": args.arrive_after, "results": results}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(names))
    axes[0].bar(x - 0.2, [rows[n]["p99_over_median"] for n in names], 0.4, label="p99 / median", color="#4c72b0")
    axes[0].bar(x + 0.2, [rows[n]["max_over_median"] for n in names], 0.4, label="max / median", color="#dd8452")
    axes[0].axhline(3.0, color="#c44e52", lw=0.8, ls="--", label="target p99 <= 3x")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("streams' inter-token gap / median gap")
    axes[0].set_xticks(x, names, rotation=25, ha="right", fontsize=8)
    axes[0].legend(fontsize=8)
    axes[1].bar(x, [rows[n]["long_prompt_ttft_s"] for n in names], color="#55a868")
    axes[1].set_ylabel("long prompt: time to first token (s)")
    axes[1].set_xticks(x, names, rotation=25, ha="right", fontsize=8)
    fig.suptitle(f"{report['long_prompt_tokens']}-token prompt arriving while {report['streams']} streams decode "
                 f"(greedy, {report.get('device', 'cpu')}, medians of {report['rounds']} rounds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
