"""The PD hand-off as it travels between nodes (bytes), and what the decode node does with it:
the transferred main and MTP KV is never overwritten (the first MTP step writes to the reserved
block), the output equals one standard engine's, and a malformed hand-off is one clear error."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.distributed.errors import HandoffError
from mindspec.distributed.pd_transfer import check_fits, decode_handoff, encode_handoff
from mindspec.engine.outputs import PrefillHandoff
from mindspec.service.pd_node import adopt
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("pd_kv"), cfg, seed=7, residual_scale=0.005)


def _llm(path, role):
    pp = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "vanilla", "pd_role": role,
          "adaptive_speculation": False}  # every step drafts, whatever the step times
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=128, progress=False, plugin_params=pp)


def _rows(engine, cache, seq):
    bs = engine.block_manager.block_size
    slots = torch.from_numpy(engine.block_manager.slots(seq, 0, seq.num_prompt_tokens))
    return torch.cat([cache.c_kv[slots // bs, slots % bs], cache.k_pe[slots // bs, slots % bs]], dim=-1)


def test_decode_node_keeps_the_transferred_kv_and_matches_a_standard_engine(checkpoint):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 250, int(n)).tolist() for n in (5, 13)]
    expected = [o.token_ids for o in _llm(checkpoint, "standard").generate(prompts, GREEDY)]
    prefill, decode = _llm(checkpoint, "prefill").engine, _llm(checkpoint, "decode").engine
    wire = [encode_handoff(prefill.prefill_for_handoff(p, GREEDY), {"request_id": f"r{i}"}) for i, p in enumerate(prompts)]
    handoffs = [decode_handoff(b) for b in wire]
    assert [extra["request_id"] for _, extra in handoffs] == ["r0", "r1"]
    firsts = [adopt(decode, h, GREEDY, f"r{i}") for i, (h, _) in enumerate(handoffs)]
    assert [f.new_token_ids for f in firsts] == [[e[0]] for e in expected]  # the prefill node's first token
    # on this node the first token came with the hand-off: at adoption, right after arrival
    assert all(f.metrics.arrival_time <= f.metrics.first_token_time == f.metrics.last_token_time for f in firsts)
    assert all(f.metrics.first_scheduled_time is not None and f.metrics.finished_time is None for f in firsts)

    states = list(decode.requests.values())
    mw = decode.model_wrapper
    main_layer, mtp_layer = 0, mw.model.cfg.num_hidden_layers  # first main layer, first MTP module
    dummy = decode.block_manager.dummy_block_id
    mtp_cache = mw.caches[mtp_layer]
    dummy_before = mtp_cache.c_kv[dummy].clone()
    decode.step()  # the first decode: MTP runs on zero hidden states for the missing position
    for state, (h, _) in zip(states, handoffs):
        # what arrived is what the caches hold, after the first decode step too
        assert torch.equal(_rows(decode, mtp_cache, state.seq), h.kv[mtp_layer].to(mtp_cache.c_kv.dtype))
        assert torch.equal(_rows(decode, mw.caches[main_layer], state.seq), h.kv[main_layer])
    assert not torch.equal(mtp_cache.c_kv[dummy], dummy_before)  # that step's MTP writes went to the dummy block

    outs = decode.run(states)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_decode.num_accepted_tokens for o in outs) > 0


def test_handoff_bytes_round_trip_exactly():
    kv = [torch.randn(3, 40, dtype=torch.bfloat16) for _ in range(4)]
    h, extra = decode_handoff(encode_handoff(PrefillHandoff([5, 6, 7], 9, kv), {"params": {"max_tokens": 3}}))
    assert h.prompt_token_ids == [5, 6, 7] and h.first_token_id == 9 and extra == {"params": {"max_tokens": 3}}
    assert all(torch.equal(a, b) and b.dtype == torch.bfloat16 for a, b in zip(kv, h.kv))


@pytest.mark.parametrize("data, message", [
    (b"", "empty or truncated"),
    (b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "truncated"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", "not a mindspec hand-off"),
])
def test_malformed_bytes_are_one_handoff_error(data, message):
    with pytest.raises(HandoffError, match=message):
        decode_handoff(data)


def test_a_handoff_for_another_model_does_not_fit():
    h = PrefillHandoff([5, 6], 1, [torch.zeros(2, 40) for _ in range(3)])
    with pytest.raises(HandoffError, match="carries 3 cache layers, this model has 4"):
        check_fits(h, num_layers=4, latent_dim=40, vocab_size=256)
    with pytest.raises(HandoffError, match="latent width is 40, this model's is 48"):
        check_fits(h, num_layers=3, latent_dim=48, vocab_size=256)
    with pytest.raises(HandoffError, match="token id 300 is outside the vocabulary"):
        check_fits(PrefillHandoff([5, 300], 1, h.kv), num_layers=3, latent_dim=40, vocab_size=256)
    bad = [torch.full((2, 40), float("nan"))] * 3
    with pytest.raises(HandoffError, match="non-finite"):
        check_fits(PrefillHandoff([5, 6], 1, bad), num_layers=3, latent_dim=40, vocab_size=256)
