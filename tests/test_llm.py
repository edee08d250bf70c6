"""LLM.generate end to end: greedy output equals transformers' greedy generate, token for token."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from tests.support.checkpoints import load_hf_model, make_checkpoint, tiny_v2_config, tiny_v3_config

NEW_TOKENS = 48
PROMPT_LENS = [3, 17, 8, 1, 25, 12, 5, 30]


@pytest.fixture(scope="module", params=["v3", "v2"])
def case(request, tmp_path_factory):
    # A wider init than HF's 0.02 gives peaked logits, so no greedy step is a near-tie that
    # float32 rounding could flip (checked below).
    make_cfg = tiny_v3_config if request.param == "v3" else tiny_v2_config
    cfg = make_cfg(initializer_range=0.2)
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), cfg, seed=11)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
    hf = load_hf_model(path)
    expected = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,  # ignore_eos
            pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )
        expected.append(out.sequences[0, len(p):].tolist())
        top2 = torch.stack(out.scores)[:, 0].topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, "a near-tie would make the comparison meaningless"
    return path, prompts, expected


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _llm(path, **kw):
    kw.setdefault("num_blocks", 128)
    return LLM(model=str(path), dtype="float32", cache_block_size=4, progress=False, **kw)


def test_batch_and_alone_equal_transformers(case):
    path, prompts, expected = case
    llm = _llm(path)
    together = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == expected
    assert all(o.finish_reason == "length" and o.finished for o in together)
    for prompt, exp in zip(prompts, expected):
        assert llm.generate([prompt], GREEDY)[0].token_ids == exp
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_small_block_budget_waits_and_preempts_without_changing_output(case):
    path, prompts, expected = case
    # 8 sequences of up to 30 + 48 tokens need ~160 blocks of 4; 40 forces waiting and preemption.
    llm = _llm(path, num_blocks=40)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_preemptions for o in outs) > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_batch_limits_do_not_change_output(case):
    path, prompts, expected = case
    llm = _llm(path, max_batch_size=3, max_prefill_batch_size=2, max_prefill_tokens=20)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_llm_from_mindie_config_json(case, tmp_path):
    import json

    path, prompts, expected = case
    config = {
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 256, "maxInputTokenLen": 64,
                                  "ModelConfig": [{"modelWeightPath": str(path), "backendType": "cpu", "dtype": "float32"}]},
            "ScheduleConfig": {"cacheBlockSize": 4, "numBlocks": 40, "maxBatchSize": 4, "maxPrefillTokens": 64},
        }
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(config=tmp_path / "config.json", progress=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_keywords_apply_to_the_shipped_default_model():
    llm = LLM(progress=False, num_blocks=40, max_batch_size=3, async_scheduling=True,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 1})
    engine = llm.engine
    assert engine.block_manager.num_blocks == 40
    assert engine.scheduler.config.max_batch_size == 3
    assert engine.async_stepper is not None
    assert engine.plugin_manager.plugins[0].k == 1
    with pytest.raises(TypeError, match="max_batch"):
        LLM(progress=False, max_batch=3)


# ---- keywords given with the shipped model or a config apply; None keeps the model's default ---------


def test_backend_keyword_is_not_ignored_for_the_shipped_model():
    from mindspec.backend import BackendError

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed; the error path needs a machine without it")
    with pytest.raises(BackendError, match="torch_npu"):
        LLM(backend="npu", progress=False)


def test_dtype_and_block_size_apply_to_the_shipped_model():
    llm = LLM(dtype="bfloat16", cache_block_size=8, num_blocks=24, progress=False)
    assert llm.engine.model_wrapper.dtype == torch.bfloat16
    assert llm.engine.args.cache_block_size == 8 and llm.engine.block_manager.num_blocks == 24
    default = LLM(num_blocks=24, progress=False)  # None keeps the shipped config's float32, 16
    assert default.engine.model_wrapper.dtype == torch.float32 and default.engine.args.cache_block_size == 16


def test_keywords_apply_with_a_config(tmp_path):
    import json

    from mindspec.config.defaults import DEFAULT_MODEL_DIR

    model = {"modelWeightPath": str(DEFAULT_MODEL_DIR), "backendType": "cpu", "dtype": "float32",
             "plugin_params": {"plugin_type": "mtp", "num_speculative_tokens": 2}}
    (tmp_path / "config.json").write_text(json.dumps({"BackendConfig": {
        "ModelDeployConfig": {"ModelConfig": [model]}, "ScheduleConfig": {"numBlocks": 40, "maxBatchSize": 4}}}))
    llm = LLM(config=tmp_path / "config.json", num_blocks=30, max_batch_size=2, plugin_params="", progress=False)
    assert llm.engine.block_manager.num_blocks == 30 and llm.engine.scheduler.config.max_batch_size == 2
    assert [p.name for p in llm.engine.plugin_manager.plugins] == ["structured_output"]  # always on


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "float64"}, "dtype"), ({"num_blocks": 1}, "num_blocks"), ({"cache_block_size": 0}, "cache_block_size"),
    ({"kv_cache_gb": -1.0}, "kv_cache_gb"), ({"cpu_threads": 0}, "cpu_threads"),
])
def test_bad_keyword_values_name_the_field_before_loading(kwargs, field, tmp_path):
    # tmp_path has no checkpoint: the value is refused before anything tries to load one
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tmp_path), progress=False, **kwargs)
    with pytest.raises(ValueError, match=field):
        LLM(progress=False, **kwargs)


def test_config_may_name_a_shipped_config():
    from mindspec.config.defaults import DEFAULT_MODEL_DIR

    llm = LLM(config="config_cpu_no_mtp", progress=False)  # configs/config_cpu_no_mtp.json, by name
    assert [p.name for p in llm.engine.plugin_manager.plugins] == ["structured_output"]  # always on
    assert Path(llm.engine.args.model).resolve() == DEFAULT_MODEL_DIR.resolve()
