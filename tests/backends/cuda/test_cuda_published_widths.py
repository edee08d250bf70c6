"""The cuda backend equals the cpu backend at the published widths of DeepSeek-V2-Lite and
DeepSeek-V3 (the other cuda tests use tiny ones): MLA with 16 / 128 heads, kv_lora_rank 512, head
dims 128 + 64 / 128, V3's q_lora_rank 1536, hidden 2048 / 7168 through the norms, the fused MoE
and the routers (softmax greedy over 64 experts, top-6; sigmoid noaux_tc in 8 groups, 4 kept, top-8).

The checkpoints are random-weights manifests (mindspec/modeling/random_checkpoint.py) of
``shape_config``'s published configs, cut only where kernel tiling does not change: 2 decoder
layers (dense, then MoE), one MTP module, vocab 1024, small dense / expert intermediate sizes and,
for V3, 32 routed experts instead of 256 (n_group 8 still divides them).

Compared in float32: greedy tokens exactly, and within LOGPROB_ATOL the log-probability of every
prompt token (the prefill at every position) and of every generated token, for plain decoding and
for MTP Eagle with K=2. Tokens alone are too coarse: dropping one 128-wide K tile of the hidden
size in the expert GEMM can leave the tokens as they are and moves log-probabilities by ~1e-2; the
two backends differ by < 1e-5. Random weights give random drafts, which the target would never
accept; ``simulated_acceptance`` accepts drafts at fixed rates with a seeded draw (the same on
both backends), so the MTP module's drafts reach the output, and misses, partial hits and full
hits all occur.
"""
import gc
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import mindspec
from cuda_support import ON_GPU
from mindspec import LLM, SamplingParams
from mindspec.backends.cpu.linear import ENV_SWITCH as PACKED_LINEAR_SWITCH
from mindspec.bench.model_shapes import SHAPES, TOKENIZER_FILES, shape_config
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.modeling.random_checkpoint import write_manifest
from mindspec.models.deepseekv2.config import DeepseekV2Config
from mindspec.models.deepseekv2.weights import model_specs

pytestmark = pytest.mark.slow  # about three minutes under the interpreter on 2 cores, mostly V3's fused MoE

# What the kernels tile over, kept as published.
WIDTHS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
          "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts_per_tok", "n_shared_experts", "n_group",
          "topk_group", "topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "rope_scaling",
          "rope_interleave")
COMMON_CUTS = dict(vocab_size=1024, intermediate_size=256, moe_intermediate_size=128, first_k_dense_replace=1,
                   num_nextn_predict_layers=1, initializer_range=0.02)
CUTS = {"deepseek-v2-lite": {}, "deepseek-v3": dict(n_routed_experts=32)}
# Cache blocks of 16: the 15-token prompts' decode steps cross into a new block.
PROMPT_LENGTHS = {"deepseek-v2-lite": (5, 15, 37), "deepseek-v3": (6, 15)}
NEW_TOKENS = 3
# With the MTP plugin's seeded draws (rng 0) these rates make the first speculative step a miss, a
# partial hit and (V2-Lite) a full hit with both drafts emitted; V3's full hit comes second.
MTP = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "eagle", "adaptive_speculation": False,
       "simulated_acceptance": [0.6, 0.2]}
# Both sides are float32 and differ in summation order only (<= 6e-6 measured; log-probabilities are -1 .. -12).
LOGPROB_ATOL = 1e-3


def write_checkpoint(path: Path, name: str, seed: int = 0) -> Path:
    config = {**shape_config(name, num_layers=2), **COMMON_CUTS, **CUTS[name]}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    assets = Path(mindspec.__file__).parent / "assets" / "default_model"
    for f in TOKENIZER_FILES:
        shutil.copyfile(assets / f, path / f)
    cfg = DeepseekV2Config.from_model_dir(path)
    # drawn on the CPU: torch's CUDA generator would give the cuda run other weights than the cpu run's
    write_manifest(path, {n: s.shape for n, s in model_specs(cfg, cfg.num_nextn_predict_layers).items()}, seed,
                   generator="cpu")
    return path


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    name = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(name), name)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, COMMON_CUTS["vocab_size"], n).tolist() for n in PROMPT_LENGTHS[name]]
    return name, path, prompts


@pytest.fixture
def quick_start(monkeypatch):
    """Start-up work that checks nothing here. The cpu reference keeps its weights unpacked
    (F.linear, not oneDNN's packed copy: as good a reference, half the memory, ~10 s less per V3 load).
    Under the interpreter the engine's dummy warm-up prefill (~7 s per V3 model) is skipped; on a
    GPU it also captures the decode graphs, so there it stays."""
    monkeypatch.setenv(PACKED_LINEAR_SWITCH, "0")
    if not ON_GPU:
        monkeypatch.setattr(ModelWrapper, "warmup", lambda self, *args, **kwargs: None)


def _run(path, backend, prompts, device=None, plugin_params=None):
    llm = LLM(model=str(path), backend=backend, device=device, dtype="float32", cache_block_size=16, num_blocks=16,
              progress=False, plugin_params=plugin_params)
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    try:
        return llm.generate(prompts, sampling)
    finally:
        llm.close()
        del llm
        gc.collect()  # one model in memory at a time


def _assert_same(actual, expected):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.token_ids == e.token_ids, f"prompt {i}"
        np.testing.assert_allclose(a.prompt_logprobs[1:], e.prompt_logprobs[1:], rtol=0, atol=LOGPROB_ATOL,
                                   err_msg=f"prompt {i}: prompt log-probabilities")
        np.testing.assert_allclose(a.logprobs, e.logprobs, rtol=0, atol=LOGPROB_ATOL,
                                   err_msg=f"prompt {i}: generated tokens' log-probabilities")


def test_widths_are_published(checkpoint):
    name, path, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    assert {k: config.get(k) for k in WIDTHS} == {k: shape_config(name).get(k) for k in WIDTHS}
    assert config["num_hidden_layers"] == 2 and config["first_k_dense_replace"] == 1  # a dense and an MoE layer


def test_plain_decode_equals_cpu(checkpoint, device, quick_start):
    _, path, prompts = checkpoint
    expected = _run(path, "cpu", prompts)
    _assert_same(_run(path, "cuda", prompts, device), expected)


def test_mtp_eagle_equals_cpu(checkpoint, device, quick_start):
    name, path, prompts = checkpoint
    if name == "deepseek-v3" and not ON_GPU:
        # 90 s under the interpreter; the draft layer and the multi-row attention run at V2-Lite's widths here
        pytest.skip("MTP at V3's widths runs natively only")
    expected = _run(path, "cpu", prompts, plugin_params=MTP)
    actual = _run(path, "cuda", prompts, device, plugin_params=MTP)
    _assert_same(actual, expected)
    for a, e in zip(actual, expected):
        assert (a.spec_decode.num_steps, a.spec_decode.accepted_per_position) == \
            (e.spec_decode.num_steps, e.spec_decode.accepted_per_position)
    stats = [a.spec_decode for a in actual]
    assert any(s.num_steps > s.accepted_per_position[0] for s in stats)  # a miss: only the bonus token
    assert any(s.accepted_per_position[0] > s.accepted_per_position[1] for s in stats)  # a partial hit
    assert any(s.accepted_per_position[1] > 0 for s in stats)  # a full hit
