"""Records, per verification step of the suffix plugin, how many drafts each sequence verified."""
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
