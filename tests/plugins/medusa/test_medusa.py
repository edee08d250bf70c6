"""The medusa plugin: Medusa-1 heads load in their published layout, their drafts (a static tree)
are verified losslessly, and bad heads or options are one clear error. (Random heads' drafts are
rarely accepted; the shipped model's trained heads are: tests/test_default_model.py.)"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mindspec import LLM, SamplingParams
from mindspec.backend import get_backend
from mindspec.config.plugin_params import PluginParamsError
from mindspec.modeling.loader import checkpoint_keys
from mindspec.modeling.medusa_heads import MedusaHeads, MedusaHeadsError
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config, write_medusa_heads

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=0)
    path = make_self_predicting_checkpoint(tmp_path_factory.mktemp("medusa"), cfg, seed=11, residual_scale=0.005)
    write_medusa_heads(path, cfg, num_heads=3, seed=1)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 30, 8)]
    return cfg, path, prompts


def _llm(path, plugin_params=None, **kw):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=256, progress=False,
               plugin_params=plugin_params, **kw)


def test_heads_file_is_not_a_checkpoint_shard(checkpoint):
    _, path, _ = checkpoint
    assert not any(k.startswith("medusa_head") for k in checkpoint_keys(path))


@pytest.mark.parametrize("own_lm_head, prefix", [(False, "medusa_head."), (True, "")])
def test_head_logits_follow_medusa_1(tmp_path, own_lm_head, prefix):
    cfg = tiny_v3_config()
    write_medusa_heads(tmp_path, cfg, num_heads=2, own_lm_head=own_lm_head, prefix=prefix)
    from safetensors.torch import load_file

    raw = {k.removeprefix("medusa_head."): v for k, v in load_file(str(tmp_path / "medusa_lm_head.safetensors")).items()}
    backend = get_backend("cpu")
    shared = torch.randn(cfg.vocab_size, cfg.hidden_size)
    heads = MedusaHeads.load(tmp_path, backend, torch.float32, cfg.hidden_size, cfg.vocab_size,
                             backend.linear_weight(shared))
    x = torch.randn(3, cfg.hidden_size)
    got = heads.logits(x, 2)
    for i in range(2):
        y = x + F.silu(x @ raw[f"{i}.0.linear.weight"].T + raw[f"{i}.0.linear.bias"])
        head = raw[f"{i}.1.weight"] if own_lm_head else shared
        torch.testing.assert_close(got[:, i], y @ head.T, rtol=1e-4, atol=1e-4)


def test_bad_heads_are_one_clear_error(tmp_path):
    cfg = tiny_v3_config()
    backend = get_backend("cpu")
    shared = backend.linear_weight(torch.randn(cfg.vocab_size, cfg.hidden_size))

    def load():
        return MedusaHeads.load(tmp_path, backend, torch.float32, cfg.hidden_size, cfg.vocab_size, shared)

    with pytest.raises(MedusaHeadsError, match="no medusa_lm_head.safetensors"):
        load()
    save_file({"0.0.linear.weight": torch.zeros(3, 3), "0.0.linear.bias": torch.zeros(3)},
              str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(MedusaHeadsError, match=r"head 0 block 0 needs linear.weight \["):
        load()
    save_file({"heads.0.weight": torch.zeros(3)}, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(MedusaHeadsError, match="unexpected tensor 'heads.0.weight'"):
        load()
    h = cfg.hidden_size
    save_file({"1.0.linear.weight": torch.zeros(h, h), "1.0.linear.bias": torch.zeros(h)},
              str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(MedusaHeadsError, match=r"numbered 0..n-1, found \[1\]"):
        load()


def test_medusa_greedy_and_seeded_equal_no_speculation(checkpoint):
    _, path, prompts = checkpoint
    plain = _llm(path)
    medusa = _llm(path, {"plugin_type": "medusa", "tree_choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]})
    outs = medusa.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(len(prompts))]
    assert [o.token_ids for o in medusa.generate(prompts, seeded)] == \
        [o.token_ids for o in plain.generate(prompts, seeded)]
    bm = medusa.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not medusa.engine.plugin_manager.plugins[0].hidden


def test_medusa_typical_acceptance_runs(checkpoint):
    _, path, prompts = checkpoint
    llm = _llm(path, {"plugin_type": "medusa", "decoding_policy": "typical"})
    outs = llm.generate(prompts, SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)


@pytest.mark.parametrize("options, message", [
    ({"num_speculative_tokens": 4}, r"num_speculative_tokens must be in 1..3"),
    ({"tree_choices": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}, "4 deep but 3 Medusa head"),
    ({"tree_choices": [[1, 0]]}, r"needs its parent \[1\]"),
    ({"decoding_policy": "relaxed"}, "must be one of strict, typical"),
    ({"posterior_alpha": 2}, r"posterior_alpha must be a number in \[0, 1\]"),
    ({"mtp_mode": "eagle"}, "mtp_mode is not a medusa option"),
])
def test_bad_medusa_options_name_the_problem(checkpoint, options, message):
    _, path, _ = checkpoint
    with pytest.raises(PluginParamsError, match=message):
        _llm(path, {"plugin_type": "medusa", **options})


def test_medusa_without_heads_says_so(tmp_path):
    cfg = tiny_v3_config(num_nextn_predict_layers=0)
    make_self_predicting_checkpoint(tmp_path, cfg, seed=1)
    with pytest.raises(PluginParamsError, match="needs Medusa heads: no medusa_lm_head.safetensors"):
        _llm(tmp_path, {"plugin_type": "medusa"})


def test_medusa_under_async_scheduling_is_lossless(checkpoint):
    _, path, prompts = checkpoint
    llm = _llm(path, {"plugin_type": "medusa"}, async_scheduling=True)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in _llm(path).generate(prompts, GREEDY)]
    assert llm.engine.async_stepper.stats.ahead_steps > 0


def test_medusa_verification_through_the_graph_runner_is_lossless(checkpoint):
    """The verification forward padded to buckets with its tree mask in a static buffer (what a
    captured graph or a compiled package replays), run eagerly over the buffers here."""
    from mindspec.modeling.graph_runner import DecodeGraphRunner

    _, path, prompts = checkpoint
    expected = [o.token_ids for o in _llm(path).generate(prompts, GREEDY)]
    llm = _llm(path, {"plugin_type": "medusa"})
    wrapper = llm.engine.model_wrapper
    runner = wrapper.graph_runner = DecodeGraphRunner(wrapper, buckets=(1, 2, 4, 8), capture=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts[:2]] == expected[:2]
    from mindspec.plugins.medusa.medusa_plugin import DEFAULT_TREE

    rows = 1 + sum(len(c) <= 3 for c in DEFAULT_TREE)  # the root and the default tree's nodes for 3 heads
    trees = [k for k in runner.shape_keys if k[-1] == "tree"]
    assert {k[1] for k in trees} >= {1, 8} and all(k[2] == rows for k in trees)


def test_medusa_on_a_pd_decode_node_matches_one_engine(checkpoint):
    """Sequences prefilled on another node arrive without a hidden state: their first drafts
    come from zeros and are verified like any others."""
    _, path, prompts = checkpoint
    expected = [o.token_ids for o in _llm(path).generate(prompts, GREEDY)]
    prefill_node = _llm(path)
    decode_node = _llm(path, {"plugin_type": "medusa"})
    handoffs = [prefill_node.engine.prefill_for_handoff(p, GREEDY) for p in prompts]
    states = [decode_node.engine.add_prefilled_request(h, GREEDY) for h in handoffs]
    outs = decode_node.engine.run(states)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_decode.num_steps for o in outs) > 0
    assert not decode_node.engine.plugin_manager.plugins[0].hidden
