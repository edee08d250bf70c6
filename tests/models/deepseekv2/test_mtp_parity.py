"""MTP modules against an independent computation of DeepSeek's MTP formula (tests.support)."""
import numpy as np
import pytest
import torch

from mindspec.backend import get_backend
from mindspec.modeling.forward_metadata import build_model_inputs, to_device
from mindspec.models.deepseekv2.flash_causal_deepseekv2 import FlashCausalDeepseekV2
from tests.support.checkpoints import make_checkpoint, tiny_v2_config, tiny_v3_config
from tests.support.hf_reference import mtp_reference

ATOL = 1e-4
BLOCK = 4


@pytest.fixture(scope="module", params=["v3", "v2"])
def checkpoint(request, tmp_path_factory):
    extra = {"num_nextn_predict_layers": 2}
    cfg = tiny_v3_config(**extra) if request.param == "v3" else tiny_v2_config(**extra)
    return make_checkpoint(tmp_path_factory.mktemp(request.param), cfg, seed=5), cfg


def _mtp(model, module_idx, caches, tokens, hidden, cached, table):
    host = build_model_inputs([tokens], [cached], [table], BLOCK, np.arange(len(tokens)))
    dev = to_device(host, "cpu")
    return model.forward_mtp(module_idx, dev.input_ids, hidden, dev.positions, caches, dev.meta, dev.lm_head_indices)


@pytest.mark.parametrize("module_idx", [0, 1])
def test_mtp_prefill_and_cached_step_match_formula(checkpoint, module_idx):
    path, cfg = checkpoint
    model = FlashCausalDeepseekV2.load(path, get_backend("cpu"), torch.float32, progress=False)
    assert model.num_mtp_modules == 2
    caches = model.allocate_caches(16, BLOCK)
    table = [7, 2, 11, 5]
    gen = torch.Generator().manual_seed(module_idx)
    tokens = torch.randint(0, cfg.vocab_size, (9,), generator=gen).tolist()
    hidden = torch.randn(9, cfg.hidden_size, generator=gen)  # h(i) of the previous stage
    positions = list(range(9))

    # Prefill over the first 6 (token, hidden) pairs, then 3 more through the paged cache.
    first = _mtp(model, module_idx, caches, tokens[:6], hidden[:6], 0, table)
    rest = _mtp(model, module_idx, caches, tokens[6:], hidden[6:], 6, table)
    logits = torch.cat([first.logits, rest.logits])
    block_out = torch.cat([first.hidden_states, rest.hidden_states])

    ref_logits, ref_block = mtp_reference(path, module_idx, tokens, hidden, positions)
    assert (logits - ref_logits).abs().max().item() <= ATOL
    assert (block_out - ref_block).abs().max().item() <= ATOL


def test_mtp_modules_have_their_own_caches(checkpoint):
    path, cfg = checkpoint
    model = FlashCausalDeepseekV2.load(path, get_backend("cpu"), torch.float32, progress=False)
    caches = model.allocate_caches(8, BLOCK)
    _mtp(model, 1, caches, [1, 2, 3], torch.randn(3, cfg.hidden_size), 0, [3])
    written = [bool(c.c_kv.abs().sum() > 0) for c in caches]
    assert written == [False] * cfg.num_hidden_layers + [False, True]


def test_mtp_embed_and_head_fall_back_to_main(tmp_path):
    cfg = tiny_v3_config()
    path = make_checkpoint(tmp_path, cfg, seed=2, mtp_with_embed_and_head=False)
    model = FlashCausalDeepseekV2.load(path, get_backend("cpu"), torch.float32, progress=False)
    module = model.mtp_modules[0]
    assert module.embed is model.embed and module.head is model.lm_head
    tokens, hidden = [4, 9, 1, 30], torch.randn(4, cfg.hidden_size)
    out = _mtp(model, 0, model.allocate_caches(4, BLOCK), tokens, hidden, 0, [0, 1])
    ref_logits, _ = mtp_reference(path, 0, tokens, hidden, list(range(4)))
    assert (out.logits - ref_logits).abs().max().item() <= ATOL


def test_loading_fewer_modules_ignores_the_rest(checkpoint):
    path, _ = checkpoint
    model = FlashCausalDeepseekV2.load(path, get_backend("cpu"), torch.float32, num_mtp_modules=1, progress=False)
    assert model.num_mtp_modules == 1 and model.num_cache_layers == model.cfg.num_hidden_layers + 1


def test_last_stage_runs_only_lm_head_rows_past_attention(checkpoint):
    """A last draft stage feeds no further stage: the same logits and cache entries as a full
    stage, with the block output of its lm_head rows alone."""
    path, cfg = checkpoint
    model = FlashCausalDeepseekV2.load(path, get_backend("cpu"), torch.float32, progress=False)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (9,), generator=gen).tolist()
    hidden = torch.randn(9, cfg.hidden_size, generator=gen)
    outs, caches = [], []
    for last in (False, True):
        c = model.allocate_caches(16, BLOCK)
        _mtp(model, 1, c, tokens[:6], hidden[:6], 0, [7, 2, 11])
        host = build_model_inputs([tokens[6:]], [6], [[7, 2, 11]], BLOCK)  # lm_head row: the last
        dev = to_device(host, "cpu")
        outs.append(model.forward_mtp(1, dev.input_ids, hidden[6:], dev.positions, c, dev.meta, dev.lm_head_indices, last))
        caches.append(c)
    full, last = outs
    assert last.hidden_states.shape == (1, cfg.hidden_size)
    torch.testing.assert_close(last.logits, full.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(last.hidden_states, full.hidden_states[-1:], atol=ATOL, rtol=0)
    for a, b in zip(*caches):
        assert torch.equal(a.c_kv, b.c_kv) and torch.equal(a.k_pe, b.k_pe)
