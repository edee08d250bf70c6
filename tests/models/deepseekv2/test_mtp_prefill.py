"""MTP prefill: the last module only writes its cache (its draft is dropped), and every MTP cache
holds exactly what running each module in full over the shifted prompt writes."""
import numpy as np
import pytest
import torch

from mindspec.backend import get_backend
from mindspec.modeling.forward_metadata import build_model_inputs, to_device
from mindspec.models.deepseekv2.flash_causal_deepseekv2 import FlashCausalDeepseekV2
from tests.support.checkpoints import make_checkpoint, tiny_v3_config

BLOCK = 4
PROMPTS = [[5, 9, 2, 33, 17, 4, 8], [40, 3, 3, 12, 7]]
TABLES = [[6, 1], [3, 9]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = tiny_v3_config(num_nextn_predict_layers=3)
    path = make_checkpoint(tmp_path_factory.mktemp("mtp_prefill"), cfg, seed=11)
    return FlashCausalDeepseekV2.load(path, get_backend("cpu"), torch.float32, progress=False)


def _inputs():
    return to_device(build_model_inputs(PROMPTS, [0, 0], TABLES, BLOCK), "cpu")


def _full_modules(model, modules):
    """Reference: the main model, then every module run in full, each fed the previous stage's
    block output and the prompt shifted once more, its greedy draft at each prompt's end."""
    caches = model.allocate_caches(12, BLOCK)
    x = _inputs()
    out = model.forward(x.input_ids, x.positions, caches, x.meta, x.lm_head_indices)
    ids, hidden = torch.roll(x.input_ids, -1), out.hidden_states
    ids[x.lm_head_indices] = out.logits.argmax(-1)
    for m in modules:
        step = model.forward_mtp(m, ids, hidden, x.positions, caches, x.meta, x.lm_head_indices)
        ids, hidden = torch.roll(ids, -1), step.hidden_states
        ids[x.lm_head_indices] = step.logits.argmax(-1)
    return caches


def _prompt_slots():
    slots = _inputs().meta.slots
    return slots[slots >= 0]


@pytest.mark.parametrize("modules", [[0, 1, 2], [0], [1]], ids=["vanilla", "eagle", "one-later-module"])
def test_prefill_writes_the_caches_running_every_module_in_full_writes(model, modules):
    caches = model.allocate_caches(12, BLOCK)
    x = _inputs()
    out = model.forward_prefill_mtp(x.input_ids, x.positions, x.meta, x.lm_head_indices, modules, caches)
    ref = _full_modules(model, modules)
    slots = _prompt_slots()
    assert len(slots) == sum(map(len, PROMPTS))
    for layer, (got, want) in enumerate(zip(caches, ref)):
        for name in ("c_kv", "k_pe"):
            a = getattr(got, name).reshape(-1, getattr(got, name).shape[-1])
            b = getattr(want, name).reshape(-1, getattr(want, name).shape[-1])
            assert torch.equal(a, b), (layer, name)  # every slot, the untouched ones too
    mtp_layers = [model.cfg.num_hidden_layers + m for m in modules]
    for layer in mtp_layers:  # the written entries are real latents, not left zero
        assert caches[layer].c_kv.reshape(-1, model.cfg.kv_lora_rank)[slots].abs().amin(dim=-1).gt(0).all()
    assert out.logits.shape == (len(PROMPTS), model.cfg.vocab_size)


def test_last_module_runs_no_mlp(model, monkeypatch):
    """What the change buys: the last module's MLP never runs in prefill."""
    calls = []
    for m, module in enumerate(model.mtp_modules):
        forward = module.block.mlp.forward
        monkeypatch.setattr(module.block.mlp, "forward", lambda h, m=m, f=forward: calls.append(m) or f(h))
    caches = model.allocate_caches(12, BLOCK)
    x = _inputs()
    model.forward_prefill_mtp(x.input_ids, x.positions, x.meta, x.lm_head_indices, [0, 1, 2], caches)
    assert calls == [0, 1]
