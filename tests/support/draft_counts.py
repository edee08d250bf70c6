"""Draft counts per verification step: recorded from the suffix plugin and from the MTP plugin's
suffix drafts, or scripted for the MTP plugin in place of its adaptive controller."""
from __future__ import annotations

import numpy as np

from mindspec.plugins.mtp.mtp_plugin import MtpPlugin
from mindspec.plugins.suffix.suffix_plugin import SuffixPlugin


def record_draft_counts(monkeypatch) -> list[list[int]]:
    counts: list[list[int]] = []
    verify = SuffixPlugin.plugin_verify

    def spy(self, batch, inputs, outputs):
        if "suffix_drafts" in inputs.extra:
            counts.append([len(d) for d in inputs.extra["suffix_drafts"]])
        return verify(self, batch, inputs, outputs)

    monkeypatch.setattr(SuffixPlugin, "plugin_verify", spy)
    return counts


class ScriptedSpeculation:
    """Stands in for MTP's adaptive controller: each step's draft counts from a fixed pattern,
    cycled. An entry is one count for every sequence (True: K), or a list of per-sequence counts
    (sequence b gets entry[b % len(entry)]). Prefills plan for ``planned`` drafts (K by default)."""

    def __init__(self, pattern, k, planned=None):
        self.arms = tuple(range(k + 1))  # the plugin's arms in both modes
        self.enabled = True
        self.k, self.i = k, 0
        self.pattern = [k if p is True else p for p in pattern]
        self.log: list[int] = []  # per step: the most drafts a sequence verified
        self.counts: list[list[int]] = []  # per step: each sequence's count
        self.recorded: list[int] = []  # per timed step: its draft count
        self.seconds: list[tuple[int, float]] = []  # per timed step: (its draft count, its time)
        self.plan, self.plan_asked = k if planned is None else planned, []

    def planned(self, batch_size):
        self.plan_asked.append(batch_size)
        return self.plan

    def draft_counts(self, seq_ids, kinds=None):
        entry = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        counts = [int(entry[b % len(entry)]) for b in range(len(seq_ids))] if isinstance(entry, (list, tuple)) \
            else [int(entry)] * len(seq_ids)
        self.log.append(max(counts))
        self.counts.append(counts)
        return np.array(counts, dtype=np.int64)

    def expected(self, seq_ids, kinds, counts):
        """No tokens expected from MTP drafts: a sequence with a suffix proposal verifies it."""
        return np.zeros(len(seq_ids))

    def step_seconds(self, batch_size, k):
        return 0.0  # nothing timed: suffix steps are weighed by tokens alone

    def record(self, seq_ids, counts, accepted):
        """A scripted controller learns nothing from acceptance (``expected`` is zero)."""

    def time_step(self, batch_size, k, seconds):
        if seconds is not None:
            self.recorded.append(k)
            self.seconds.append((k, seconds))

    def finish(self, seq_ids):
        pass


def script_mtp_counts(llm, pattern, k=None) -> ScriptedSpeculation:
    """Replace the MTP plugin's controller of ``llm`` by a scripted one; returns it."""
    plugin = next(p for p in llm.engine.plugin_manager.plugins if p.name == "mtp")
    plugin.adaptive = ScriptedSpeculation(pattern, plugin.k if k is None else k)
    return plugin.adaptive


def record_mtp_steps(monkeypatch, draft_steps: list[int] | None = None) -> list[tuple[list[int], list[int]]]:
    """Per MTP verification step: (drafts each sequence verified, the sequences whose drafts were
    suffix drafts); ``draft_steps`` gets each such step's MTP draft steps (0: suffix drafts alone)."""
    steps: list[tuple[list[int], list[int]]] = []
    verify = MtpPlugin.plugin_verify

    def spy(self, batch, inputs, outputs):
        if "mtp_counts" in inputs.extra and not batch.is_prefill:
            steps.append((inputs.extra["mtp_counts"].tolist(), sorted(inputs.extra.get("host_drafts") or {})))
            if draft_steps is not None:
                draft_steps.append(inputs.extra["mtp_k"])
        return verify(self, batch, inputs, outputs)

    monkeypatch.setattr(MtpPlugin, "plugin_verify", spy)
    return steps
