"""Launches inside a captured cuda decode step, counted on CPU under Triton's interpreter: MTP off
and K=3 (vanilla, eagle) on the shipped model at batch 1 (tests/support/step_launches.py).

At batch 1 a small model's step on a GPU is mostly kernels that each cost ~1-2 us whatever they
compute, so a step's device time follows its launch count; this counts them where no GPU is.

    python scripts/step_launches.py [--dtype float16] [--out benchmarks/out]

Writes OUT/step_launches.json and .png: per configuration the launches of its steady step, those
inside the decoder layers and beside them, and by kernel or op.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support

from _pytest.monkeypatch import MonkeyPatch  # noqa: E402

from mindspec import LLM, SamplingParams  # noqa: E402
from mindspec.config.defaults import default_model_dir  # noqa: E402
from tests.support.step_launches import LaunchCensus  # noqa: E402

CONFIGS = {
    "mtp off": None,
    "vanilla K=3": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla", "adaptive_speculation": False},
    "eagle K=3": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle", "adaptive_speculation": False},
}


def count(name: str, dtype: str) -> dict:
    census, patch = LaunchCensus(), MonkeyPatch()
    try:
        with census.installed(patch):
            llm = LLM(model=str(default_model_dir()), backend="cuda", device="cpu", dtype=dtype, progress=False,
                      plugin_params=CONFIGS[name], max_batch_size=1)
            llm.generate([list(range(5, 40))], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    finally:
        patch.undo()
    step = census.last("decode" if CONFIGS[name] is None else "speculative")
    return {"config": name, "launches": step.total, "in_layers": step.in_layers, "outside_layers": step.outside_layers,
            "by_name": dict(step.by_name.most_common())}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    names = [r["config"] for r in rows]
    ax.bar(names, [r["in_layers"] for r in rows], label="in decoder layers", color="#4c72b0")
    ax.bar(names, [r["outside_layers"] for r in rows], bottom=[r["in_layers"] for r in rows], label="beside them",
           color="#dd8452")
    ax.set_ylabel("launches per captured step")
    ax.set_title("cuda decode step, shipped model, batch 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16", help="float16 or float32 (the interpreter gets bfloat16 wrong)")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    rows = [count(name, args.dtype) for name in CONFIGS]
    for r in rows:
        print(f"{r['config']:12s} {r['launches']:4d} launches ({r['in_layers']} in the decoder layers, "
              f"{r['outside_layers']} beside them)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_launches.json").write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=2))
    plot(rows, out / "step_launches.png")


if __name__ == "__main__":
    main()
