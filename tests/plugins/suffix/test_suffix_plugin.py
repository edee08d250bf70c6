"""Suffix drafting (``plugin_type: suffix``): token for token the output of decoding without
drafts (greedy, and seeded sampling with penalties) on the shipped model, whose code continuations
repeat enough for drafts to be accepted and rejected, with sequences of one step verifying
different numbers of drafts; on a checkpoint without MTP modules; and clear errors for what it
does not support yet."""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.config.plugin_params import PluginParamsError
from tests.support.checkpoints import make_checkpoint, tiny_v3_config
from tests.support.draft_counts import record_draft_counts

SUFFIX = {"plugin_type": "suffix", "num_speculative_tokens": 5, "min_match": 2}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.7, top_p=0.9, seed=7, repetition_penalty=1.1, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=0)
    return make_checkpoint(tmp_path_factory.mktemp("no_mtp"), cfg, seed=5)


PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(",
    "import os\nimport sys\nimport re\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "x = 1\n",
    "    if not data:\n        return None\n    if not",
]


def _shipped(plugin_params=None, **kw):
    return LLM(dtype="float32", progress=False, plugin_params=plugin_params, cpu_threads=1, **kw)


def _llm(path, plugin_params=None, **kw):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=512, progress=False,
               plugin_params=plugin_params, **kw)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-sampling"])
def test_suffix_drafting_gives_the_tokens_of_decoding_without_drafts(params, monkeypatch):
    counts = record_draft_counts(monkeypatch)
    expected = [o.token_ids for o in _shipped({}).generate(PROMPTS, params)]
    outs = _shipped(SUFFIX).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    stats = [o.spec_decode for o in outs if o.spec_decode is not None]
    assert sum(s.num_draft_tokens for s in stats) > 0 and sum(s.num_accepted_tokens for s in stats) > 0
    assert any(s.num_accepted_tokens < s.num_draft_tokens for s in stats)  # rejections too
    assert any(len(set(c)) > 1 and 0 in c for c in counts)  # one step, unequal draft counts, some none


def test_a_checkpoint_without_mtp_modules_one_request_at_a_time(checkpoint):
    llm, plain = _llm(checkpoint, SUFFIX), _llm(checkpoint)
    rng = np.random.default_rng(0)
    for n in (3, 9, 20):
        span = rng.integers(2, 60, n).tolist()
        prompt = span + [5, 6] + span  # the prompt repeats: drafts whenever the output follows it
        assert llm.generate([prompt], GREEDY)[0].token_ids == plain.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize("options,key", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 16}, "num_speculative_tokens"),
    ({"min_match": "2"}, "min_match"),
    ({"decoding_policy": "typical"}, "decoding_policy"),
    ({"mtp_mode": "eagle"}, "mtp_mode"),
])
def test_bad_options_are_one_error_naming_the_key(checkpoint, options, key):
    with pytest.raises(PluginParamsError, match=f"plugin_params.{key}"):
        _llm(checkpoint, {"plugin_type": "suffix", **options})
