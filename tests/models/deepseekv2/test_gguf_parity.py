"""A model loaded from GGUF against references.

- Exact: with its weights kept quantized (each GEMM dequantizes its weight per call) the model
  equals transformers on the same file's weights dequantized into a safetensors copy, for every
  type mindspec keeps quantized, on a tiny model whose rows split into 256-wide k-quant blocks.
- Float files (F32, BF16, F16) of the shipped bf16 model hold its values exactly: identical
  greedy tokens to the safetensors checkpoint.
- Quantized files of the shipped model: the logits' error against the safetensors model is
  judged against noise of the same size. To first order a quantized weight is the weight plus an
  error of the format's RMS, so the logits move about as far as under Gaussian noise of that RMS
  added to each weight; a format (or a loader bug) that did worse than twice that fails.
"""
import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mindspec import LLM, SamplingParams
from mindspec.backend import get_backend
from mindspec.bench.corpus import heldout_prompts
from mindspec.config.defaults import DEFAULT_MODEL_DIR
from mindspec.modeling.gguf_convert import convert_from_gguf, convert_to_gguf
from mindspec.modeling.gguf_quants import GgufWeight
from mindspec.models.deepseekv2.flash_causal_deepseekv2 import FlashCausalDeepseekV2
from tests.models.deepseekv2.harness import PagedRunner
from tests.support.checkpoints import load_hf_model
from tests.support.gguf_files import k_quant_config, make_model_with_tokenizer
from tests.support.hf_reference import hf_logits

KEPT = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]


@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    cfg = k_quant_config()
    return make_model_with_tokenizer(tmp_path_factory.mktemp("k") / "src", cfg, seed=3), cfg


def _logits(path, prompt, **load):
    model = FlashCausalDeepseekV2.load(path, get_backend("cpu"), torch.float32, progress=False, **load)
    runner = PagedRunner(model, num_blocks=16, block_size=8, max_tokens_per_seq=len(prompt), num_seqs=1)
    return runner.step([prompt], all_rows=True).logits, model


@pytest.mark.parametrize("qtype", KEPT)
def test_kept_quantized_model_equals_transformers_on_its_dequantized_weights(k_model, tmp_path, qtype):
    src, cfg = k_model
    gguf = convert_to_gguf(src, tmp_path / f"m-{qtype}.gguf", qtype)[0]
    prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, 10).tolist()
    logits, model = _logits(gguf, prompt, num_mtp_modules=0)
    assert isinstance(model.layers[1].self_attn.o_proj.weight, GgufWeight)  # kept quantized, not dequantized at load
    assert model.layers[1].self_attn.o_proj.weight.qtype.name.lower() == qtype
    expected = hf_logits(load_hf_model(convert_from_gguf(gguf, tmp_path / "dequantized", torch.float32)), prompt)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    out = tmp_path_factory.mktemp("shipped")
    files = {t: convert_to_gguf(DEFAULT_MODEL_DIR, out / f"shipped-{t}.gguf", t)[0]
             for t in ("f32", "bf16", "f16", "q8_0", "q5_0", "q4_0", "q4_k")}
    return files, out


def _heldout(count=4, length=48):
    from transformers import AutoTokenizer

    return heldout_prompts(AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)), count, length)


@pytest.mark.parametrize("qtype", ["f32", "bf16", "f16"])
def test_float_ggufs_give_the_safetensors_models_greedy_tokens(shipped, qtype):
    prompts = _heldout()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = [[o.token_ids for o in LLM(model=str(m), dtype="float32", progress=False).generate(prompts, greedy)]
            for m in (DEFAULT_MODEL_DIR, shipped[0][qtype])]
    assert runs[0] == runs[1]


def _noise_like(reference: dict, quantized: dict, seed: int) -> dict:
    """Each quantized weight's error replaced by Gaussian noise of the same RMS."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in reference.items():
        q = quantized[name].float()
        rms = (q - w.float()).pow(2).mean().sqrt()
        out[name] = w.float() + torch.randn(w.shape, generator=gen) * rms
    return out


@pytest.mark.parametrize("qtype", ["q8_0", "q5_0", "q4_0", "q4_k"])
def test_quantized_logits_err_about_as_much_as_noise_of_the_formats_rms(shipped, qtype):
    files, out = shipped
    prompts = _heldout(count=3, length=40)
    hf = load_hf_model(DEFAULT_MODEL_DIR)
    reference = [hf_logits(hf, p) for p in prompts]
    dense = load_file(str(convert_from_gguf(files[qtype], out / f"deq-{qtype}", torch.float32) / "model.safetensors"))
    original = {k: v for k, v in hf.state_dict().items() if k in dense and v.dim() > 1}
    noisy = copy.deepcopy(hf)
    noisy.load_state_dict(_noise_like(original, dense, seed=0), strict=False)
    for prompt, ref in zip(prompts, reference):
        logits, _ = _logits(files[qtype], prompt, num_mtp_modules=0)
        err = (logits - ref).norm() / ref.norm()
        noise_err = (hf_logits(noisy, prompt) - ref).norm() / ref.norm()
        assert err <= 2 * noise_err, f"{qtype}: logits off by {err:.4f} against {noise_err:.4f} under noise"


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_mtp_from_a_quantized_gguf_is_lossless(shipped, mode):
    """The MTP modules travel as nextn layers; speculation over the quantized model gives its own
    greedy tokens."""
    gguf = shipped[0]["q8_0"]
    prompts = _heldout(count=3, length=32)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": mode}
    plain = LLM(model=str(gguf), dtype="float32", progress=False).generate(prompts, greedy)
    spec = LLM(model=str(gguf), dtype="float32", progress=False, plugin_params=params).generate(prompts, greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.spec_decode.num_accepted_tokens for o in spec) > 0
