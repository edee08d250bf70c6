"""The whole model on the npu backend (torch_npu reference on the host) against the cpu backend.

The Ascend-shaped config fits every fused op (latent 512 + rope 64, q/k/v heads 128, 256 experts in
8 groups, block size 16, half precision), so the real op mapping runs end to end. Greedy tokens are
compared in float16: in bfloat16 the cpu backend alone lands ~0.3 away from float32 logits while
top-2 margins of a random tiny model are often smaller, so no two bf16 implementations agree token
for token; bfloat16 (where FIA also runs the prefill) is checked for accuracy against float32.
"""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.modeling.forward_metadata import build_model_inputs, to_device
from mindspec.modeling.model_wrapper import ModelWrapper
from npu_cases import ascend_config
from tests.support.checkpoints import make_checkpoint, make_self_predicting_checkpoint, tiny_v3_config
from tests.support.draft_counts import record_draft_counts, record_mtp_steps, script_mtp_counts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MTP_K3 = {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle", "adaptive_speculation": False}
FUSED_OPS = {"npu_fused_infer_attention_score_v2", "npu_kv_rmsnorm_rope_cache", "npu_interleave_rope", "npu_rms_norm",
             "npu_add_rms_norm", "npu_swiglu", "npu_moe_gating_top_k", "npu_moe_init_routing_v2",
             "npu_grouped_matmul", "npu_moe_token_unpermute"}


@pytest.fixture(scope="module")
def ascend_checkpoint(tmp_path_factory):
    # Self-predicting: drafts are accepted part of the time, so MTP's hit and miss paths both run.
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("ascend"), ascend_config(), seed=11,
                                           residual_scale=0.005)


def _prompts(n=4, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 256, int(length)).tolist() for length in rng.integers(3, 30, n)]


def _generate(path, backend, dtype, block_size, **kw):
    llm = LLM(model=str(path), dtype=dtype, cache_block_size=block_size, num_blocks=64, progress=False,
              plugin_params=MTP_K3, backend=backend, **kw)
    outs = llm.generate(_prompts(), GREEDY)
    return [o.token_ids for o in outs], llm


def test_greedy_tokens_equal_cpu_with_mtp_k3(ascend_checkpoint, npu_ref):
    with_npu, llm = _generate(ascend_checkpoint, "npu", "float16", 16, device="cpu")
    backend = llm.engine.model_wrapper.backend
    assert backend.name == "npu" and FUSED_OPS <= {c.name for c in npu_ref.CALLS}
    # Only the prefill runs composed: FIA's TND prefill takes bfloat16 only.
    assert backend.fallbacks.ops() == {"mla_prefill"}
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both accepted and rejected
    with_cpu, _ = _generate(ascend_checkpoint, "cpu", "float16", 16)
    assert with_npu == with_cpu


def test_bfloat16_runs_every_fused_op_as_accurately_as_cpu(ascend_checkpoint, npu_ref):
    """Prefill, then an MTP-shaped decode (4 tokens per sequence) in bfloat16: the npu logits are
    as close to float32 as the cpu backend's bfloat16 logits are, with no composed fallback."""
    prompts = _prompts()
    tables = [[4 * i + j for j in range(4)] for i in range(len(prompts))]
    steps = [build_model_inputs(prompts, [0] * len(prompts), tables, 16),
             build_model_inputs([[5, 6, 7, 8]] * len(prompts), [len(p) for p in prompts], tables, 16,
                                lm_head_indices=np.arange(4 * len(prompts)))]

    def logits(backend, dtype, **kw):
        wrapper = ModelWrapper(ascend_checkpoint, backend=backend, dtype=dtype, num_mtp_modules=0, progress=False, **kw)
        wrapper.allocate_cache(64, 16)
        out = [wrapper.forward(to_device(step, "cpu")).logits for step in steps]
        return torch.cat(out), wrapper.backend

    exact, _ = logits("cpu", "float32")
    cpu, _ = logits("cpu", "bfloat16")
    npu, backend = logits("npu", "bfloat16", device="cpu")
    assert not backend.fallbacks.counts
    assert {"npu_fused_infer_attention_score"} | FUSED_OPS <= {c.name for c in npu_ref.CALLS}
    cpu_err, npu_err = (cpu - exact).abs().max().item(), (npu - exact).abs().max().item()
    assert npu_err <= 2 * cpu_err, (npu_err, cpu_err)
    assert (npu - exact).abs().mean() <= 2 * (cpu - exact).abs().mean()


def test_small_model_runs_on_composed_paths(tmp_path, npu_ref):
    """A tiny float32 model outside every fused limit still runs on the npu backend (fallbacks,
    logged), with the same greedy tokens as the cpu backend, MTP on."""
    path = make_checkpoint(tmp_path / "small", tiny_v3_config(initializer_range=0.2), seed=5)
    with_npu, llm = _generate(path, "npu", "float32", 4, device="cpu")
    with_cpu, _ = _generate(path, "cpu", "float32", 4)
    assert with_npu == with_cpu
    assert {"mla_attention", "mla_prefill", "latent_norm_rope_cache", "moe_gate"} <= llm.engine.model_wrapper.backend.fallbacks.ops()


def test_suffix_drafting_with_unequal_draft_counts_equals_cpu(ascend_checkpoint, npu_ref, monkeypatch):
    """Sequences of one verification forward with different draft counts (0 included) through
    the npu backend's attention (per-sequence query lengths)."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44], [9, 10, 9, 10, 9]]
    params = {"plugin_type": "suffix", "num_speculative_tokens": 3, "min_match": 1}
    counts = record_draft_counts(monkeypatch)

    def tokens(backend, plugin_params, **kw):
        llm = LLM(model=str(ascend_checkpoint), dtype="float16", cache_block_size=16, num_blocks=64, progress=False,
                  plugin_params=plugin_params, backend=backend, **kw)
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]

    assert tokens("npu", params, device="cpu") == tokens("cpu", {})
    assert any(len(set(c)) > 1 for c in counts)


def test_mtp_per_sequence_draft_counts_equal_cpu(ascend_checkpoint, npu_ref):
    """MTP steps whose sequences verify different draft counts (adaptive speculation's
    per-sequence control) through the npu backend's attention."""
    prompts = [[5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44], [9, 10, 9, 10, 9]]
    params = {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle"}

    def tokens(backend, plugin_params, **kw):
        llm = LLM(model=str(ascend_checkpoint), dtype="float16", cache_block_size=16, num_blocks=64, progress=False,
                  plugin_params=plugin_params, backend=backend, **kw)
        if plugin_params:
            script_mtp_counts(llm, [[3, 0, 1], [1, 3, 0], [0, 2, 3]])
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]

    assert tokens("npu", params, device="cpu") == tokens("cpu", {})


def test_mtp_with_suffix_drafts_equals_cpu(ascend_checkpoint, npu_ref, monkeypatch):
    """MTP steps in which some sequences verify suffix drafts (more than K, written into their
    rows on the host) and others 0..K MTP drafts, through the npu backend."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44], [9, 10, 9, 10, 9]]
    params = {"plugin_type": "mtp,suffix", "num_speculative_tokens": 2, "mtp_mode": "eagle",
              "suffix_min_match": 1, "suffix_max_drafts": 5}
    steps = record_mtp_steps(monkeypatch)

    def tokens(backend, plugin_params, **kw):
        llm = LLM(model=str(ascend_checkpoint), dtype="float16", cache_block_size=16, num_blocks=64, progress=False,
                  plugin_params=plugin_params, backend=backend, **kw)
        if plugin_params:
            script_mtp_counts(llm, [[2, 0, 1], [1, 2, 0], [0]])
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]

    assert tokens("npu", params, device="cpu") == tokens("cpu", {})
    assert any(host and len(host) < len(counts) for counts, host in steps)  # suffix and MTP rows in one step


def test_draft_trees_run_composed_attention_and_equal_cpu(ascend_checkpoint, npu_ref):
    """FIA takes no tree mask: tree steps' attention runs on the documented composed path (the
    fallback counter names it) and the tokens are the cpu backend's."""
    tree = {"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 2, "tree_topk": 2,
            "num_draft_tokens": 4, "mtp_mode": "eagle"}
    npu = LLM(model=str(ascend_checkpoint), dtype="float16", cache_block_size=16, num_blocks=64, progress=False,
              plugin_params=tree, backend="npu", device="cpu")
    with_npu = [o.token_ids for o in npu.generate(_prompts(), GREEDY)]
    assert "mla_attention" in npu.engine.model_wrapper.backend.fallbacks.ops()
    assert npu.engine.spec_stats.num_accepted_tokens > 0
    cpu = LLM(model=str(ascend_checkpoint), dtype="float16", cache_block_size=16, num_blocks=64, progress=False,
              plugin_params=tree, backend="cpu")
    assert with_npu == [o.token_ids for o in cpu.generate(_prompts(), GREEDY)]
