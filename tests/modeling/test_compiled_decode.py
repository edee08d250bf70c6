"""torch.compile of the decode step (``decodeGraphs`` on the cpu backend): the same greedy tokens
as eager decoding with MTP on, and a compile failure falls back to eager instead of failing."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.modeling.compiled_decode import CompiledDecode
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Speculation on every step and two sequences per batch: one compiled graph (draft + verify for
# batches of more than one sequence) serves the whole run, so the test compiles only once.
MTP = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "eagle", "adaptive_speculation": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_hidden_layers=2, num_nextn_predict_layers=1)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("compiled"), cfg, seed=3, residual_scale=0.005)


def _llm(path, **kw):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=256, progress=False,
               plugin_params=MTP, **kw)


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_tokens(checkpoint):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 60, int(n)).tolist() for n in (5, 11, 3, 8)]
    eager = _llm(checkpoint, decode_graphs=False)
    assert eager.engine.model_wrapper.compiled is None
    expected = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    compiled = _llm(checkpoint, decode_graphs=True)  # compiles at warm-up (batch 1 and 2)
    wrapper = compiled.engine.model_wrapper
    assert wrapper.compiled is not None
    outs = []
    for i in range(0, len(prompts), 2):  # batches of two: a graph compiled at warm-up
        outs += compiled.generate(prompts[i:i + 2], GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert wrapper.compiled.enabled, "the compiled step fell back to eager"
    assert sum(o.spec_decode.num_accepted_tokens for o in outs) > 0


def test_a_failing_compile_falls_back_to_eager(checkpoint, monkeypatch, caplog):
    llm = _llm(checkpoint)
    wrapper = llm.engine.model_wrapper
    compiled = CompiledDecode(wrapper.model)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    compiled._forward_speculative = broken
    wrapper.compiled = compiled
    expected = [o.token_ids for o in _llm(checkpoint).generate([[5, 6, 7]], GREEDY)]
    assert [o.token_ids for o in llm.generate([[5, 6, 7]], GREEDY)] == expected
    assert not compiled.enabled
    assert "running it eagerly" in caplog.text
