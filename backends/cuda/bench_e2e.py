"""End-to-end benchmarks for ``mindspec bench --backend cuda`` (GPU only): decode-step latency with
and without CUDA graphs, and tokens/s with MTP on and off (graphs on and off).

Configurations are measured side by side in one process, interleaved round by round (A, B, A,
B, ...), and medians reported (DESIGN.md section 8).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from mindspec.modeling.forward_metadata import build_model_inputs, to_device


def _mtp_modules(k: int, mode: str) -> list[int]:
    return list(range(k)) if mode == "vanilla" else [0] * k


def _step_fn(wrapper, batch: int, context: int, k: int, mode: str, block_size: int, seed: int = 0):
    """Prefill ``batch`` random sequences of ``context`` tokens, then return a callable running one
    decode step (plain decode when k = 0, else K MTP drafts + verification) from host inputs."""
    from mindspec.plugins.mtp import decode_inputs as di

    rng = np.random.default_rng(seed)
    cfg = wrapper.config
    per_seq = -(-(context + 2 * k + 2) // block_size)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    tokens = [rng.integers(2, cfg.vocab_size, context).tolist() for _ in range(batch)]
    dev = wrapper.device
    prefill = to_device(build_model_inputs(tokens, [0] * batch, tables, block_size), dev)
    modules = _mtp_modules(k, mode)
    if k:
        wrapper.forward_prefill_mtp(prefill, sorted(set(modules)))
    else:
        wrapper.forward(prefill)
    if not k:
        host = build_model_inputs([[t[-1]] for t in tokens], [context] * batch, tables, block_size)
        return lambda: wrapper.forward_host(host)
    num_tokens = np.full(batch, context)
    layout = di.decode_layout(num_tokens, np.ones(batch, dtype=np.int64), k, mode)
    table_arr = di.block_tables(tables)
    main = di.main_inputs(np.array([t[-1] for t in tokens]), num_tokens, table_arr, block_size, k)
    subs = di.sub_inputs(tokens, layout, table_arr, block_size, k, mode)
    # Drawn on the host: a failed graph capture can leave the device generator unusable.
    hidden = torch.randn(int(layout.sub_q_lens.sum()), cfg.hidden_size).to(dev, wrapper.dtype)

    def step():
        return wrapper.forward_speculative_host(main, subs, modules, hidden, subs[0].lm_head_indices)

    return step


def _set_up(model_dir: str, dtype: str, batch: int, context: int, k: int, mode: str, block_size: int):
    """(wrapper, its graph runner, one decode step from host inputs) on the cuda backend."""
    from mindspec.modeling.graph_runner import DecodeGraphRunner
    from mindspec.modeling.model_wrapper import ModelWrapper

    modules = sorted(set(_mtp_modules(k, mode)))
    wrapper = ModelWrapper(model_dir, backend="cuda", dtype=dtype, num_mtp_modules=len(modules), progress=False)
    per_seq = -(-(context + 2 * k + 2) // block_size)
    wrapper.allocate_cache(batch * per_seq + 2, block_size)
    runner = wrapper.graph_runner or DecodeGraphRunner(wrapper)
    return wrapper, runner, _step_fn(wrapper, batch, context, k, mode, block_size)


def _time_ms(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


@torch.inference_mode()
def decode_latency(model_dir: str, dtype: str, batch: int, context: int, k: int, mode: str,
                   rounds: int, iters: int, block_size: int = 64) -> dict:
    wrapper, runner, step = _set_up(model_dir, dtype, batch, context, k, mode, block_size)
    times = {"eager": [], "graphs": []}
    for _ in range(rounds):
        for name in times:
            wrapper.graph_runner = runner if name == "graphs" else None
            step()  # warm-up (first graph call captures)
            times[name].append(_time_ms(step, iters))
    eager, graphs = statistics.median(times["eager"]), statistics.median(times["graphs"])
    return {
        "batch": batch, "context": context, "num_speculative_tokens": k, "mtp_mode": mode if k else None,
        "eager_ms": eager, "graphs_ms": graphs, "graph_speedup": eager / graphs,
        "eager_ms_rounds": times["eager"], "graphs_ms_rounds": times["graphs"],
        "graph_captures": runner.stats.captures, "graph_capture_failures": runner.stats.eager_fallbacks,
    }


def stdlib_prompts(tokenizer, count: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Token windows cut from this Python's standard-library sources (the shipped model's domain)."""
    import json as json_mod

    rng = np.random.default_rng(seed)
    files = sorted(Path(json_mod.__file__).parent.parent.glob("*.py"))
    prompts = []
    for path in rng.permutation(len(files)):
        ids = tokenizer.encode(files[path].read_text(errors="replace"), add_special_tokens=False)
        if len(ids) < prompt_tokens + 1:
            continue
        start = int(rng.integers(0, len(ids) - prompt_tokens))
        prompts.append(ids[start : start + prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


def throughput(model_dir: str, dtype: str, batches: list[int], new_tokens: int, prompt_tokens: int,
               k: int, mode: str, rounds: int) -> list[dict]:
    """tokens/s for MTP off/on x graphs on/off, greedy, per batch size."""
    from mindspec import LLM, SamplingParams

    on = {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode}
    llms = {
        "mtp off": LLM(model=model_dir, backend="cuda", dtype=dtype, cache_block_size=64, num_blocks=1024, progress=False),
        "mtp on": LLM(model=model_dir, backend="cuda", dtype=dtype, cache_block_size=64, num_blocks=1024, progress=False,
                      plugin_params=on),
    }
    runners = {name: llm.engine.model_wrapper.graph_runner for name, llm in llms.items()}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = stdlib_prompts(llms["mtp off"].tokenizer, max(batches) * 2, prompt_tokens)
    results = []
    for batch in batches:
        groups = [prompts[i : i + batch] for i in range(0, 2 * batch, batch)]
        speeds = {(m, g): [] for m in llms for g in ("graphs", "eager")}
        accepted = {}
        for _ in range(rounds):
            for (mtp, graphs), runs in speeds.items():
                wrapper = llms[mtp].engine.model_wrapper
                wrapper.graph_runner = runners[mtp] if graphs == "graphs" else None
                llms[mtp].generate(groups[0][:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
                torch.cuda.synchronize()
                start = time.perf_counter()
                outs = [o for group in groups for o in llms[mtp].generate(group, params)]
                torch.cuda.synchronize()
                runs.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
                stats = [o.spec_decode for o in outs if o.spec_decode is not None]
                if stats:
                    steps = sum(s.num_steps for s in stats)
                    accepted[graphs] = (sum(s.num_accepted_tokens for s in stats) + steps) / steps
        base = statistics.median(speeds[("mtp off", "eager")])
        for (mtp, graphs), runs in speeds.items():
            results.append({
                "batch": batch, "mtp": mtp, "graphs": graphs == "graphs", "tokens_per_s": statistics.median(runs),
                "tokens_per_s_rounds": runs, "speedup_vs_mtp_off_eager": statistics.median(runs) / base,
                **({"mean_accepted_length": accepted.get(graphs)} if mtp == "mtp on" else {}),
            })
    return results


def kernel_table(events, steps: int, top: int = 15) -> dict:
    """Device activity of ``steps`` decode steps (profiler events) -> per step: device ms,
    kernels launched, and the ``top`` kernels by time (name, launches, ms)."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    total = sum(sum(v) for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "device_ms_per_step": round(total / steps, 4),
        "kernels_per_step": round(sum(len(v) for v in by_name.values()) / steps, 1),
        "top": [{"name": n[:120], "launches_per_step": round(len(v) / steps, 2), "ms_per_step": round(sum(v) / steps, 4),
                 "share": round(sum(v) / total, 4)} for n, v in ranked],
    }


@torch.inference_mode()
def step_kernels(model_dir: str, dtype: str, batch: int, context: int, k: int, mode: str, iters: int = 20,
                 block_size: int = 64) -> dict:
    """Where a decode step's device time goes, kernel by kernel: the step run eagerly under
    torch.profiler (a kernel costs the same inside a graph; the graph removes launch gaps), and the
    same step replayed as a CUDA graph for its wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    wrapper, runner, step = _set_up(model_dir, dtype, batch, context, k, mode, block_size)
    wrapper.graph_runner = runner
    step()
    graph_ms = statistics.median(_time_ms(step, iters) for _ in range(3))
    wrapper.graph_runner = None
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    del wrapper, runner
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "num_speculative_tokens": k, "mtp_mode": mode if k else None,
            "graph_ms": round(graph_ms, 4), **kernel_table(events, iters)}
