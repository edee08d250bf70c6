"""MTP speed-up on the shipped default model (a benchmark, not a test).

    python benchmarks/bench_mtp.py --out benchmarks/results/mtp_cpu

Greedy generation of prompts cut from the held-out stdlib files, at batch 1 and batch 8, with MTP
off, MTP Vanilla and MTP Eagle for K = 1..4, plus transformers' ``generate`` on the main model as a
reference. Every configuration runs in this one process, interleaved round by round (A, B, C, A,
B, C, ...), and the median of the rounds is reported, so ratios are measured side by side on a
shared machine. Writes ``<out>.json`` and ``<out>.png``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mindspec import LLM, SamplingParams
from mindspec.config.defaults import default_model_dir

ROOT = Path(__file__).resolve().parents[1]
MIN_PROMPTS = 8


def heldout_prompts(tokenizer, count: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Token windows cut from the files the training script held out (same selection)."""
    spec = importlib.util.spec_from_file_location("train_default_model", ROOT / "scripts" / "train_default_model.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    _, held = train.corpus_files()
    rng = np.random.default_rng(seed)
    prompts = []
    for path in held:
        ids = tokenizer.encode(train.read(path), add_special_tokens=False)
        if len(ids) < prompt_tokens + 64:
            continue
        start = int(rng.integers(0, len(ids) - prompt_tokens - 64))
        prompts.append([tokenizer.bos_token_id] + ids[start : start + prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


def configs(ks: list[int], mtp_modules: int) -> list[tuple[str, dict | None]]:
    out = [("mtp off", None)]
    for mode in ("vanilla", "eagle"):
        # Vanilla runs module k at depth k, so it cannot go deeper than the checkpoint; Eagle can.
        for k in ks if mode == "eagle" else [k for k in ks if k <= mtp_modules]:
            out.append((f"{mode} K={k}", {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode}))
    return out


def run_mindspec(llm: LLM, groups, params) -> tuple[float, list, dict]:
    start = time.perf_counter()
    outs = [o for group in groups for o in llm.generate(group, params)]
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    stats = [o.spec_decode for o in outs if o.spec_decode is not None]
    spec = {}
    if stats:
        steps = sum(s.num_steps for s in stats)
        per_pos = np.sum([s.accepted_per_position for s in stats], axis=0)
        spec = {"mean_accepted_length": (sum(s.num_accepted_tokens for s in stats) + steps) / steps,
                "acceptance_per_position": (per_pos / steps).round(4).tolist()}
    return tokens / seconds, [o.token_ids for o in outs], spec


def run_hf(model, groups, new_tokens: int) -> float:
    start = time.perf_counter()
    tokens = 0
    for (p,) in groups:  # batch 1 only: HF has no paged batching of ragged prompts
        out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        tokens += out.shape[1] - len(p)
    return tokens / (time.perf_counter() - start)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mtp_cpu"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = str(default_model_dir())
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    mtp_modules = json.loads((Path(model_dir) / "config.json").read_text()).get("num_nextn_predict_layers", 0)
    runs = configs([int(k) for k in args.ks.split(",")], mtp_modules)
    llms = {name: LLM(model=model_dir, dtype="float32", cache_block_size=16, num_blocks=512, progress=False,
                      plugin_params=pp) for name, pp in runs}
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    batches = [int(b) for b in args.batches.split(",")]
    # At least MIN_PROMPTS prompts per configuration, run `batch` at a time, so that batch 1 is not
    # one prompt's luck.
    prompts_all = heldout_prompts(llms["mtp off"].tokenizer.hf_tokenizer, max(batches + [MIN_PROMPTS]), args.prompt_tokens)
    results = {}
    for batch in batches:
        count = max(batch, MIN_PROMPTS)
        groups = [prompts_all[i : i + batch] for i in range(0, count, batch)]
        speeds = {name: [] for name, _ in runs} | {"transformers generate": []}
        outputs, spec = {}, {}
        for _ in range(args.rounds):
            for name, _ in runs:
                tps, toks, stats = run_mindspec(llms[name], groups, params)
                speeds[name].append(tps)
                outputs[name], spec[name] = toks, stats
            if batch == 1:
                speeds["transformers generate"].append(run_hf(hf, groups, args.new_tokens))
        base = statistics.median(speeds["mtp off"])
        results[f"batch {batch}"] = {
            name: {
                "tokens_per_s_median": statistics.median(v),
                "tokens_per_s_rounds": v,
                "speedup_vs_mtp_off": statistics.median(v) / base,
                **spec.get(name, {}),
                **({"lossless": outputs[name] == outputs["mtp off"]} if name in outputs else {}),
            }
            for name, v in speeds.items() if v
        }
        print(json.dumps({f"batch {batch}": {n: round(r["speedup_vs_mtp_off"], 2) for n, r in results[f"batch {batch}"].items()}}))
    report = {
        "model": model_dir, "device": "cpu", "threads": args.threads, "rounds": args.rounds,
        "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "prompts": max(batches + [MIN_PROMPTS]), "results": results,
        "command": "python " + " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(report["results"])
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(6 * (len(batches) + 1), 4.5))
    for ax, batch in zip(axes, batches):
        rows = report["results"][batch]
        names = list(rows)
        ax.bar(range(len(names)), [rows[n]["speedup_vs_mtp_off"] for n in names], color="#4c72b0")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s relative to MTP off (median)")
        ax.set_title(f"{batch}, greedy, cpu")
    ax = axes[-1]
    for name, row in report["results"][batches[0]].items():
        if "acceptance_per_position" in row:
            ax.plot(range(1, len(row["acceptance_per_position"]) + 1), row["acceptance_per_position"], marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"acceptance per draft position ({batches[0]})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
