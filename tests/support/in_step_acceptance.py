"""How each MTP speculative step accepted: inside the step (greedy targets, or sampled ones) or
on the host, recorded from the plugin's verification (modeling/hidden_cache.py); and where plain
decode steps sampled their tokens."""
from __future__ import annotations

from collections import Counter

from mindspec.plugins.mtp.mtp_plugin import MtpPlugin
from mindspec.text_generator.plugin_manager import PluginManager


def record_acceptance(monkeypatch) -> Counter:
    """Counts of speculative steps by how they accepted: "greedy" and "sampled" inside the step,
    "undecided" (a sampled step that could not decide its targets: the host accepted it) and
    "host" (a step with no rows to keep)."""
    seen: Counter = Counter()
    verify = MtpPlugin.plugin_verify

    def spy(self, batch, inputs, outputs):
        cache = inputs.extra.get("hidden_cache")
        if cache is not None and not batch.is_prefill:
            if not cache.accepts_in_step:
                seen["host"] += 1
            elif cache.targets is None:
                seen["greedy"] += 1
            else:
                seen["sampled" if (outputs.accepted_host() >= 0).all() else "undecided"] += 1
        return verify(self, batch, inputs, outputs)

    monkeypatch.setattr(MtpPlugin, "plugin_verify", spy)
    return seen


def record_plain_sampling(monkeypatch) -> Counter:
    """Counts of plain decode steps with sampled rows by where their tokens were sampled:
    "in_step" (sampling/step_targets.py), "undecided" (the step could not: the host sampled)
    or "host" (the step was given no target rows)."""
    seen: Counter = Counter()
    sample = PluginManager.sample

    def spy(self, batch, inputs, outputs):
        sample(self, batch, inputs, outputs)
        plain = not batch.is_prefill and inputs.sub_model_inputs is None and "mtp_counts" not in inputs.extra
        if plain and not all(s.sampling_params.plain_greedy for s in batch.seqs):
            if "targets" not in inputs.extra:
                seen["host"] += 1
            else:
                seen["in_step" if (outputs.greedy_host() >= 0).all() else "undecided"] += 1

    monkeypatch.setattr(PluginManager, "sample", spy)
    return seen
