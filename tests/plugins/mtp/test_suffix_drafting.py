"""MTP with suffix drafts (``"plugin_type": "mtp,suffix"``): per sequence and step, the suffix
drafts (up to suffix_max_drafts, more than K) or the MTP drafts are verified, in one forward with
the other sequences' MTP drafts; token for token the output of MTP off (greedy and seeded
sampling), Vanilla and Eagle; the policies that read probabilities work on suffix rows; the
suffix estimate learns from proposals it did not verify; clear errors for what is not supported."""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.config.plugin_params import PluginParamsError, parse_plugin_params
from mindspec.plugins.mtp.mtp_plugin import CATCH_UP, MtpPlugin
from mindspec.plugins.suffix.sequence_drafts import SuffixDrafts
from tests.support.draft_counts import record_mtp_steps, script_mtp_counts

K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.7, top_p=0.9, seed=7, repetition_penalty=1.1, max_tokens=48, ignore_eos=True)
BODY = "def area(w, h):\n    return w * h\n\n\ndef volume(w, h, d):\n    return area(w, h) * d\n"
PROMPTS = [
    BODY + "\n\n# again\n" + BODY[:30],  # the output copies the prompt: long suffix drafts
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
    "import os\n",  # little to repeat: MTP drafts
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]


def _llm(plugin_params=None, **kw):
    return LLM(dtype="float32", progress=False, plugin_params=plugin_params, cpu_threads=1, **kw)


def _mtp_suffix(mode="vanilla", **extra):
    return {"plugin_type": "mtp,suffix", "num_speculative_tokens": K, "mtp_mode": mode, "suffix_min_match": 2, **extra}


@pytest.fixture(scope="module")
def mtp_off():
    llm = _llm({})
    return {name: [o.token_ids for o in llm.generate(PROMPTS, p)] for name, p in (("greedy", GREEDY), ("seeded", SEEDED))}


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
@pytest.mark.parametrize("name,params", [("greedy", GREEDY), ("seeded", SEEDED)], ids=["greedy", "seeded-sampling"])
def test_mtp_with_suffix_drafts_gives_the_tokens_of_mtp_off(mtp_off, mode, name, params, monkeypatch):
    steps = record_mtp_steps(monkeypatch)
    llm = _llm(_mtp_suffix(mode))
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == mtp_off[name]
    suffix_steps = [(counts, host) for counts, host in steps if host]
    assert suffix_steps, "no step verified suffix drafts"
    if name == "greedy":  # the copying prompt's suffix drafts outnumber K
        assert any(counts[b] > K for counts, host in suffix_steps for b in host)


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_suffix_and_mtp_drafts_of_unequal_counts_in_one_step(mtp_off, mode, monkeypatch):
    """The controller scripted (MTP counts 0..K per sequence; suffix drafts whenever proposed):
    steps where some sequences verify suffix drafts and others 0..K MTP drafts."""
    steps = record_mtp_steps(monkeypatch)
    llm = _llm(_mtp_suffix(mode, suffix_min_match=1))
    script_mtp_counts(llm, [[3, 0, 1, 2], [1, 2, 0, 3], True, [0]])
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == mtp_off["greedy"]
    mixed = [(c, h) for c, h in steps if h and any(c[b] > 0 for b in range(len(c)) if b not in h)]
    assert mixed, steps
    assert any(0 in [c[b] for b in range(len(c)) if b not in h] for c, h in mixed)  # an MTP sequence verifying none


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_suffix_drafts_alone_run_no_draft_step_and_module_0_catches_up_after(mode, monkeypatch):
    """At batch 1 a step that verifies suffix drafts runs no MTP draft step while module 0 may
    fall behind by it (at most CATCH_UP entries); a later step with a draft step writes every
    missed entry (its window is the lag). Token for token MTP off."""
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    expected = _llm({}).generate(PROMPTS[:1], params)[0].token_ids
    draft_steps, log = [], []
    record_mtp_steps(monkeypatch, draft_steps)
    update = MtpPlugin.plugin_cache_update

    def spy(self, batch, inputs, outputs):
        lag = self.states[batch.seqs[0].seq_id].lag[0] if not batch.is_prefill else None
        layout = inputs.extra.get("mtp_layout") if inputs.extra.get("mtp_k") else None
        update(self, batch, inputs, outputs)
        if lag is not None:
            log.append((lag, inputs.extra.get("mtp_k"), None if layout is None else int(layout.last_accepted[0]),
                        int(self.states[batch.seqs[0].seq_id].lag[0])))

    monkeypatch.setattr(MtpPlugin, "plugin_cache_update", spy)
    assert _llm(_mtp_suffix(mode)).generate(PROMPTS[:1], params)[0].token_ids == expected
    assert 0 in draft_steps and max(draft_steps) > 0
    assert max(after for *_, after in log) <= CATCH_UP
    caught_up = [(lag, window) for lag, k, window, _ in log if k and lag > K + 1]
    assert caught_up and all(window >= lag for lag, window in caught_up)


def test_relaxed_outside_its_span_is_strict_on_suffix_rows(mtp_off, monkeypatch):
    """Relaxed acceptance reads the target probabilities on the verification grid, which suffix
    drafts widen past K + 1; outside the thinking span it is strict, so still lossless."""
    steps = record_mtp_steps(monkeypatch)
    llm = _llm(_mtp_suffix(decoding_policy="relaxed", relaxed_topk=3, relaxed_delta=0.3,
                           think_start_token_id=1, think_end_token_id=2))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == mtp_off["greedy"]
    assert any(host for _, host in steps)


def test_typical_acceptance_verifies_suffix_drafts(monkeypatch):
    steps = record_mtp_steps(monkeypatch)
    llm = _llm(_mtp_suffix(decoding_policy="typical"))
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert any(counts[b] > K for counts, host in steps for b in host)
    assert sum(o.spec_decode.num_accepted_tokens for o in outs) > 0


def test_suffix_estimate_follows_the_sequence_proposals_included():
    drafts = SuffixDrafts(max_drafts=8, min_match=2)
    assert drafts.useful(1, list(range(8)), row_yield=0.2) == 4  # the prior: 0.7 ** 4 >= 0.2 > 0.7 ** 5
    for _ in range(8):  # proposals that miss at once (scored against the emitted tokens)
        drafts.record(1, verified=4, accepted=0)
    assert drafts.useful(1, list(range(8)), row_yield=0.2) == 0
    for _ in range(10):  # a sequence whose repeats hold
        drafts.record(2, verified=8, accepted=8)
    assert drafts.useful(2, list(range(8)), row_yield=0.2) == 8
    assert drafts.expected(2, 8) > drafts.expected(2, 3) > drafts.expected(1, 3)
    drafts.clear([1, 2])
    assert drafts.sequences == {}


def test_mtp_suffix_options():
    parsed = parse_plugin_params({"plugin_type": "mtp,suffix", "num_speculative_tokens": 2})
    assert parsed.plugin_types == ("mtp",) and parsed.options["suffix_drafting"] is True
    with pytest.raises(PluginParamsError, match="plugin_params.suffix_drafting"):
        parse_plugin_params({"plugin_type": "mtp,suffix", "num_speculative_tokens": 2, "suffix_drafting": False})


@pytest.mark.parametrize("options,key", [
    ({"suffix_max_drafts": 0}, "suffix_max_drafts"),
    ({"suffix_max_drafts": 16}, "suffix_max_drafts"),
    ({"suffix_min_match": "2"}, "suffix_min_match"),
    ({"suffix_drafting": "yes"}, "suffix_drafting"),
    ({"simulated_acceptance": [0.9, 0.8, 0.7]}, "simulated_acceptance"),
])
def test_bad_suffix_options_are_one_error_naming_the_key(options, key):
    with pytest.raises(PluginParamsError, match=f"plugin_params.{key}"):
        _llm({"plugin_type": "mtp", "num_speculative_tokens": K, "suffix_drafting": True, **options})


def test_host_drafts_sit_in_the_inputs_and_the_graph_runner_leaves_them_eager():
    """Suffix drafts are written into their rows on the host; the graph runner takes no
    verification that carries them (its captured step places MTP drafts only), and still takes
    one with MTP drafts alone."""
    from mindspec.modeling.graph_runner import DecodeGraphRunner
    from mindspec.plugins.mtp import decode_inputs as di

    tables = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    plain = di.main_inputs(np.array([3, 4]), np.array([5, 6]), tables, 4, np.array([2, 1]))
    hosted = di.main_inputs(np.array([3, 4]), np.array([5, 6]), tables, 4, np.array([2, 5]), {1: [7, 8, 9, 10, 11]})
    assert plain.drafts_in_inputs is None and hosted.drafts_in_inputs.tolist() == [False, True]
    assert hosted.input_ids.tolist() == [3, 0, 0, 4, 7, 8, 9, 10, 11]  # MTP rows are filled in the model
    assert hosted.q_lens.tolist() == [3, 6] and hosted.seq_lens.tolist() == [7, 11]
    runner = DecodeGraphRunner(_llm({}).engine.model_wrapper, buckets=(2,), capture=False)
    assert runner.accepts(plain) and not runner.accepts(hosted)


def test_a_step_with_suffix_drafts_times_the_mtp_arm_it_ran():
    """What the MTP controller records after a step: suffix rows are no MTP acceptance; the
    step's time counts for its MTP arm when MTP drafts set how far it drafted, not when only
    suffix drafts made it draft (a plain step's arm is not a step with a draft stage)."""
    from types import SimpleNamespace

    plugin = _llm(_mtp_suffix()).engine.plugin_manager.plugins[0]
    batch = SimpleNamespace(seqs=[SimpleNamespace(seq_id=1), SimpleNamespace(seq_id=2)])
    outputs = SimpleNamespace(accepted=[[1, 2, 3], [5, 6, 7, 8, 9, 4]], num_draft_accepted=[2, 5])
    extra = {"host_drafts": {1: [5, 6, 7, 8, 9]}, "suffix_proposals": {1: [5, 6, 7, 8, 9]},
             "mtp_k": 2}
    before = plugin.suffix.expected(2, 5)
    drafted, accepted, timed = plugin._suffix_step_done(batch, SimpleNamespace(extra=extra), outputs,
                                                        np.array([2, 5]), np.array([2, 5]))
    assert drafted.tolist() == [2, 0] and accepted.tolist() == [2, 0] and timed
    assert plugin.suffix.expected(2, 5) > before  # all five kept
    extra["mtp_k"] = 1  # sequence 0 verified no MTP draft: the suffix drafts alone made the step draft
    _, _, timed = plugin._suffix_step_done(batch, SimpleNamespace(extra=extra), outputs,
                                           np.array([0, 5]), np.array([0, 5]))
    assert not timed


def test_plain_steps_score_the_suffix_proposals_they_did_not_verify(monkeypatch):
    """A decode step without drafts (a plain step's own short path after the forward) still
    scores each sequence's suffix proposal against the token it emitted, so a sequence whose
    text starts repeating is seen to while no drafts pay."""
    llm = _llm(_mtp_suffix())
    script_mtp_counts(llm, [0])
    monkeypatch.setattr(SuffixDrafts, "useful", lambda self, seq_id, drafts, row_yield: 0)  # never verified
    scored = []
    monkeypatch.setattr(SuffixDrafts, "record", lambda self, seq_id, verified, accepted: scored.append((verified, accepted)))
    out = llm.generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert len(out) == GREEDY.max_tokens
    assert scored and all(v == 1 for v, _ in scored)  # one emitted token judges one draft each
    assert any(a == 1 for _, a in scored)  # the output copies the prompt: proposals that hold
