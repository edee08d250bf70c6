"""How each MTP speculative step accepted: inside the step (greedy targets, or sampled ones) or
on the host, recorded from the plugin's verification (modeling/hidden_cache.py)."""
from __future__ import annotations

from collections import Counter

from mindspec.plugins.mtp.mtp_plugin import MtpPlugin


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
