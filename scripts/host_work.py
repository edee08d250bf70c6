"""The host's work per decode step, without the step's arithmetic: compiled steps on cpu whose
package calls are recorded in one pass over the prompts and replayed in the next ones.

A replayed call returns the recorded outputs at once, so what a decode step costs in the replay
is everything the engine, the plugins, the graph runner and the package glue do around the
package: the work a GPU's host does per step while the device computes (there it decides
whether speculation pays at batch 1). The host's caches stay warm here, as on a GPU's host;
on cpu a real package evicts them, and the same work takes longer in place. Each replayed request
must give the recorded tokens (checked). 1 thread, greedy, 12 held-out mixed prompts one at a
time, or with ``--batch B`` 6 x B prompts, B at a time.

    python scripts/host_work.py [--configs off,plain,k3] [--mode vanilla] [--staged] [--batch 1]
                                [--new-tokens 128] [--replays 3] [--out DIR]

``plain``: the MTP engine (K=3, ``--mode`` vanilla or eagle) with every step plain; ``kN``: every
step N drafts. ``--staged``: the graph runner loads each step's static inputs through its staging
buffer, as on a GPU (where the packed arrays then go to the device in one copy), instead of
assigning them into the cpu buffer's own views.
Writes DIR/host_work.json and .png (host_work_bB.* for a batch B > 1; DIR: benchmarks/out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support (scripted draft counts)

from mindspec.bench import speed, workloads  # noqa: E402
from mindspec.config.defaults import default_model_dir  # noqa: E402
from mindspec.engine import llm_engine  # noqa: E402
from mindspec.llm import LLM  # noqa: E402
from mindspec.modeling import aoti_runner, graph_runner  # noqa: E402
from mindspec.text_generator import plugin_manager  # noqa: E402
from mindspec.text_generator.sampling.params import SamplingParams  # noqa: E402
from tests.support.draft_counts import ScriptedSpeculation  # noqa: E402

K = 3


class Tape:
    """Records the package calls' outputs, then replays them in the same order."""

    def __init__(self):
        self.mode, self.calls, self.at = "off", [], 0
        self.step_seconds: list[float] = []
        self._prefill = True

    def install(self) -> None:
        tape, call = self, aoti_runner.ReleasedRunner.__call__

        def replayed(runner, *tensors, before_run=None):
            if tape.mode == "replay":
                if before_run is not None:
                    before_run()
                tape.at += 1
                return list(tape.calls[tape.at - 1])
            out = call(runner, *tensors, before_run=before_run)
            if tape.mode == "record":
                tape.calls.append([t.clone() for t in out])
            return out

        step, generate = llm_engine.LLMEngine.step, plugin_manager.PluginManager.generate_token

        def timed_step(engine):
            start = time.perf_counter()
            out = step(engine)
            if tape.mode == "replay" and not tape._prefill:
                tape.step_seconds.append(time.perf_counter() - start)
            return out

        def noting_prefill(manager, batch):
            tape._prefill = batch.is_prefill
            return generate(manager, batch)

        aoti_runner.ReleasedRunner.__call__ = replayed
        llm_engine.LLMEngine.step = timed_step
        plugin_manager.PluginManager.generate_token = noting_prefill


def stage_static_inputs() -> None:
    """Every StaticInputs made from now on loads through its Staging, as on a GPU."""
    init = graph_runner.StaticInputs.__init__

    def staged(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.host = None

    graph_runner.StaticInputs.__init__ = staged


def engine(config: str, model: str, batch: int, mode: str = "vanilla") -> LLM:
    llm = LLM(model=model, cpu_threads=1, max_batch_size=batch, decode_graphs=True, progress=False,
              plugin_params=None if config == "off" else speed.mtp(K, mode, adaptive=False))
    llm.engine.model_wrapper.compiled.prefill_max_rows = 0  # prefills eager: only decode steps are packages
    if config != "off":
        drafts = 0 if config == "plain" else int(config[1:])
        llm.engine.plugin_manager.plugins[0].adaptive = ScriptedSpeculation([drafts], K, planned=drafts)
    return llm


def measure(config: str, model: str, prompts, params: SamplingParams, replays: int, batch: int,
            mode: str = "vanilla") -> dict:
    tape = TAPE
    tape.mode, tape.calls, tape.step_seconds = "off", [], []
    llm = engine(config, model, batch, mode)
    warm, prompts = prompts[: max(2, batch)], prompts[max(2, batch):]
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    llm.generate(warm, params)  # every shape's package loaded (or compiled) first
    tape.mode = "record"
    want = [[o.token_ids for o in llm.generate(g, params)] for g in groups]
    tape.mode = "replay"
    for _ in range(replays):
        tape.at = 0
        for g, tokens in zip(groups, want):
            if [o.token_ids for o in llm.generate(g, params)] != tokens:
                raise RuntimeError(f"{config}: a replayed request gave other tokens than recorded")
    ms = sorted(1e3 * s for s in tape.step_seconds)
    tape.mode = "off"
    llm.engine.close()
    tokens = sum(len(t) for g in want for t in g) * replays
    return {"config": config, "mode": None if config == "off" else mode, "batch": batch, "decode_steps": len(ms),
            "tokens_per_step": tokens / len(ms),
            "host_ms_median": statistics.median(ms), "host_ms_p10": ms[len(ms) // 10], "host_ms_p90": ms[9 * len(ms) // 10],
            "host_ms_mean": statistics.mean(ms)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    names = [r["config"] for r in rows]
    ax.bar(names, [r["host_ms_median"] for r in rows], color="#4c72b0")
    ax.errorbar(names, [r["host_ms_median"] for r in rows], fmt="none", ecolor="black", capsize=4,
                yerr=[[r["host_ms_median"] - r["host_ms_p10"] for r in rows],
                      [r["host_ms_p90"] - r["host_ms_median"] for r in rows]])
    ax.set_ylabel("host ms per decode step (p10-p90)")
    ax.set_title("host work per decode step, packages replayed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


TAPE = Tape()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="off,plain,k3")
    ap.add_argument("--mode", default="vanilla", choices=["vanilla", "eagle"])
    ap.add_argument("--staged", action="store_true", help="static inputs through the staging copy (a GPU's path)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    TAPE.install()
    if args.staged:
        stage_static_inputs()
    model = str(default_model_dir())
    from transformers import AutoTokenizer
    groups = 12 if args.batch == 1 else 6  # (the held-out set has ~190 prompts)
    prompts = workloads.prompts_for("mixed", AutoTokenizer.from_pretrained(model), groups * args.batch + max(2, args.batch), 64)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for config in args.configs.split(","):
        rows.append(measure(config, model, prompts, params, args.replays, args.batch, args.mode))
        r = rows[-1]
        print(f"{config:6s} {r['decode_steps']:5d} decode steps, {r['tokens_per_step']:.2f} tokens each: host "
              f"{r['host_ms_median']:.3f} ms per step (p10 {r['host_ms_p10']:.3f}, p90 {r['host_ms_p90']:.3f})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "host_work" if args.batch == 1 else f"host_work_b{args.batch}"
    (out / f"{name}.json").write_text(json.dumps({"torch": torch.__version__, "staged": args.staged, "rows": rows},
                                                 indent=2))
    plot(rows, out / f"{name}.png")


if __name__ == "__main__":
    main()
