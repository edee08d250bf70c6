"""The PNG of a ``mindspec bench`` report: speed-up per configuration and batch size, acceptance
per draft position, and the decode-step profile."""
from __future__ import annotations

from pathlib import Path


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(report["results"])
    profiles = report.get("profile") or {}
    per_request = [b for b in batches if b == "batch 1" and any("speedup_per_group" in r for n, r in report["results"][b].items()
                                                                if n != "mtp off")]
    panels = len(batches) + 1 + (1 if profiles else 0) + len(per_request)
    cols = min(3, panels)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.8 * rows), squeeze=False)
    axes = axes.ravel()
    batching = report.get("batching", "static")  # reports from before the option were static
    for ax, batch in zip(axes, batches):
        _speedups(ax, batch, report["results"][batch], batching, _where(report))
    _acceptance(axes[len(batches)], batches[0], report["results"][batches[0]])
    if profiles:
        _profile(axes[len(batches) + 1], profiles)
    for ax, batch in zip(axes[len(batches) + 1 + (1 if profiles else 0):], per_request):
        _per_request(ax, batch, report["results"][batch], report.get("workload", "continue"))
    for ax in axes[panels:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _where(report: dict) -> str:
    """How the tokens were chosen, then 'cpu' or the backend and its device ('greedy, cuda,
    NVIDIA H100 80GB HBM3')."""
    backend = report.get("backend", "cpu")
    where = backend if backend == "cpu" else f"{backend}, {report.get('device', '?')}"
    s = report.get("sampling")
    how = "greedy" if not s else f"sampled (T={s['temperature']:g}, top-p {s['top_p']:g}, top-k {s['top_k']}, seeded)"
    return f"{how}, {where}"


def _speedups(ax, batch: str, rows: dict, batching: str, where: str) -> None:
    names = list(rows)
    values = [rows[n]["speedup_vs_mtp_off"] for n in names]
    colors = ["#c44e52" if n == "transformers generate" else "#dd8452" if n == "llama.cpp" else
              "#55a868" if "compile" in n else "#4c72b0" for n in names]
    ax.bar(range(len(names)), values, color=colors)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=65, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s relative to MTP off (median)")
    ax.set_title(f"{batch} ({batching} batching): {where}", fontsize=10)


def _per_request(ax, batch: str, rows: dict, workload: str) -> None:
    """Each request's speed-up over MTP off (a dot per request), with its box: speculation must
    pay per request, not only on average."""
    names = [n for n, r in rows.items() if "speedup_per_group" in r and n != "mtp off"]
    values = [rows[n]["speedup_per_group"]["values"] for n in names]
    ax.boxplot(values, positions=range(len(names)), widths=0.5, showfliers=False)
    for i, v in enumerate(values):
        ax.scatter([i] * len(v), v, s=10, alpha=0.6, color="#4c72b0", zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=65, ha="right", fontsize=7)
    ax.set_ylabel("speed-up over MTP off, per request")
    ax.set_title(f"{batch}, {workload} workload: per request", fontsize=10)


def _acceptance(ax, batch: str, rows: dict) -> None:
    for name, row in rows.items():
        acc = row.get("acceptance_per_position")
        if acc and "relaxed" not in name and "compile" not in name:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance per draft position ({batch})", fontsize=10)
    ax.legend(fontsize=7)


def _profile(ax, profiles: dict) -> None:
    """Stacked ms per decode step: model forward and the host stages."""
    names = list(profiles)
    stage_names: list[str] = []
    for p in profiles.values():
        for stage, value in p["ms_per_decode_step"].items():
            if value and stage not in ("step total",) and not stage.startswith("model:") and stage not in stage_names:
                stage_names.append(stage)
    bottom = [0.0] * len(names)
    for stage in stage_names:
        vals = [max(0.0, profiles[n]["ms_per_decode_step"].get(stage) or 0.0) for n in names]
        ax.bar(range(len(names)), vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("ms per decode step (eager)")
    ax.set_title("where a decode step's time goes", fontsize=10)
    ax.legend(fontsize=6)
