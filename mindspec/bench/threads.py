"""CPU thread policy benchmark: intra-op threads and OpenMP's wait policy, on an idle machine and
with a busy neighbour process holding one core.

    python -m mindspec.bench.threads --out benchmarks/results/cpu_threads

Each configuration runs in its own process (OpenMP reads its environment once, when torch loads
it), rounds interleave the configurations, and a neighbour (a Python busy loop) runs only during
the "busy" configurations. A run loads the shipped model, warms up, then times requests at batch 1
(one at a time, per-request latency) and a batch of 16 submitted together. The measured process
imports torch before mindspec, so OpenMP sees exactly the environment set here ("default" is
OpenMP's own default, not mindspec's). The 1-minute load average before each run is recorded:
on a shared machine "idle" only means "no neighbour of ours". Writes JSON and a PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# torch (and with it OpenMP) loads before mindspec/__init__.py could set OMP_WAIT_POLICY
CHILD = "import sys, torch; from mindspec.bench.threads import main; sys.exit(main(sys.argv[1:]))"
NEW_TOKENS = 64
BATCH = 16
SOLO_PROMPTS = 6


def _child(threads: int, mtp: bool) -> dict:
    """Runs in the measured process: returns timings in seconds."""
    import torch

    from mindspec.bench.corpus import heldout_prompts
    from mindspec.llm import LLM
    from mindspec.text_generator.sampling.params import SamplingParams

    start = time.perf_counter()
    torch.set_num_threads(threads)
    llm = LLM(progress=False, **({} if mtp else {"plugin_params": ""}))  # "": no plugin
    loaded = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = heldout_prompts(llm.tokenizer, SOLO_PROMPTS + BATCH, 64, seed=7)
    llm.generate(prompts[:1], params)  # warm-up
    solo = []
    for p in prompts[:SOLO_PROMPTS]:
        t = time.perf_counter()
        llm.generate([p], params)
        solo.append(time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate(prompts[SOLO_PROMPTS:], params)
    batch = time.perf_counter() - t
    return {"load_s": loaded, "solo_s": solo, "batch_s": batch}


def _configs(neighbours=("idle", "busy"), policies=("default", "passive"), thread_counts=(1, 2)) -> list[dict]:
    return [{"neighbour": n, "wait_policy": p, "threads": t} for n in neighbours for p in policies for t in thread_counts]


def _name(cfg: dict) -> str:
    policy = cfg["wait_policy"]
    if policy.startswith("spin"):  # OpenMP's default policy with a bounded spin before sleeping
        return f"{cfg['neighbour']}, {cfg['threads']} thread(s), GOMP_SPINCOUNT={policy[4:]}"
    return f"{cfg['neighbour']}, {cfg['threads']} thread(s), OMP_WAIT_POLICY={policy}"


def _policy_env(policy: str) -> dict:
    if policy == "default":
        return {}
    if policy.startswith("spin"):
        return {"GOMP_SPINCOUNT": policy[4:]}
    return {"OMP_WAIT_POLICY": policy.upper()}


def _run_one(cfg: dict, mtp: bool) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    env.update(_policy_env(cfg["wait_policy"]))
    env["MINDSPEC_CPU_THREADS"] = str(cfg["threads"])
    neighbour = None
    if cfg["neighbour"] == "busy":
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t = time.perf_counter()
        load_before = os.getloadavg()[0]
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, "--child", str(cfg["threads"]), *([] if mtp else ["--no-mtp"])],
            env=env, capture_output=True, text=True, check=True,
        )
        wall = time.perf_counter() - t
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    result["loadavg_1m_before"] = load_before
    return result


def _summary(runs: list[dict]) -> dict:
    solo = [s for r in runs for s in r["solo_s"]]
    return {
        "request_median_s": statistics.median(solo),
        "request_worst_s": max(solo),
        "batch16_median_s": statistics.median(r["batch_s"] for r in runs),
        "batch16_tokens_per_s": BATCH * NEW_TOKENS / statistics.median(r["batch_s"] for r in runs),
        "process_wall_median_s": statistics.median(r["process_wall_s"] for r in runs),
        "load_median_s": statistics.median(r["load_s"] for r in runs),
        "loadavg_1m_before_median": statistics.median(r["loadavg_1m_before"] for r in runs),
    }


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, label in ((axes[0], "request_median_s", "batch-1 request, median (s)"),
                           (axes[1], "batch16_median_s", f"batch of {BATCH}, median (s)")):
        values = [report["results"][n][key] for n in names]
        colors = ["#c44e52" if n.startswith("busy") else "#4c72b0" for n in names]
        ax.barh(range(len(names)), values, color=colors)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    fig.suptitle(f"cpu thread policy, shipped model, MTP {'K=3' if report['mtp'] else 'off'}, "
                 f"{NEW_TOKENS} new tokens, {os.cpu_count()} cores (red: a busy neighbour holds one core)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _choices(raw: str, allowed: tuple, option: str, pattern: str = "") -> tuple:
    picked = tuple(x.strip() for x in raw.split(",") if x.strip())
    bad = [x for x in picked if x not in allowed and not (pattern and re.fullmatch(pattern, x))]
    if bad or not picked:
        raise SystemExit(f"{option}: choose from {', '.join(allowed)}, got {raw!r}")
    return picked


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mindspec.bench.threads", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/cpu_threads", help="path prefix of the JSON and PNG")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--neighbours", default="idle,busy", help="comma-separated subset of idle,busy")
    p.add_argument("--policies", default="default,passive",
                   help="comma-separated: default, passive, spinN (GOMP_SPINCOUNT=N with the default policy)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--note", default="", help="stored in the JSON (e.g. what else ran on the machine)")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(args.child, args.mtp)))
        return 0
    configs = _configs(_choices(args.neighbours, ("idle", "busy"), "--neighbours"),
                       _choices(args.policies, ("default", "passive", "spinN"), "--policies", r"spin\d+"),
                       [int(t) for t in args.threads.split(",")])
    runs: dict[str, list[dict]] = {_name(c): [] for c in configs}
    for r in range(args.rounds):
        for cfg in configs:
            runs[_name(cfg)].append(_run_one(cfg, args.mtp))
            print(f"round {r + 1}: {_name(cfg)}: {runs[_name(cfg)][-1]['solo_s']}", file=sys.stderr, flush=True)
    report = {"cores": os.cpu_count(), "mtp": args.mtp, "note": args.note, "new_tokens": NEW_TOKENS, "rounds": args.rounds,
              "results": {name: _summary(rs) for name, rs in runs.items()}, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    _plot(report, out.with_suffix(".png"))
    print(json.dumps(report["results"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
