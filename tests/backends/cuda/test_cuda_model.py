"""The whole model on the cuda backend (under Triton's interpreter on CPU, natively on a GPU)
gives the same greedy tokens as the cpu backend on random tiny checkpoints, MTP on and off, and
also when decode steps go through the graph runner's padded buckets (eagerly where no GPU)."""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.modeling.graph_runner import DecodeGraphRunner
from tests.support.checkpoints import make_checkpoint, make_self_predicting_checkpoint, tiny_v2_config, tiny_v3_config
from tests.support.draft_counts import record_draft_counts, record_mtp_steps, script_mtp_counts

pytestmark = pytest.mark.slow  # about a minute under the interpreter on 2 cores

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    # Self-predicting MTP modules: drafts are accepted about half the time, so full hits, partial
    # hits and rollbacks all occur within a few steps.
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    path = make_self_predicting_checkpoint(tmp_path_factory.mktemp("v3"), cfg, seed=11, residual_scale=0.005)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in (5, 13, 9)]
    return path, prompts


def _llm(path, backend, device=None, plugin_params=None, block_size=4):
    return LLM(model=str(path), dtype="float32", cache_block_size=block_size, num_blocks=96, progress=False,
               plugin_params=plugin_params, backend=backend, device=device)


def _tokens(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_mtp_greedy_equals_cpu(v3_checkpoint, device, mode):
    path, prompts = v3_checkpoint
    params = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": mode, "adaptive_speculation": False}
    expected = _tokens(_llm(path, "cpu", plugin_params=params), prompts)
    llm = _llm(path, "cuda", device, plugin_params=params)
    out = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == expected
    assert sum(o.spec_decode.num_accepted_tokens for o in out) > 0  # the draft-hit paths ran


def test_no_speculation_equals_cpu_block_size_16(v3_checkpoint, device):
    path, prompts = v3_checkpoint
    assert _tokens(_llm(path, "cuda", device, block_size=16), prompts) == _tokens(_llm(path, "cpu", block_size=16), prompts)


def test_v2_checkpoint_equals_cpu(tmp_path, device):
    cfg = tiny_v2_config(initializer_range=0.2)
    path = make_checkpoint(tmp_path / "v2", cfg, seed=5)
    prompts = [[3, 17, 42, 9], list(range(2, 30))]
    assert _tokens(_llm(path, "cuda", device), prompts) == _tokens(_llm(path, "cpu"), prompts)


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_padded_decode_buckets_equal_cpu(v3_checkpoint, device, mode):
    """Decode steps through the graph runner: batches of 3 padded to a bucket of 4 (a padding
    sequence on the dummy block, and the slack sequence of the draft steps)."""
    path, prompts = v3_checkpoint
    params = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": mode, "adaptive_speculation": False}
    expected = _tokens(_llm(path, "cpu", plugin_params=params), prompts)
    llm = _llm(path, "cuda", device, plugin_params=params)
    wrapper = llm.engine.model_wrapper
    runner = DecodeGraphRunner(wrapper, buckets=(4,), capture=wrapper.backend.supports_graph_capture)
    wrapper.graph_runner = runner
    assert _tokens(llm, prompts) == expected
    assert runner.stats.replays >= NEW_TOKENS // 3
    if runner.capture:  # on a GPU every bucket must really be captured, not fall back to eager
        # (every step here speculates with the same rows: one speculative graph serves them all)
        assert runner.stats.eager_fallbacks == 0 and runner.stats.captures == runner.num_graphs >= 1, runner.stats


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_replayed_graphs_equal_cpu(v3_checkpoint, device, monkeypatch, mode):
    """Steps as a CUDA graph runs them: outputs in static buffers that each replay overwrites,
    the targets, drafts and accepted counts packed by the acceptance kernel (read with one copy),
    the drafts a view of the verification rows. Natively these are real graphs."""
    from mindspec.backends.cuda import CudaBackend
    from tests.support.static_graph import StaticGraph

    path, prompts = v3_checkpoint
    params = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": mode, "adaptive_speculation": False}
    expected = _tokens(_llm(path, "cpu", plugin_params=params), prompts)
    if device == "cpu":  # the interpreter: replays into static buffers stand in for graphs
        monkeypatch.setattr(CudaBackend, "supports_graph_capture", property(lambda backend: True))
        monkeypatch.setattr(CudaBackend, "capture_graph", lambda backend, fn: StaticGraph(fn))
    llm = LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=96, progress=False, plugin_params=params,
              backend="cuda", device=device, max_batch_size=3)
    assert _tokens(llm, prompts) == expected
    stats = llm.engine.model_wrapper.graph_runner.stats
    assert stats.captures >= 1 and stats.eager_fallbacks == 0 and stats.replays > stats.captures, stats


def test_suffix_drafting_with_unequal_draft_counts_equals_cpu(v3_checkpoint, device, monkeypatch):
    """Sequences of one verification forward with different draft counts (0 included): the
    attention kernels' unequal q_lens, and the graph runner's per-sequence padding on a GPU."""
    path, _ = v3_checkpoint
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44], [9, 10, 9, 10, 9]]
    params = {"plugin_type": "suffix", "num_speculative_tokens": 3, "min_match": 1}
    counts = record_draft_counts(monkeypatch)
    expected = _tokens(_llm(path, "cpu"), prompts)
    assert _tokens(_llm(path, "cuda", device, plugin_params=params), prompts) == expected
    assert any(len(set(c)) > 1 for c in counts)


def _cuda_eager_and_graphed(path, device, params, pattern, prompts):
    """The cuda backend's tokens with the MTP counts scripted: eagerly, then through a graph
    runner (bucket 4; captured on a GPU); and that runner."""
    llm = _llm(path, "cuda", device, plugin_params=params)
    script_mtp_counts(llm, pattern)
    eager = _tokens(llm, prompts)
    wrapper = llm.engine.model_wrapper
    runner = DecodeGraphRunner(wrapper, buckets=(4,), capture=wrapper.backend.supports_graph_capture)
    wrapper.graph_runner = runner
    script_mtp_counts(llm, pattern)
    return eager, _tokens(llm, prompts), runner


def test_mtp_with_suffix_drafts_equals_cpu(v3_checkpoint, device, monkeypatch):
    """Suffix drafts (more than K, on the host) and MTP drafts (0..K) in one MTP step: eagerly,
    and with a graph runner, which replays the steps without suffix drafts and those of suffix
    drafts alone (a plain forward over the verification rows)."""
    path, _ = v3_checkpoint
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44], [9, 10, 9, 10, 9]]
    params = {"plugin_type": "mtp,suffix", "num_speculative_tokens": 2, "mtp_mode": "vanilla",
              "suffix_min_match": 1, "suffix_max_drafts": 5}
    pattern = [[2, 0, 1], [1, 2, 0], [0]]
    steps = record_mtp_steps(monkeypatch)
    expected = _tokens(_llm(path, "cpu"), prompts)
    cpu = _llm(path, "cpu", plugin_params=params)
    script_mtp_counts(cpu, pattern)
    assert _tokens(cpu, prompts) == expected
    assert any(host and len(host) < len(counts) for counts, host in steps)
    eager, graphed, _ = _cuda_eager_and_graphed(path, device, params, pattern, prompts)
    assert eager == graphed == expected
    # Alone, with no MTP drafts scripted: steps of suffix drafts alone, plain forwards the runner pads
    eager, graphed, runner = _cuda_eager_and_graphed(path, device, params, [0], prompts[:1])
    assert eager == graphed == _tokens(_llm(path, "cpu"), prompts[:1])
    assert any(kind == "decode" and q > 1 for kind, _, q, *_ in runner.shape_keys)


def test_mtp_per_sequence_draft_counts_equal_cpu(v3_checkpoint, device):
    """Adaptive speculation's per-sequence counts (0 included) in one MTP step: eagerly (the
    model places each draft in ragged rows) and through the graph runner (rows padded per
    sequence)."""
    path, prompts = v3_checkpoint
    params = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "vanilla"}
    pattern = [[2, 0, 1], [1, 2, 0], [0, 1, 2]]
    cpu = _llm(path, "cpu", plugin_params=params)
    script_mtp_counts(cpu, pattern)
    expected = _tokens(cpu, prompts)
    assert expected == _tokens(_llm(path, "cpu"), prompts)
    eager, graphed, runner = _cuda_eager_and_graphed(path, device, params, pattern, prompts)
    assert eager == graphed == expected
    assert runner.stats.replays > 0


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_prefix_cache_and_split_fuse_equal_cpu(v3_checkpoint, device, mode):
    """Prompts sharing a prefix, the second arriving while the first decodes: on the cuda backend
    it finds the first's blocks cached and is prefilled in chunks inside decode steps (attention
    over cached context, MTP modules over the chunks), giving the cpu backend's plain tokens."""
    path, prompts = v3_checkpoint
    shared = prompts[1] + prompts[2]
    batch = [shared + [7, 8], shared + prompts[0]]
    params = {"plugin_type": "mtp,prefix_cache,splitfuse", "num_speculative_tokens": 2, "mtp_mode": mode,
              "adaptive_speculation": False}
    expected = _tokens(_llm(path, "cpu"), batch)
    llm = LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=96, progress=False,
              plugin_params=params, backend="cuda", device=device, split_chunk_tokens=6)
    engine = llm.engine
    first = engine.add_request(batch[0], GREEDY)
    engine.step()
    engine.step()
    second = engine.add_request(batch[1], GREEDY)
    outs = engine.run([first, second])
    assert [o.token_ids for o in outs] == expected
    assert outs[1].num_cached_tokens >= 8


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_draft_trees_equal_cpu(v3_checkpoint, device, mode):
    """Tree drafting (tree-masked MTP steps) and verification (the Triton MLA kernel's tree mask)
    on the cuda backend: the cpu backend's plain tokens, with tree paths accepted."""
    path, prompts = v3_checkpoint
    params = {"plugin_type": "mtp", "mtp_mode": mode, "tree": "dynamic", "num_speculative_tokens": 2,
              "tree_topk": 3, "num_draft_tokens": 6}
    expected = _tokens(_llm(path, "cpu"), prompts)
    out = _llm(path, "cuda", device, plugin_params=params).generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == expected
    assert sum(o.spec_decode.num_accepted_tokens for o in out) > 0
