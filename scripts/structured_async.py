"""Constrained requests under async scheduling against synchronous scheduling (cpu, 1 thread).

    python scripts/structured_async.py [--free] --out benchmarks/results/cpu_structured_async.json

16 held-out prompts, 4 requests at a time, each under one of the structured scenario's five
schemas (``--free``: unconstrained, 64 tokens, EOS ignored); MTP off and eagle K=3 (adaptive
speculation off: async scheduling turns it off), each synchronous and async; 3 interleaved rounds,
medians of tokens/s per group of 4 and of structured output's host share of the wall time.
Every configuration's first output of each group must equal MTP off's (greedy).
"""
import argparse
import json
import statistics
import time

import torch

from mindspec import LLM, SamplingParams
from mindspec.bench.corpus import heldout_prompts
from mindspec.bench.structured_schemas import SCHEMAS

EAGLE = {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle", "adaptive_speculation": False}
CONFIGS = {"off sync": (None, False), "off async": (None, True), "eagle sync": (EAGLE, False), "eagle async": (EAGLE, True)}
PROMPTS, GROUP, ROUNDS = 16, 4, 3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--free", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    llms = {k: LLM(plugin_params=pp, async_scheduling=a, dtype="float32", progress=False, cpu_threads=1)
            for k, (pp, a) in CONFIGS.items()}
    prompts = heldout_prompts(llms["off sync"].engine.tokenizer, PROMPTS, 64, seed=77)
    names = list(SCHEMAS)
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True) if args.free
              else SamplingParams(temperature=0, max_tokens=192, json_schema=SCHEMAS[names[i % len(names)]])
              for i in range(PROMPTS)]
    rates, shares, first = {k: [] for k in CONFIGS}, {k: [] for k in CONFIGS}, {}
    for _ in range(ROUNDS):
        for name, llm in llms.items():
            for g in range(0, PROMPTS, GROUP):
                timing = llm.engine.structured.timing
                before = timing.row_seconds + timing.draft_seconds
                started = time.perf_counter()
                outs = llm.generate(prompts[g:g + GROUP], params[g:g + GROUP])
                wall = time.perf_counter() - started
                rates[name].append(sum(len(o.token_ids) for o in outs) / wall)
                shares[name].append((timing.row_seconds + timing.draft_seconds - before) / wall)
                assert first.setdefault(g, outs[0].token_ids) == outs[0].token_ids, name
    report = {k: {"tokens_per_s_median": round(statistics.median(rates[k]), 1),
                  "mask_share_median": round(statistics.median(shares[k]), 4)} for k in CONFIGS}
    report["command"] = f"python scripts/structured_async.py{' --free' if args.free else ''} --out {args.out}"
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
