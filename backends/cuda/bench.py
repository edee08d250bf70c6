"""``mindspec bench --backend cuda``: kernel bandwidth (attention, MoE) as a fraction of the
device's peak, decode-step latency with and without CUDA graphs, tokens/s with MTP on and off.
Writes ``<out>.json`` and ``<out>.png``. It needs a CUDA GPU and refuses clearly without one.

    mindspec bench --backend cuda --out benchmarks/out/cuda_h100
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from mindspec.backends.cuda.availability import interpreting

SECTIONS = ("kernels", "linear", "decode", "throughput", "step_kernels")
DEFAULT_SECTIONS = ("kernels", "linear", "decode", "throughput")  # step_kernels: asked for by name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindspec bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda", choices=["cuda"], help="only the cuda backend has this benchmark")
    p.add_argument("--out", default="benchmarks/out/cuda_bench", help="writes OUT.json and OUT.png")
    p.add_argument("--model", default=None, help="checkpoint for the end-to-end parts (default: the shipped model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                   help=f"comma-separated subset of {', '.join(SECTIONS)} (step_kernels: a decode step's device "
                        "time kernel by kernel, plain and speculative, batch 1)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and rounds (a smoke run)")
    p.add_argument("--heads", type=int, default=128, help="attention heads per GPU (DeepSeek-V3: 128; 16 under TP 8)")
    p.add_argument("--moe-experts", type=int, default=64, help="routed experts held on the GPU for the MoE kernel")
    p.add_argument("--batches", default="1,8,32", help="batch sizes for decode latency and tokens/s")
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence for decode latency")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--mtp-mode", default="vanilla", choices=["vanilla", "eagle"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    return p


def parse_sections(text: str) -> list[str]:
    sections = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise ValueError(f"unknown --sections {unknown or text!r}; choose from {', '.join(SECTIONS)}")
    return sections


def environment_problem() -> Optional[str]:
    """Why this benchmark cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "the cuda benchmark needs triton: pip install 'mindspec[cuda]'"
    if not torch.cuda.is_available():
        return (f"the cuda benchmark needs a CUDA GPU and none is visible (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False); nothing was measured")
    if interpreting():
        return "TRITON_INTERPRET=1 is set: the interpreter is for tests; unset it to benchmark the GPU kernels"
    if importlib.util.find_spec("matplotlib") is None:
        return "the cuda benchmark draws its PNG with matplotlib: pip install 'mindspec[bench]'"
    return None


def device_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "name": props.name, "sm_count": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sections = parse_sections(args.sections)
    except ValueError as exc:
        print(f"mindspec bench: error: {exc}", file=sys.stderr)
        return 2
    problem = environment_problem()
    if problem:
        print(f"mindspec bench: {problem}", file=sys.stderr)
        return 2
    report = run(args, sections, list(sys.argv[1:] if argv is None else argv))
    json_path, png_path = write_report(report, Path(args.out))
    print(f"wrote {json_path} and {png_path}")
    return 0


def run(args: argparse.Namespace, sections: list[str], argv: list[str]) -> dict:
    from mindspec.backend import get_backend
    from mindspec.config.defaults import default_model_dir
    from mindspec.backends.cuda import bench_e2e, bench_kernels

    dtype = getattr(torch, args.dtype)
    model_dir = args.model or str(default_model_dir())
    batches = [int(b) for b in args.batches.split(",")]
    rounds = 1 if args.quick else args.rounds
    report = {"device": device_info(), "dtype": args.dtype, "model": model_dir, "argv": argv}
    if "kernels" in sections:
        report["kernels"] = bench_kernels.run_kernel_benchmarks(get_backend("cuda"), dtype, args.quick, args.heads, args.moe_experts)
    if "linear" in sections:
        report["linear"] = bench_kernels.run_linear_benchmarks(
            get_backend("cuda").device, (torch.float32, torch.bfloat16), rows=(1, 4) if args.quick else (1, 4, 8))
    if "decode" in sections:
        report["decode_latency"] = [
            bench_e2e.decode_latency(model_dir, args.dtype, b, args.context, k, args.mtp_mode, rounds, 10 if args.quick else 50)
            for b in batches for k in (0, args.num_speculative_tokens)
        ]
    if "throughput" in sections:
        report["throughput"] = bench_e2e.throughput(
            model_dir, args.dtype, batches, 32 if args.quick else args.new_tokens, args.prompt_tokens,
            args.num_speculative_tokens, args.mtp_mode, rounds,
        )
    if "step_kernels" in sections:
        report["step_kernels"] = [
            bench_e2e.step_kernels(model_dir, args.dtype, 1, args.context, k, mode)
            for k, mode in ((0, args.mtp_mode), (args.num_speculative_tokens, args.mtp_mode))
        ]
    return report


def write_report(report: dict, out: Path) -> tuple[Path, Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out.with_suffix(".json"), out.with_suffix(".png")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, png_path)
    return json_path, png_path


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = 2 * ("kernels" in report) + ("linear" in report) + ("decode_latency" in report) + ("throughput" in report) + ("step_kernels" in report)
    fig, axes = plt.subplots(1, max(1, count), figsize=(6.5 * max(1, count), 4.8))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    title = f"{report['device']['name']}, {report['dtype']}"
    i = 0
    if "kernels" in report:
        for kernel in ("attention", "moe"):
            rows = report["kernels"][kernel]
            ax = axes[i]
            i += 1
            labels = [_kernel_label(r["shape"]) for r in rows]
            ax.bar(range(len(rows)), [r["fraction_of_copy_peak"] for r in rows], color="#4c72b0", label="of measured copy")
            if rows and rows[0]["fraction_of_spec_peak"] is not None:
                ax.plot(range(len(rows)), [r["fraction_of_spec_peak"] for r in rows], "o", color="#c44e52", label="of spec sheet")
            ax.set_xticks(range(len(rows)), labels, rotation=70, ha="right", fontsize=7)
            ax.set_ylim(0, 1.1)
            ax.set_ylabel("achieved bandwidth / peak")
            ax.set_title(f"{kernel} kernel ({title})")
            ax.legend(fontsize=7)
    if "linear" in report:
        rows = report["linear"]
        ax = axes[i]
        i += 1
        x = range(len(rows))
        ax.plot(list(x), [r["cublas_us"] for r in rows], "o", ms=3, label="cuBLAS")
        ax.plot(list(x), [r["skinny_us"] for r in rows], "x", ms=4, label="skinny kernel")
        ax.set_yscale("log")
        ax.set_xticks(list(x), [f"{r['dtype'][:4]} {r['rows']}x{r['k']}x{r['n']}" for r in rows], rotation=90, fontsize=5)
        ax.set_ylabel("us per call (in a CUDA graph)")
        ax.set_title("decode projections: cuBLAS vs skinny")
        ax.legend(fontsize=7)
    if "decode_latency" in report:
        rows = report["decode_latency"]
        ax = axes[i]
        i += 1
        x = range(len(rows))
        ax.bar([v - 0.2 for v in x], [r["eager_ms"] for r in rows], 0.4, label="eager")
        ax.bar([v + 0.2 for v in x], [r["graphs_ms"] for r in rows], 0.4, label="CUDA graphs")
        ax.set_xticks(list(x), [f"bs{r['batch']} K={r['num_speculative_tokens']}" for r in rows], fontsize=8)
        ax.set_ylabel("decode step latency, ms (median)")
        ax.set_title("decode step: eager vs graphs")
        ax.legend(fontsize=8)
    if "throughput" in report:
        rows = report["throughput"]
        ax = axes[i]
        labels = [f"bs{r['batch']} {r['mtp']}{' +graphs' if r['graphs'] else ''}" for r in rows]
        ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color="#55a868")
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("generated tokens/s (median)")
        ax.set_title("greedy generation, MTP on/off")
        i += 1
    if "step_kernels" in report:
        rows = report["step_kernels"]
        ax = axes[i]
        labels = [f"K={r['num_speculative_tokens']}" for r in rows]
        ax.bar([v - 0.2 for v in range(len(rows))], [r["device_ms_per_step"] for r in rows], 0.4, label="kernel time (eager)")
        ax.bar([v + 0.2 for v in range(len(rows))], [r["graph_ms"] for r in rows], 0.4, label="graph replay")
        ax.set_xticks(range(len(rows)), labels)
        ax.set_ylabel("ms per decode step, batch 1")
        ax.set_title("decode step: device time")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kernel_label(shape: dict) -> str:
    if "context" in shape:
        return f"b{shape['batch']} q{shape['q_len']} ctx{shape['context']}"
    return f"T{shape['tokens']} E{shape['experts_hit']}/{shape['experts']}"


if __name__ == "__main__":
    sys.exit(main())
