"""Where a decode step's time goes on a GPU, through the engine (not the isolated step): wall time
per step, tokens per step, the device's busy time per step (torch.profiler's kernel and copy
events), the step accounting (ops outside graphs, host syncs, host-to-device copies) and a cProfile of
the host, for MTP off, Vanilla K=3 and Eagle K=3 at batch 1.

    OUT=benchmarks/out/gpu bash scripts/gpu_check.sh py scripts/gpu_step_profile.py

Writes OUT/step_profile.json, and per configuration OUT/<config>_cprofile.txt and
OUT/<config>_kernels.txt. DTYPE (float32), STEPS (120) and CONFIGS (off,vanilla3,eagle3; each
also as NAME_async: async scheduling) come from the environment. The prompt
is a fixed token range; each timed window runs on one request that does not end inside it.
"""
import cProfile
import io
import json
import os
import pstats
import time

import torch

from mindspec import LLM, SamplingParams
from mindspec.config.defaults import default_model_dir
from mindspec.modeling.step_accounting import account_decode_steps

OUT = os.environ.get("OUT", "benchmarks/out/gpu")
DTYPE = os.environ.get("DTYPE", "float32")
STEPS = int(os.environ.get("STEPS", 120))
MTP = {"plugin_type": "mtp", "num_speculative_tokens": 3, "adaptive_speculation": False}
MAX_TOKENS_PER_STEP = 4  # K + 1
SYNC = {"off": {}, "vanilla3": {**MTP, "mtp_mode": "vanilla"}, "eagle3": {**MTP, "mtp_mode": "eagle"}}
# name -> (plugin_params, async scheduling): each also with the host's work beside the device (NAME_async)
CONFIGS = {**{n: (p, False) for n, p in SYNC.items()}, **{f"{n}_async": (p, True) for n, p in SYNC.items()}}


def timed_steps(engine, n: int) -> tuple[float, float]:
    """(seconds per step, tokens per step) over n engine steps of one running request: a fresh one
    (prefilled before the clock starts) whenever the current one could end inside the window."""
    budget = engine.scheduler.config.max_iter_times  # a request's most output tokens
    state = next(iter(engine.requests.values()), None)
    if state is None or state.seq.num_output_tokens + MAX_TOKENS_PER_STEP * n > budget:
        for running in list(engine.requests.values()):  # keyed by sequence id; abort takes request ids
            engine.abort(running.request_id)
        engine.add_request(list(range(5, 40)), SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True))
        engine.step()  # the prefill
        state = next(iter(engine.requests.values()))
    assert len(engine.requests) == 1, "one request at a time: batch 1"
    seq = state.seq
    before = seq.num_output_tokens
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n, (seq.num_output_tokens - before) / n


def profile(name: str, plugin_params: dict, async_scheduling: bool) -> dict:
    llm = LLM(model=str(default_model_dir()), backend="cuda", dtype=DTYPE, progress=False, plugin_params=plugin_params,
              async_scheduling=async_scheduling)
    engine = llm.engine
    accounting = account_decode_steps(engine, list(range(5, 40)), steps=8, by_op=True)  # also warms the graphs up
    timed_steps(engine, 30)
    wall, tokens = timed_steps(engine, STEPS)
    host = cProfile.Profile()
    host.enable()
    timed_steps(engine, STEPS // 2)
    host.disable()
    text = io.StringIO()
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    with open(f"{OUT}/{name}_cprofile.txt", "w") as f:
        f.write(text.getvalue())
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        timed_steps(engine, 20)
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    with open(f"{OUT}/{name}_kernels.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="device_time_total", row_limit=40))
    runner = engine.model_wrapper.graph_runner
    result = dict(config=name, dtype=DTYPE, ms_per_step=wall * 1e3, tokens_per_step=tokens, tokens_per_s=tokens / wall,
                  device_busy_ms_per_step=sum(e.time_range.elapsed_us() for e in device) / 20 / 1e3,
                  device_events_per_step=len(device) / 20, step_accounting=accounting,
                  graphs=None if runner is None else sorted(map(str, runner.stats.by_key)))
    llm.close()
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    names = os.environ.get("CONFIGS", ",".join(CONFIGS)).split(",")
    results = [profile(name, *CONFIGS[name]) for name in names]
    with open(f"{OUT}/step_profile.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
