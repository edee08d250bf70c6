"""``mindspec bench``: the speed comparison and the decode-step profile, written as JSON + PNG.

    mindspec bench --out benchmarks/results/bench_cpu        # cpu, default model, ~15-30 min
    mindspec bench --batches 1 --ks 3 --rounds 3             # a quick look
    mindspec bench --compile ...                             # also the compiled decode steps (cpu: AOTInductor)
    mindspec bench --configs "mtp off,vanilla K=3" ...       # only these configurations
    mindspec bench --batching static ...                     # groups of b, each run to its slowest sequence
    mindspec bench --backend cuda ...                        # the cuda backend's kernel and e2e benchmarks
    mindspec bench --backend cuda --compare ...              # this comparison on a GPU (CUDA graphs on)
    mindspec bench --compare llama.cpp --llama-cpp-src DIR   # also llama.cpp, same model and prompts (parallel sequences)
    mindspec bench --model-shape deepseek-v2-lite ...        # random weights of that shape, simulated acceptance
    mindspec bench --scenario prefix-cache --out ...         # shared-prefix workloads, prefix caching on and off
    mindspec bench --scenario split-fuse --out ...           # a long prompt arriving while streams decode
    mindspec bench --scenario quantized-gemm --out ...       # one GEMM against GGUF/FP8 weights, each way it could run
    mindspec bench --scenario structured --out ...           # JSON-schema constrained requests, MTP on and off
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from mindspec.bench import (llama_cpp, model_shapes, prefix_cache, profile, quantized_gemm, speed, split_fuse,
                            structured, workloads)
from mindspec.bench.llama_cpp import LlamaCppError
from mindspec.bench.memory import resident_weight_bytes
from mindspec.backends.cpu.backend import default_cpu_threads
from mindspec.modeling.loader import MEDUSA_HEADS_FILE, read_hf_config
from mindspec.modeling.step_accounting import account_decode_steps
from mindspec.text_generator.sampling.params import SamplingParams

MIN_PROMPTS = 8  # per configuration and batch size, so that batch 1 is not one prompt's luck
# The shipped model's acceptance per draft position, vanilla K=3, on held-out prompts (benchmarks/README.md).
SHIPPED_ACCEPTANCE = (0.88, 0.77, 0.71)
BACKENDS = ("cpu", "cuda")


SCENARIOS = ("speed", "prefix-cache", "split-fuse", "quantized-gemm", "structured")
PREFIX_CONFIGS = {"mtp off": None, "vanilla K=3": {"plugin_type": "mtp", "num_speculative_tokens": 3}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="speed", choices=SCENARIOS,
                   help="speed: decoding speed per configuration and batch size; prefix-cache: multi-turn chat "
                        "and few-shot prompts with prefix caching on and off (mindspec.bench.prefix_cache); "
                        "split-fuse: a long prompt arriving while streams decode, SplitFuse on and off "
                        "(mindspec.bench.split_fuse); quantized-gemm: one GEMM against GGUF/FP8 weights, each way "
                        "the cpu backend could run it (mindspec.bench.quantized_gemm); structured: JSON-schema "
                        "constrained requests with MTP on and off: validity, speed-ups, mask cost "
                        "(mindspec.bench.structured)")
    g = p.add_argument_group("--scenario prefix-cache")
    g.add_argument("--conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--system-tokens", type=int, default=1500)
    g.add_argument("--message-tokens", type=int, default=48, help="each user message (and few-shot question)")
    g.add_argument("--shots", type=int, default=6)
    g.add_argument("--shot-tokens", type=int, default=150)
    g.add_argument("--queries", type=int, default=16)
    g = p.add_argument_group("--scenario split-fuse (also --prompt-tokens: each stream's prompt)")
    g.add_argument("--streams", type=int, default=8)
    g.add_argument("--stream-tokens", type=int, default=160, help="tokens each stream decodes")
    g.add_argument("--arrive-after", type=int, default=16, help="stream tokens before the long prompt arrives")
    g.add_argument("--long-prompt-tokens", type=int, default=4000)
    g.add_argument("--chunk-tokens", default="64,256", help="splitChunkTokens values to compare")
    g = p.add_argument_group("--scenario structured (also --rounds, --prompt-tokens, --configs, --threads, --dtype)")
    g.add_argument("--prompts", type=int, default=50, help="held-out prompts, assigned to the schemas round robin")
    g.add_argument("--max-tokens", type=int, default=192,
                   help="each constrained output's cap (the schemas' documents take 40-90 tokens on the shipped model)")
    g.add_argument("--structured-batch", type=int, default=16, help="concurrent constrained requests of the batch run")
    g.add_argument("--grammar-engines", action=argparse.BooleanOptionalAction, default=True,
                   help="also time xgrammar against llguidance (when importable) on the model's tokenizer")
    p.add_argument("--backend", default="cpu", choices=BACKENDS,
                   help="cpu (this benchmark) | cuda (the cuda backend's benchmarks; with --compare, this one)")
    p.add_argument("--compare", nargs="?", const="gpu", default=None, choices=["gpu", "llama.cpp"],
                   help="with --backend cuda: this comparison on the GPU instead of the cuda backend's benchmarks; "
                        "'llama.cpp': also llama.cpp on the same model and prompts, a batch as parallel sequences (llama-cpp-python)")
    p.add_argument("--llama-cpp-src", default=None,
                   help="llama.cpp source tree whose convert_hf_to_gguf.py converts the model (default: $LLAMA_CPP_SRC)")
    p.add_argument("--gguf", default=None, help="an already converted GGUF file of the model, for --compare llama.cpp")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="mindspec's and transformers' dtype (the cpu tables use float32)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--also-model", action="append", default=[], metavar="[LABEL=]PATH",
                   help="run every configuration on this checkpoint too (a directory or a .gguf file; repeatable), "
                        "named 'CONFIG @LABEL' (say an FP8 or GGUF conversion of --model: mindspec convert); "
                        "tokens are compared with --model's MTP off")
    p.add_argument("--model-shape", default=None, choices=sorted(model_shapes.SHAPES),
                   help="instead of --model: random weights of this published shape (one MTP module, eagle drafts), "
                        "speculation with --simulated-acceptance")
    p.add_argument("--shape-layers", type=int, default=None,
                   help="with --model-shape: keep only this many decoder layers (a layer slice that fits the machine)")
    p.add_argument("--simulated-acceptance", default=",".join(map(str, SHIPPED_ACCEPTANCE)),
                   help="with --model-shape: the share of steps accepting draft 1, 2, ... (default: the shipped "
                        "model's measured vanilla K=3 rates)")
    p.add_argument("--out", default="benchmarks/results/bench_cpu", help="output path without suffix (.json, .png)")
    p.add_argument("--batches", default="1,4,16,32")
    # Continuous by default: what a server sees (vLLM's throughput benchmark does the same).
    p.add_argument("--batching", choices=speed.BATCHING, default="continuous",
                   help="static: groups of b prompts, each run to its slowest sequence; continuous: "
                        f"{speed.WAVES} x b prompts in one run, at most b at once (see mindspec.bench.speed)")
    p.add_argument("--ks", default=None,
                   help="speculative token counts to compare (default 1,2,3,4; with --model-shape, 1 up to the "
                        "number of --simulated-acceptance rates)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=MIN_PROMPTS,
                   help="prompts per configuration and batch size at least (more: a wider per-request distribution)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--output-len-range", type=float, default=0.0,
                   help="output lengths drawn uniformly from new_tokens x [1 - r, 1 + r] per prompt "
                        "(vLLM's --random-range-ratio); 0: every output new_tokens long")
    p.add_argument("--prompt-tokens", type=int, default=64)
    g = p.add_argument_group("sampling (default greedy): every request seeded, --seed + its index, so lossless "
                             "speculation keeps MTP off's tokens and every configuration samples the same text")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0, help="the first request's seed, in [0, 2**63); request i's: (seed + i) mod 2**63")
    p.add_argument("--workload", choices=workloads.WORKLOADS, default="continue",
                   help="continue: held-out windows continued; edit: a held-out function asked for again under "
                        "another name (the output copies the prompt); mixed: both, alternating")
    p.add_argument("--threads", type=int, default=None,
                   help="cpu threads for every engine (default: what mindspec picks for the model, 1 for the "
                        "shipped one: with OpenMP's passive waiting a second thread slows a small model down; "
                        "GOMP_SPINCOUNT=300000 in the environment makes threads spin before they sleep)")
    # Off by default: the first run compiles a package per batch-size bucket and step shape (one to
    # two minutes each on two cores); later runs load them from the cache directory.
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="also measure compiled decode steps (decodeGraphs; the first run compiles for minutes)")
    p.add_argument("--configs", default=None,
                   help="comma-separated configuration names to run (default: all), e.g. 'mtp off,vanilla K=3'; "
                        "'mtp off' always runs (every speed-up is against it)")
    p.add_argument("--async", dest="asynchronous", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure async scheduling (MTP off and K=3)")
    p.add_argument("--split-fuse", action=argparse.BooleanOptionalAction, default=False,
                   help="also measure SplitFuse (MTP off and K=3 adaptive with prompts chunked into decode steps)")
    p.add_argument("--trees", action=argparse.BooleanOptionalAction, default=False,
                   help="also measure draft trees (dynamic eagle trees of several sizes, vanilla dynamic and static; "
                        "Medusa heads where the checkpoint has them)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure transformers generate on the same checkpoint")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="also profile one decode step (batch 1 and 16, MTP off and K=3)")


def run_prefix_cache(args: argparse.Namespace) -> int:
    from mindspec.llm import LLM

    model_dir, configs = _scenario_setup(args, PREFIX_CONFIGS)
    if configs is None:
        return 2
    args.prefix_configs = configs
    longest = args.system_tokens + args.turns * (args.message_tokens + args.new_tokens) + 16
    num_blocks = args.conversations * 2 * -(-longest // 16) + 8

    def make_llm(plugin_params, cached: bool):
        return LLM(model=model_dir, backend=args.backend, dtype=args.dtype, cache_block_size=16, num_blocks=num_blocks,
                   progress=False, cpu_threads=args.threads, plugin_params=plugin_params,
                   enable_prefix_caching=cached, max_input_token_len=longest, max_seq_len=longest + args.new_tokens,
                   max_prefill_tokens=max(8192, longest))

    tokenizer = make_llm(None, False).tokenizer.hf_tokenizer
    report = prefix_cache.run(args, make_llm, tokenizer)
    report["workloads"] = {"chat": {"conversations": args.conversations, "turns": args.turns,
                                    "system_tokens": args.system_tokens, "message_tokens": args.message_tokens},
                           "few-shot": {"shots": args.shots, "shot_tokens": args.shot_tokens,
                                        "queries": args.queries, "query_tokens": args.message_tokens}}
    return _write_scenario(report, args, model_dir, prefix_cache.plot)


def run_split_fuse(args: argparse.Namespace) -> int:
    from mindspec.llm import LLM

    model_dir, configs = _scenario_setup(args, PREFIX_CONFIGS)
    if configs is None:
        return 2
    args.split_configs = configs
    longest = args.long_prompt_tokens + 64
    num_blocks = (args.streams * -(-(args.prompt_tokens + args.stream_tokens + 16) // 16) + -(-longest // 16)) * 2 + 8

    def make_llm(plugin_params, chunk_tokens):
        return LLM(model=model_dir, backend=args.backend, dtype=args.dtype, cache_block_size=16, num_blocks=num_blocks,
                   progress=False, cpu_threads=args.threads, plugin_params=plugin_params,
                   split_fuse=chunk_tokens is not None, split_chunk_tokens=chunk_tokens or 512,
                   max_input_token_len=longest, max_seq_len=longest + 64, max_prefill_tokens=max(8192, longest))

    tokenizer = make_llm(None, None).tokenizer.hf_tokenizer
    report = split_fuse.run(args, make_llm, tokenizer)
    return _write_scenario(report, args, model_dir, split_fuse.plot)


def run_structured(args: argparse.Namespace) -> int:
    from mindspec.llm import LLM

    model_dir, configs = _scenario_setup(args, structured.CONFIGS)
    if configs is None:
        return 2
    args.structured_configs = {structured.BASELINE: None, **configs}  # every speed-up is against MTP off
    longest = args.prompt_tokens + 1 + args.max_tokens + 16  # BOS, drafts
    num_blocks = max(16, args.structured_batch) * -(-longest // 16) + 8

    def make_llm(plugin_params):
        return LLM(model=model_dir, backend=args.backend, dtype=args.dtype, cache_block_size=16, num_blocks=num_blocks,
                   progress=False, cpu_threads=args.threads, plugin_params=plugin_params,
                   max_batch_size=max(200, args.structured_batch))

    tokenizer = make_llm(None).tokenizer.hf_tokenizer
    report = structured.run(args, make_llm, tokenizer)
    return _write_scenario(report, args, model_dir, structured.plot)


def _scenario_setup(args: argparse.Namespace, table: dict) -> tuple[str, Optional[dict]]:
    """The checkpoint (threads set for it) and the configurations of ``table`` --configs names
    (None after printing the error when one is unknown)."""
    model_dir = args.model or str(_default_model())
    args.threads = args.threads or default_cpu_threads(hidden_size=read_hf_config(model_dir).get("hidden_size"))
    torch.set_num_threads(args.threads)
    if not args.configs:
        return model_dir, dict(table)
    wanted = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in table]
    if unknown:
        print(f"mindspec bench: unknown configuration(s) {', '.join(map(repr, unknown))}; choose from "
              f"{', '.join(table)}; nothing was measured", file=sys.stderr)
        return model_dir, None
    return model_dir, {n: table[n] for n in wanted}


def _write_scenario(report: dict, args: argparse.Namespace, model_dir: str, plot) -> int:
    report.update({"model": model_dir, "backend": args.backend, "threads": args.threads, "dtype": args.dtype,
                   "device": platform.processor() or platform.machine(),
                   "command": getattr(args, "command_line", "mindspec bench")})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_json(report, out)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.scenario == "prefix-cache":
        return run_prefix_cache(args)
    if args.scenario == "split-fuse":
        return run_split_fuse(args)
    if args.scenario == "structured":
        return run_structured(args)
    if args.scenario == "quantized-gemm":
        if args.threads:
            torch.set_num_threads(args.threads)
        report = quantized_gemm.run(rounds=args.rounds)
        return _write_scenario(report, args, "", quantized_gemm.plot)
    on_gpu = args.backend == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("mindspec bench: --backend cuda --compare needs a CUDA GPU and none is visible; nothing was measured",
              file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    try:
        params = _sampling(args)
        model_dir, shape = _model(args)
        ks = _ks(args, shape)
        hf_config = read_hf_config(model_dir)
        args.threads = args.threads or default_cpu_threads(hidden_size=hf_config.get("hidden_size"))
        torch.set_num_threads(args.threads)
        configs = speed.default_configs(ks, hf_config.get("num_nextn_predict_layers", 0),
                                        hf_config.get("bos_token_id", 0), hf_config.get("eos_token_id", 1),
                                        args.compile, args.asynchronous, args.split_fuse, args.trees,
                                        medusa=(Path(model_dir) / MEDUSA_HEADS_FILE).is_file())
        if shape:
            configs = speed.simulated(configs, shape["simulated_acceptance"])
        if args.configs:
            configs = speed.select_configs(configs, args.configs)
        base = configs
        for also in args.also_model:
            label, _, path = also.rpartition("=")
            configs = configs + speed.on_model(base, path, label or Path(path).name)
        gguf = _gguf(args, model_dir) if args.compare == "llama.cpp" else None
    except (ValueError, LlamaCppError) as exc:
        print(f"mindspec bench: {exc}; nothing was measured", file=sys.stderr)
        return 2
    # KV blocks for the most sequences ever running at once: max(batches) in both modes (continuous
    # batching queues the rest without blocks); +16 tokens per sequence cover BOS and the drafts.
    count = max(speed.prompt_count(b, args.min_prompts, args.batching) for b in batches)
    output_lens = speed.output_lengths(count, args.new_tokens, args.output_len_range)
    longest = workloads.max_prompt_tokens(args.workload, args.prompt_tokens)
    num_blocks = max(batches + [args.min_prompts]) * -(-(longest + max(output_lens) + 16) // 16) + 8
    llms = {c.name: _llm(model_dir, c, num_blocks, max(batches), args.backend, args.dtype) for c in configs}
    tokenizer = next(iter(llms.values())).tokenizer.hf_tokenizer
    prompts = workloads.prompts_for(args.workload, tokenizer, count, args.prompt_tokens)
    # transformers' generate is compared token for token, greedy: no sampled reference
    hf = _hf_model(model_dir, args.backend, args.dtype) if args.hf and not shape and params.greedy else None
    extra = {"llama.cpp": _llama_cpp(gguf, args.threads, prompts, output_lens)} if gguf else {}
    device = torch.cuda.get_device_name() if on_gpu else platform.processor() or platform.machine()
    report = {
        "model": model_dir, "model_shape": shape, "backend": args.backend, "device": device,
        "batching": args.batching, "workload": args.workload, "threads": args.threads, "rounds": args.rounds, "new_tokens": args.new_tokens,
        "output_len_range": args.output_len_range,
        "prompt_tokens": args.prompt_tokens, "dtype": args.dtype, "greedy": params.greedy,
        "sampling": None if params.greedy else {"temperature": params.temperature, "top_p": params.top_p,
                                                "top_k": params.top_k, "first_seed": params.seed},
        "prompts_per_batch": {f"batch {b}": speed.prompt_count(b, args.min_prompts, args.batching) for b in batches},
        "configs": {c.name: {"plugin_params": c.plugin_params, "decode_graphs": c.decode_graphs,
                               "compiled_prefill": _compiled_prefill(llms[c.name]),
                               "async_scheduling": c.async_scheduling, "split_fuse": c.split_fuse,
                               "lossless_policy": c.lossless, "model": c.model or model_dir,
                               "resident_weight_bytes":
                                   resident_weight_bytes(llms[c.name].engine.model_wrapper.model)}
                    for c in configs},
        "results": {},
        "command": getattr(args, "command_line", "mindspec bench"),
    }
    # Compiled steps, and on a GPU every configuration (CUDA graphs are captured per batch-size
    # bucket on first use), run once untimed per batch size.
    warm_up = frozenset(c.name for c in configs if c.decode_graphs or on_gpu)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for batch in batches:
        t = time.time()
        report["results"][f"batch {batch}"] = speed.bench_batch(llms, hf, prompts, batch, args.min_prompts, args.rounds,
                                                                params, args.batching, warm_up, output_lens,
                                                                extra)
        _write_json(report, out)  # a run cut short keeps the batch sizes it finished
        row = report["results"][f"batch {batch}"]
        print(f"batch {batch} ({args.batching}, {time.time() - t:.0f} s): " +
              ", ".join(f"{n} {r['tokens_per_s_median']:.0f} tok/s" for n, r in row.items()), flush=True)
    # Per decode step at batch 1: ops launched outside compiled steps, host syncs, H2D copies.
    report["step_accounting"] = {name: account_decode_steps(llm, prompts[0], steps=8, by_op=True) for name, llm in llms.items()}
    if args.profile:
        report["profile"] = _profile(llms, prompts, params)
        if on_gpu:
            report["profile_note"] = ("stage times on the host: the forward is launched asynchronously (a graph "
                                      "replay), and its device time lands in the first stage that waits for it")
    _write_json(report, out)
    from mindspec.bench.plots import plot_report

    plot_report(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """Greedy, or seeded sampling (bench_batch gives request i the seed --seed + i)."""
    if not args.temperature:
        return SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    if args.compare == "llama.cpp":
        raise ValueError("--compare llama.cpp times greedy decoding (its text is compared with mindspec's): "
                         "drop --temperature")
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          max_tokens=args.new_tokens, ignore_eos=True)  # checks each value


def _model(args: argparse.Namespace) -> tuple[str, Optional[dict]]:
    """The checkpoint to measure, and with --model-shape what it is: a random-weights checkpoint
    written next to --out (it is a few kB: the weights are drawn at load time)."""
    if not args.model_shape:
        return args.model or str(_default_model()), None
    if args.model or args.compare == "llama.cpp":
        raise ValueError("--model-shape replaces --model and has no llama.cpp comparison (random weights)")
    rates = [float(r) for r in args.simulated_acceptance.split(",")]
    out = Path(args.out)
    layers = f"-{args.shape_layers}l" if args.shape_layers else ""
    model_dir = model_shapes.write_shape_checkpoint(args.model_shape, out.with_name(f"{args.model_shape}{layers}-random"),
                                                    _default_model(), args.shape_layers)
    shape = {"name": args.model_shape, "num_hidden_layers": json.loads((model_dir / "config.json").read_text())[
        "num_hidden_layers"], "parameters": model_shapes.parameter_count(model_dir), "simulated_acceptance": rates}
    return str(model_dir), shape


def _ks(args: argparse.Namespace, shape: Optional[dict]) -> list[int]:
    if args.ks is not None:
        return [int(k) for k in args.ks.split(",")]
    return list(range(1, 1 + min(4, len(shape["simulated_acceptance"])))) if shape else [1, 2, 3, 4]


def _write_json(report: dict, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")


def _profile(llms: dict, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Decode-step breakdown at batch 1 and 16 for MTP off and K=3 (eager: per-layer timers need
    the layers to run one by one)."""
    out = {}
    names = [n for n in ("mtp off", "vanilla K=3", "eagle K=3") if n in llms]
    for batch in (1, 16):
        for name in names:
            group = prompts[:batch]
            out[f"batch {batch}, {name}"] = profile.profile_engine(llms[name], group, params, warmup_prompts=group)
    return out


def _llm(model_dir: str, config: "speed.Config", num_blocks: int, max_batch: int, backend: str = "cpu",
         dtype: str = "float32"):
    from mindspec.llm import LLM

    # The running limit must not cut a static group; continuous runs lower it per run. Compiled
    # configurations compile a package per batch-size bucket up to it: no more than measured. The
    # threads are --threads (set in run), not the engine's default for the model.
    limit = max_batch if config.decode_graphs else max(256, max_batch)
    llm = LLM(model=config.model or model_dir, backend=backend, dtype=dtype, cache_block_size=16, num_blocks=num_blocks,
              progress=False, cpu_threads=torch.get_num_threads(),
              plugin_params=config.plugin_params, decode_graphs=config.decode_graphs,
              async_scheduling=config.async_scheduling, max_batch_size=limit,
              max_prefill_batch_size=64, split_fuse=config.split_fuse)
    compiled = llm.engine.model_wrapper.compiled
    if compiled is not None:  # the steady state: each prompt bucket met compiles at once, or none does
        compiled.prefill_at_once = config.compile_prefill
        if not config.compile_prefill:
            compiled.prefill_max_rows = 0
    return llm


def _compiled_prefill(llm) -> bool:
    """Whether the engine runs prefills as compiled packages (cpu, ``--compile``)."""
    compiled = llm.engine.model_wrapper.compiled
    return compiled is not None and compiled.prefill_max_rows > 0


def _gguf(args: argparse.Namespace, model_dir: str) -> Path:
    """The model as GGUF: --gguf, else converted next to --out (kept for later runs)."""
    llama_cpp.require_llama_cpp()
    if args.gguf:
        if not Path(args.gguf).is_file():
            raise LlamaCppError(f"--gguf {args.gguf}: no such file")
        return Path(args.gguf)
    return llama_cpp.convert(model_dir, Path(args.out).with_name(f"{Path(model_dir).name}-f32.gguf"),
                             llama_cpp.converter_dir(args.llama_cpp_src))


def _llama_cpp(gguf: Path, threads: int, prompts: list[list[int]], output_lens: list[int]):
    """llama.cpp on ``gguf``: a function running one round over prompts, in groups of the batch size."""
    runner = llama_cpp.LlamaCppRunner(gguf, threads, max(len(p) for p in prompts) + max(output_lens) + 8)
    return lambda group, lengths, m, batch: llama_cpp.run_llama_cpp(runner, group, lengths, m, batch)


def _hf_model(model_dir: str, backend: str = "cpu", dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    # transformers' own default for the experts (grouped_mm where torch has it): what its users
    # get, and on this model no slower than the eager loop (1.1x faster at batch 16).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return model.to("cuda") if backend == "cuda" else model


def _default_model() -> Path:
    from mindspec.config.defaults import default_model_dir

    return default_model_dir()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    backend = argparse.ArgumentParser(add_help=False)
    backend.add_argument("--backend", default="cpu")
    backend.add_argument("--compare", nargs="?", const="gpu")
    chosen = backend.parse_known_args(argv)[0]
    if chosen.backend == "cuda" and chosen.compare != "gpu":  # the cuda backend has its own benchmark
        from mindspec.backends.cuda.bench import main as cuda_main

        return cuda_main(argv)
    p = argparse.ArgumentParser(prog="mindspec bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args.command_line = "mindspec bench " + " ".join(argv)
    return run(args)
