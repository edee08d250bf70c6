"""Same random tiny checkpoint, same logits as Hugging Face transformers (float32, <= 1e-4)."""
import numpy as np
import pytest
import torch

from mindspec.backend import get_backend
from mindspec.backends.cpu import linear as packed_linear
from mindspec.models.deepseekv2.flash_causal_deepseekv2 import FlashCausalDeepseekV2
from tests.models.deepseekv2.harness import PagedRunner
from tests.support.checkpoints import load_hf_model, make_checkpoint, tiny_v2_config, tiny_v3_config
from tests.support.hf_reference import hf_logits

ATOL = 1e-4
PROMPT_LENS = [5, 11, 3, 8]
DECODE_STEPS = 8


@pytest.fixture(scope="module", params=["v3", "v2"])
def checkpoint(request, tmp_path_factory):
    cfg = tiny_v3_config() if request.param == "v3" else tiny_v2_config()
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), cfg, seed=3)
    return path, cfg


@pytest.fixture(params=["gemms by size", "every gemm packed"])
def gemms(request, monkeypatch):
    """The cpu backend's packed GEMM path (backends/cpu/linear.py) is taken from a size these tiny
    shapes never reach; the second run forces it on every GEMM."""
    if request.param == "every gemm packed":
        monkeypatch.setattr(packed_linear, "PACKED_MIN_MACS", 0)


def _load(path, **kw):
    return FlashCausalDeepseekV2.load(path, get_backend("cpu"), torch.float32, progress=False, **kw)


def test_prefill_then_paged_decode_matches_transformers(checkpoint, gemms):
    path, cfg = checkpoint
    hf = load_hf_model(path)
    model = _load(path, num_mtp_modules=0)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
    runner = PagedRunner(model, num_blocks=48, block_size=4, max_tokens_per_seq=max(PROMPT_LENS) + DECODE_STEPS + 4, num_seqs=4)

    logits = runner.step(seqs, all_rows=True).logits
    expected = torch.cat([hf_logits(hf, s) for s in seqs])
    assert (logits - expected).abs().max().item() <= ATOL

    for _ in range(DECODE_STEPS):
        new = [[int(rng.integers(0, cfg.vocab_size))] for _ in seqs]
        logits = runner.step(new).logits
        seqs = [s + n for s, n in zip(seqs, new)]
        expected = torch.stack([hf_logits(hf, s)[-1] for s in seqs])
        assert (logits - expected).abs().max().item() <= ATOL


def test_multi_token_step_over_cache_matches_transformers(checkpoint, gemms):
    """q_len > 1 with cached context (the shape of MTP verification), ragged per sequence."""
    path, cfg = checkpoint
    hf = load_hf_model(path)
    model = _load(path, num_mtp_modules=0)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
    runner = PagedRunner(model, num_blocks=48, block_size=4, max_tokens_per_seq=max(PROMPT_LENS) + 8, num_seqs=4)
    runner.step(seqs)
    new = [rng.integers(0, cfg.vocab_size, q).tolist() for q in (3, 1, 4, 2)]
    logits = runner.step(new, all_rows=True).logits
    expected = torch.cat([hf_logits(hf, s + n)[-len(n):] for s, n in zip(seqs, new)])
    assert (logits - expected).abs().max().item() <= ATOL


def test_hidden_states_are_final_normed(checkpoint):
    from tests.support.hf_reference import main_hidden_reference

    path, cfg = checkpoint
    hf = load_hf_model(path)
    model = _load(path, num_mtp_modules=0)
    seq = list(range(7))
    runner = PagedRunner(model, num_blocks=8, block_size=4, max_tokens_per_seq=8, num_seqs=1)
    out = runner.step([seq], all_rows=True)
    assert (out.hidden_states - main_hidden_reference(hf, seq)).abs().max().item() <= ATOL
