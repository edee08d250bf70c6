"""NPU graph capture of the decode step with per-replay attention updates, on the reference's
graph stand-in: a replay equals the eager step for new lengths, tokens and slots only because the
captured FIA calls are re-issued with the new host lengths (stale lengths give other logits, no
update at all would block), and what a graph cannot hold is refused."""
import numpy as np
import pytest
import torch

from mindspec.backends.npu.graph import GraphShapeError, NpuDecodeGraph
from mindspec.modeling.forward_metadata import build_model_inputs, to_device
from mindspec.modeling.model_wrapper import ModelWrapper
from tests.support.checkpoints import make_checkpoint
from npu_cases import ascend_config
from tests.support.torch_npu_reference import GraphCaptureError

PROMPTS = [[3, 7, 11, 13, 17], [2] * 19, [5, 9, 40, 41, 42, 43, 44, 45, 46]]
TABLES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("graph"), ascend_config(), seed=2)


def _wrapper(path, block_size=16):
    wrapper = ModelWrapper(path, backend="npu", dtype="float16", num_mtp_modules=0, progress=False, device="cpu")
    wrapper.allocate_cache(16, block_size)
    wrapper.forward(to_device(build_model_inputs(PROMPTS, [0, 0, 0], TABLES, block_size), "cpu"))  # prefill
    return wrapper


def _verify_step(cached, tokens, block_size=16):
    """An MTP verification step: 4 new tokens per sequence after ``cached`` tokens, logits for all."""
    host = build_model_inputs([list(t) for t in tokens], cached, TABLES, block_size, lm_head_indices=np.arange(12))
    return to_device(host, "cpu")


def _step(wrapper):
    def run(inputs):
        x = inputs[0]
        wrapper.backend.prepare(x.meta)
        return wrapper.model.forward(x.input_ids, x.positions, wrapper.caches, x.meta, x.lm_head_indices).logits
    return run


def _snapshot(wrapper):
    return [(c.c_kv.clone(), c.k_pe.clone()) for c in wrapper.caches]


def _restore(wrapper, snap):
    for c, (c_kv, k_pe) in zip(wrapper.caches, snap):
        c.c_kv.copy_(c_kv)
        c.k_pe.copy_(k_pe)


def test_replay_with_updated_lengths_equals_eager(checkpoint, npu_ref):
    wrapper = _wrapper(checkpoint)
    step = _step(wrapper)
    lens = [len(p) for p in PROMPTS]
    graph = NpuDecodeGraph(wrapper.backend, step, max_blocks=4)
    first = _verify_step(lens, [[20, 21, 22, 23]] * 3)
    graph.capture([first])
    assert graph.num_captured_attention == 2  # one FIA task group per layer
    assert len(npu_ref.calls("npu_fused_infer_attention_score_v2.out")) == 2
    after_first = _snapshot(wrapper)

    # Next step: 2 drafts of each sequence were accepted, so every sequence is 2 tokens longer.
    nxt = _verify_step([n + 2 for n in lens], [[30, 31, 32, 33], [34, 35, 36, 37], [38, 39, 40, 41]])
    eager = step([nxt])
    _restore(wrapper, after_first)
    replayed = graph.replay([nxt]).clone()
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
    after_next = _snapshot(wrapper)

    # And again, with other lengths per sequence (one sequence fully accepted, one none).
    third = _verify_step([lens[0] + 6, lens[1] + 3, lens[2] + 2], [[50, 51, 52, 53]] * 3)
    eager3 = step([third])
    _restore(wrapper, after_next)
    torch.testing.assert_close(graph.replay([third]).clone(), eager3, rtol=0, atol=0)

    # The captured lengths are baked in: re-issuing attention with the old host lists gives other
    # logits, and replaying without re-issuing it would block on the update's event.
    _restore(wrapper, after_next)
    stale = {id(s.meta): s.meta for s in graph.static}
    wrapper.backend.update_captured_attention(graph.capture_state, stale, graph.update_stream)
    graph.graph.replay()
    assert not torch.allclose(graph.outputs, eager3)
    with pytest.raises(GraphCaptureError, match="wait forever"):
        graph.graph.replay()


def test_replay_needs_the_captured_shape(checkpoint, npu_ref):
    wrapper = _wrapper(checkpoint)
    lens = [len(p) for p in PROMPTS]
    graph = NpuDecodeGraph(wrapper.backend, _step(wrapper), max_blocks=4)
    graph.capture([_verify_step(lens, [[1, 2, 3, 4]] * 3)])
    host = build_model_inputs([[1, 2]] * 3, lens, TABLES, 16, lm_head_indices=np.arange(6))
    with pytest.raises(GraphShapeError, match="query lengths"):
        graph.replay([to_device(host, "cpu")])


def test_capture_refuses_composed_attention_and_host_syncs(checkpoint, npu_ref):
    wrapper = _wrapper(checkpoint, block_size=8)  # FIA pages 16 or 128 tokens: attention runs composed
    lens = [len(p) for p in PROMPTS]
    tables8 = [[4 * i + j for j in range(4)] for i in range(3)]
    host = build_model_inputs([[1, 2, 3, 4]] * 3, lens, tables8, 8, lm_head_indices=np.arange(12))
    graph = NpuDecodeGraph(wrapper.backend, _step(wrapper), max_blocks=4)
    with pytest.raises(RuntimeError, match="cannot capture mla_attention on the composed path"):
        graph.capture([to_device(host, "cpu")])

    def syncs(inputs):
        return inputs[0].input_ids.sum().item()

    with pytest.raises(GraphCaptureError, match="synchronises with the host"):
        NpuDecodeGraph(wrapper.backend, syncs, max_blocks=4).capture([to_device(host, "cpu")])
