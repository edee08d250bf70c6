"""PD disaggregation: a decode-only engine adopts requests prefilled by another engine (their KV
copied over, their hidden states not) and produces the same greedy output as one engine."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.engine.errors import EngineError
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
from tests.support.draft_counts import record_mtp_steps

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("pd"), cfg, seed=11, residual_scale=0.005)


def _llm(path, **mtp):
    pp = {"plugin_type": "mtp", "num_speculative_tokens": 2, "adaptive_speculation": False, **mtp}
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=128, progress=False, plugin_params=pp)


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_decode_node_matches_a_single_engine(checkpoint, mode):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 250, int(n)).tolist() for n in (3, 11, 6, 17)]
    expected = [o.token_ids for o in _llm(checkpoint, mtp_mode=mode).generate(prompts, GREEDY)]
    outs = _decode_after_handoff(checkpoint, prompts, mtp_mode=mode)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_decode.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_decode_node_with_draft_trees_matches_a_single_engine(checkpoint, mode):
    """Tree steps from adopted sequences (no hidden states before the hand-off): rows before it
    write to the dummy block, so the received MTP KV stays intact; the output is one engine's."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 250, int(n)).tolist() for n in (2, 9, 14)]
    tree = {"tree": "dynamic", "tree_topk": 2, "num_draft_tokens": 5, "mtp_mode": mode}
    expected = [o.token_ids for o in _llm(checkpoint, mtp_mode=mode).generate(prompts, GREEDY)]
    outs = _decode_after_handoff(checkpoint, prompts, **tree)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_decode.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_decode_node_with_suffix_drafts_matches_mtp_off(checkpoint, mode, monkeypatch):
    """MTP with suffix drafts on the decode node: steps of suffix drafts alone (no MTP draft
    step) and mixed ones, starting from adopted sequences whose hidden states are zeros."""
    rng = np.random.default_rng(3)
    prompts = [[5, 6, 7, 8] * 3 + [5, 6], [9, 10] * 4, rng.integers(2, 250, 11).tolist()]
    off = LLM(model=str(checkpoint), dtype="float32", cache_block_size=4, num_blocks=128, progress=False,
              plugin_params={})
    draft_steps = []
    steps = record_mtp_steps(monkeypatch, draft_steps)
    for batch in (prompts, prompts[:1]):  # alone, the sequence's steps of suffix drafts run no draft step
        outs = _decode_after_handoff(checkpoint, batch, mtp_mode=mode, suffix_drafting=True, suffix_min_match=1)
        assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(batch, GREEDY)]
    assert any(host and len(host) < len(counts) for counts, host in steps) and 0 in draft_steps


def _decode_after_handoff(checkpoint, prompts, **mtp):
    """The prompts prefilled on one node and decoded on another; the MTP KV received from the
    prefill node is intact after the first decode step."""
    prefill_node = _llm(checkpoint, pd_role="prefill", **mtp)
    decode_node = _llm(checkpoint, pd_role="decode", **mtp)
    handoffs = [prefill_node.engine.prefill_for_handoff(p, GREEDY) for p in prompts]
    assert len(handoffs[0].kv) == decode_node.engine.model_wrapper.model.num_cache_layers
    states = [decode_node.engine.add_prefilled_request(h, GREEDY) for h in handoffs]

    engine = decode_node.engine
    mtp_cache = engine.model_wrapper.caches[engine.model_wrapper.model.cfg.num_hidden_layers]
    bs = engine.block_manager.block_size

    def mtp_rows(state):
        slots = torch.from_numpy(engine.block_manager.slots(state.seq, 0, state.seq.num_prompt_tokens))
        return mtp_cache.c_kv[slots // bs, slots % bs].clone()

    before = [mtp_rows(s) for s in states]
    engine.step()
    assert all(torch.equal(b, mtp_rows(s)) for b, s in zip(before, states))
    outs = engine.run(states)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    return outs


def test_adopting_needs_the_decode_role(checkpoint):
    handoff = _llm(checkpoint, pd_role="prefill").engine.prefill_for_handoff([5, 6, 7], GREEDY)
    with pytest.raises(EngineError, match="pd_role 'decode'"):
        _llm(checkpoint).engine.add_prefilled_request(handoff, GREEDY)


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_decode_node_prefix_cache_takes_cached_prompt_blocks(checkpoint, mode):
    """Prefix caching on both nodes: the prefill node finds the shared prompt prefix cached, the
    decode node takes its cached blocks for a second request with that prefix instead of writing
    the handed-off KV into new ones (those blocks' KV is left untouched), and every token equals
    a single engine's without the cache."""
    rng = np.random.default_rng(5)
    shared = rng.integers(2, 250, 21).tolist()
    prompts = [shared + rng.integers(2, 250, int(n)).tolist() for n in (5, 9, 2)]
    expected = [o.token_ids for o in _llm(checkpoint, mtp_mode=mode).generate(prompts, GREEDY)]
    pp = {"plugin_type": "mtp,prefix_cache", "mtp_mode": mode}
    prefill_node, decode_node = _llm(checkpoint, pd_role="prefill", **pp), _llm(checkpoint, pd_role="decode", **pp)
    engine, outs = decode_node.engine, []
    for i, prompt in enumerate(prompts):
        handoff = prefill_node.engine.prefill_for_handoff(prompt, GREEDY)
        if i:  # the decode node's cached copy of the prefix is what the new request reads
            kv_before = [c.c_kv.clone() for c in engine.model_wrapper.caches]
            handoff.kv = [t.clone() for t in handoff.kv]
            for t in handoff.kv:
                t[:16] = float("nan")  # must not be written: the cached blocks hold these positions
        state = engine.add_prefilled_request(handoff, GREEDY)
        if i:
            assert state.seq.prefix_cached_tokens == 16
            cached = torch.from_numpy(engine.block_manager.slots(state.seq, 0, 16))
            bs = engine.block_manager.block_size
            assert all(torch.equal(b[cached // bs, cached % bs], c.c_kv[cached // bs, cached % bs])
                       for b, c in zip(kv_before, engine.model_wrapper.caches))
        outs += engine.run([state])
    assert [o.token_ids for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [0, 16, 16]
    assert prefill_node.engine.block_manager.prefix_cache.stats.hit_tokens > 0
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks
