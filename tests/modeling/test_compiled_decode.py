"""torch.compile of the decode step's one-row blocks (``decodeGraphs`` on the cpu backend): the
same greedy tokens as eager decoding, MTP off and MTP Eagle (whose draft steps after the first run
one row per sequence), one compiled graph shared by the blocks of a kind, and a compile failure
that falls back to eager instead of failing."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.modeling.compiled_decode import CompiledDecode, decoder_blocks
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
EAGLE = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "eagle", "adaptive_speculation": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_hidden_layers=3, num_nextn_predict_layers=1)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("compiled"), cfg, seed=3, residual_scale=0.005)


def _llm(path, plugin_params=None, **kw):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=256, progress=False,
               plugin_params=plugin_params, **kw)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(2, 60, int(n)).tolist() for n in (5, 11, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("plugin_params", [None, EAGLE], ids=["mtp-off", "eagle-k2"])
def test_compiled_blocks_give_the_eager_tokens(checkpoint, plugin_params):
    prompts = _prompts()
    eager = _llm(checkpoint, plugin_params, decode_graphs=False)
    assert eager.engine.model_wrapper.compiled is None
    expected = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    compiled_llm = _llm(checkpoint, plugin_params, decode_graphs=True)  # compiles at warm-up
    compiled = compiled_llm.engine.model_wrapper.compiled
    assert compiled is not None
    before = compiled.compiled_calls
    outs = [compiled_llm.generate([p], GREEDY)[0] for p in prompts]  # one sequence: one-row blocks
    assert [o.token_ids for o in outs] == expected
    assert compiled.enabled, "the compiled step fell back to eager"
    assert compiled.compiled_calls > before, "no block ran compiled"
    if plugin_params:
        assert sum(o.spec_decode.num_accepted_tokens for o in outs) > 0
    for block in decoder_blocks(compiled_llm.engine.model_wrapper.model):
        assert block.compiled_forward is None, "compiled blocks leaked out of the decode call"


@pytest.mark.slow
def test_blocks_share_one_graph_per_kind(checkpoint):
    """Regional compilation: the MoE layers (and the MTP block) reuse one graph, so the number of
    graphs does not grow with the number of layers (here 1 dense + 2 MoE main layers + 1 MTP)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    llm = _llm(checkpoint, EAGLE, decode_graphs=True)
    llm.generate([_prompts()[0]], GREEDY)
    # dense first layer, MoE layers with a residual, MTP block without: at most one graph each
    assert 1 <= counters["stats"]["unique_graphs"] <= 3


def test_a_failing_compile_falls_back_to_eager(checkpoint, caplog):
    llm = _llm(checkpoint, EAGLE)
    wrapper = llm.engine.model_wrapper
    compiled = CompiledDecode(wrapper.model)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    compiled.compiled_block = broken
    wrapper.compiled = compiled
    expected = [o.token_ids for o in _llm(checkpoint, EAGLE).generate([[5, 6, 7]], GREEDY)]
    assert [o.token_ids for o in llm.generate([[5, 6, 7]], GREEDY)] == expected
    assert not compiled.enabled
    assert "running it eagerly" in caplog.text
    assert all(block.compiled_forward is None for block in decoder_blocks(wrapper.model))
