"""Block FP8 checkpoints (DeepSeek-V3/R1's published layout): the format, the loader's pairing of
weights with their scales, its errors, and a model loaded from one against the same weights
dequantized (transformers on the dequantized copy, mindspec's tokens with MTP on and off)."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mindspec import LLM, SamplingParams
from mindspec.modeling.errors import (
    CheckpointError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedCheckpointError,
)
from mindspec.modeling.fp8 import BlockFp8Format, dequantize, quantize
from mindspec.modeling.loader import WeightSpec, load_checkpoint
from tests.support.checkpoints import load_hf_model, make_block_fp8_checkpoint, make_checkpoint, tiny_v3_config
from tests.support.hf_reference import hf_logits

FMT = BlockFp8Format((4, 8))
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [4, 8]}


def test_dequantize_scales_each_block_by_its_own_scale():
    # 10 x 20 in 4 x 8 blocks: 3 x 3 scales, the last row and column of blocks partial.
    weight = torch.ones(10, 20).to(torch.float8_e4m3fn)
    scale = torch.arange(9, dtype=torch.float32).view(3, 3) + 1
    out = dequantize(weight, scale, FMT, torch.float32)
    rows, cols = torch.arange(10)[:, None] // 4, torch.arange(20)[None, :] // 8
    assert torch.equal(out, (rows * 3 + cols + 1).float())


def test_quantize_round_trip_is_within_e4m3_rounding():
    w = torch.randn(37, 50, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 50)
    q, scale = quantize(w, FMT)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (10, 7)
    back = dequantize(q, scale, FMT, torch.float32)
    per_elem_scale = scale.repeat_interleave(4, 0)[:37].repeat_interleave(8, 1)[:, :50]
    # e4m3 keeps 3 mantissa bits: half a unit in the last place is 2^-4 of a normal value; below
    # the smallest normal (2^-6) the spacing is 2^-9, so the error is at most 2^-10 there.
    bound = w.abs() * 2.0**-4 + per_elem_scale * 2.0**-10
    assert ((back - w).abs() <= bound + 1e-12).all()
    # every block's largest magnitude maps to e4m3's largest
    blocks = w.abs()[:36, :48].reshape(9, 4, 6, 8).amax(dim=(1, 3))
    assert torch.allclose(scale[:9, :6] * 448, blocks)


def _fp8_dir(tmp_path, quant=QUANT):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": quant}))
    return tmp_path


SPECS = {"w.weight": WeightSpec((10, 20)), "n.weight": WeightSpec((20,))}


def _parts():
    w = torch.randn(10, 20, generator=torch.Generator().manual_seed(1))
    q, s = quantize(w, FMT)
    return {"w.weight": q, "w.weight_scale_inv": s, "n.weight": torch.ones(20)}


@pytest.mark.parametrize("order", ["scale first", "weight first"])
def test_loader_pairs_weights_and_scales_across_shards(tmp_path, order):
    parts = _parts()
    first, second = ({"w.weight_scale_inv", "n.weight"}, {"w.weight"})
    if order == "weight first":
        first, second = second, first
    _fp8_dir(tmp_path)
    save_file({k: parts[k] for k in first}, str(tmp_path / "a.safetensors"))
    save_file({k: parts[k] for k in second}, str(tmp_path / "b.safetensors"))
    for dtype in (torch.float32, torch.bfloat16):
        out = load_checkpoint(tmp_path, SPECS, dtype, progress=False)
        assert set(out) == set(SPECS) and out["w.weight"].dtype == dtype
        expected = dequantize(parts["w.weight"], parts["w.weight_scale_inv"], FMT, dtype)
        assert torch.equal(out["w.weight"], expected)


def _load(tmp_path, tensors, quant=QUANT):
    _fp8_dir(tmp_path, quant)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)


def test_one_clear_error_per_malformed_fp8_checkpoint(tmp_path):
    parts = _parts()
    no_scale = {k: v for k, v in parts.items() if k != "w.weight_scale_inv"}
    with pytest.raises(MissingTensorError, match=r"FP8 tensor 'w\.weight' in model\.safetensors has no 'w\.weight_scale_inv'"):
        _load(tmp_path, no_scale)
    with pytest.raises(ShapeMismatchError, match=r"'w\.weight_scale_inv'.*shape \[2, 3\], expected \[3, 3\].*\[4, 8\] blocks"):
        _load(tmp_path, {**parts, "w.weight_scale_inv": torch.ones(2, 3)})
    with pytest.raises(CheckpointError, match=r"'n\.weight'.*is not FP8 but has a 'n\.weight_scale_inv'"):
        _load(tmp_path, {**parts, "n.weight_scale_inv": torch.ones(1, 3)})
    with pytest.raises(UnexpectedTensorError, match=r"'x\.weight_scale_inv'.*no weight 'x\.weight'"):
        _load(tmp_path, {**parts, "x.weight_scale_inv": torch.ones(1)})
    with pytest.raises(UnsupportedCheckpointError, match=r"'w\.weight'.*F8_E5M2: only F8_E4M3"):
        _load(tmp_path, {**parts, "w.weight": parts["w.weight"].to(torch.float8_e5m2)})


@pytest.mark.parametrize("quant, field", [
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({**QUANT, "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({**QUANT, "weight_block_size": None}, "weight_block_size"),
    ({**QUANT, "weight_block_size": [128, 0]}, "weight_block_size"),
    ("fp8", "quantization_config must be an object"),
])
def test_unsupported_quantization_configs_name_the_field(tmp_path, quant, field):
    with pytest.raises(UnsupportedCheckpointError, match=field):
        _load(tmp_path, _parts(), quant)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny V3 (MoE layers, two MTP modules) in the published FP8 layout with 16 x 16 blocks, so
    most weights span several blocks at these widths, and its dequantized float32 twin."""
    cfg = tiny_v3_config(num_nextn_predict_layers=2)
    src = make_checkpoint(tmp_path_factory.mktemp("bf"), cfg, seed=5)
    fp8, ref = make_block_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8") / "model", block=(16, 16))
    return fp8, ref, cfg


def test_fp8_checkpoint_holds_fp8_weights_in_the_published_layout(fp8_checkpoint):
    fp8, _, _ = fp8_checkpoint
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    scaled = {k[: -len("_scale_inv")] for k in index if k.endswith("_scale_inv")}
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in scaled
    assert "model.layers.2.self_attn.kv_b_proj.weight" in scaled  # an MTP block's projection
    assert "model.embed_tokens.weight" not in scaled and "lm_head.weight" not in scaled
    assert all(index[w] != index[w + "_scale_inv"] for w in scaled)


def test_model_from_fp8_equals_transformers_on_the_dequantized_weights(fp8_checkpoint):
    """The same weights (the FP8 values times their scales, exact in float32): logits agree to
    float32 rounding of different operation orders, as for any checkpoint (test_hf_parity.py)."""
    fp8, ref, cfg = fp8_checkpoint
    llm = LLM(model=str(fp8), dtype="float32", progress=False, cache_block_size=4, num_blocks=64)
    hf = load_hf_model(ref)
    prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, 9).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1))[0]
    expected = hf_logits(hf, prompt + out.token_ids[:-1])[len(prompt) - 1 :]
    assert out.token_ids == expected.argmax(-1).tolist()
    chosen = torch.log_softmax(expected, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert np.allclose(out.logprobs, chosen.numpy(), atol=1e-4)  # the chosen tokens' log-probabilities


@pytest.mark.parametrize("mtp_mode", [None, "eagle", "vanilla"])
def test_fp8_and_dequantized_checkpoints_give_the_same_tokens(fp8_checkpoint, mtp_mode):
    fp8, ref, cfg = fp8_checkpoint
    params = None if mtp_mode is None else {"plugin_type": "mtp", "mtp_mode": mtp_mode, "num_speculative_tokens": 2}
    prompts = [np.random.default_rng(n).integers(2, cfg.vocab_size, n).tolist() for n in (4, 11, 7)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = [LLM(model=str(p), dtype="float32", progress=False, cache_block_size=4, num_blocks=96,
                plugin_params=params).generate(prompts, greedy) for p in (fp8, ref)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def _routed_experts(model):
    blocks = [layer for layer in model.layers] + [m.block for m in model.mtp_modules]
    return [b.mlp.experts for b in blocks if hasattr(b.mlp, "experts")]


def test_cpu_keeps_fp8_weights_at_about_half_their_bf16_bytes(fp8_checkpoint):
    from mindspec.backend import get_backend
    from mindspec.backends.cpu.moe import QuantizedExpertWeights
    from mindspec.models.deepseekv2.flash_causal_deepseekv2 import FlashCausalDeepseekV2

    fp8, ref, _ = fp8_checkpoint
    cpu = get_backend("cpu")
    kept = _routed_experts(FlashCausalDeepseekV2.load(fp8, cpu, torch.bfloat16, progress=False))
    dense = _routed_experts(FlashCausalDeepseekV2.load(ref, cpu, torch.bfloat16, progress=False))
    assert len(kept) == 4 and all(isinstance(e, QuantizedExpertWeights) for e in kept)  # 2 MoE layers + 2 MTP blocks
    assert all(e.w13.weight.dtype == torch.float8_e4m3fn for e in kept)
    fp8_bytes = sum(e.w13.nbytes + e.w2.nbytes for e in kept)
    bf16_bytes = sum(e.w13.numel() * 2 + e.w2.numel() * 2 for e in dense)
    # 1 byte per weight + a float32 scale per 16 x 16 block (4 / 256 bytes per weight): 0.508x
    assert fp8_bytes / bf16_bytes <= 0.51
    # the whole model, whose embedding, lm_head, norms and kv_b_proj stay bf16 (the published layout)
    from mindspec.bench.memory import resident_weight_bytes

    whole = resident_weight_bytes(FlashCausalDeepseekV2.load(fp8, cpu, torch.bfloat16, progress=False))
    assert whole / resident_weight_bytes(FlashCausalDeepseekV2.load(ref, cpu, torch.bfloat16, progress=False)) <= 0.55
    # dequantized at load instead where the backend does not run FP8 experts, or when not asked to
    again = FlashCausalDeepseekV2.load(fp8, cpu, torch.bfloat16, progress=False, keep_quantized=False)
    assert not any(isinstance(e, QuantizedExpertWeights) for e in _routed_experts(again))


def test_compiled_cpu_steps_get_dequantized_experts(fp8_checkpoint):
    """Compiled packages bake the weights in: with decode_graphs the experts are dense."""
    from mindspec.backends.cpu.moe import QuantizedExpertWeights
    from mindspec.modeling.model_wrapper import ModelWrapper

    fp8, _, _ = fp8_checkpoint
    wrapper = ModelWrapper(fp8, "cpu", "float32", num_mtp_modules=0, progress=False, decode_graphs=True)
    assert wrapper.compiled is not None
    assert not any(isinstance(e, QuantizedExpertWeights) for e in _routed_experts(wrapper.model))


@pytest.mark.parametrize("rows", [(6, 10), (8, 10), (10, 6)])
def test_cat_rows_keeps_fp8_and_its_values_whatever_the_block_alignment(rows):
    """Gate and up projections concatenated: aligned parts keep their block scales, others get a
    scale per row; either way the dequantized result is the two dequantized parts stacked."""
    from mindspec.modeling.fp8 import Fp8Weight, cat_rows

    gen = torch.Generator().manual_seed(2)
    parts = [Fp8Weight(*quantize(torch.randn(n, 20, generator=gen), FMT), FMT, torch.float32) for n in rows]
    joined = cat_rows(parts)
    assert isinstance(joined, Fp8Weight) and joined.weight.dtype == torch.float8_e4m3fn
    assert joined.format.block == ((4, 8) if rows[0] % 4 == 0 else (1, 8))
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_mindspec_convert_writes_a_block_fp8_checkpoint_that_loads(tmp_path, fp8_checkpoint):
    """`mindspec convert SRC DST --to fp8` on the shipped model: projections FP8 beside their
    scales, the rest unchanged, tokenizer and Medusa heads copied; it serves the same prompts with
    MTP (the shipped model's 96-row expert gates in 128-row blocks keep FP8 with per-row scales)."""
    from mindspec.cli import main
    from mindspec.config.defaults import default_model_dir
    from mindspec.modeling.loader import checkpoint_keys

    src, dst = default_model_dir(), tmp_path / "fp8"
    assert main(["convert", str(src), str(dst), "--to", "fp8"]) == 0
    keys = checkpoint_keys(dst)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv" in keys
    assert "model.embed_tokens.weight_scale_inv" not in keys
    assert (dst / "tokenizer.json").is_file() and (dst / "medusa_lm_head.safetensors").is_file()
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert main(["convert", str(src), str(dst)]) == 2  # not empty: one error, nothing overwritten
    assert main(["convert", str(src), str(tmp_path / "x"), "--block", "128"]) == 2
    mtp = {"plugin_type": "mtp", "num_speculative_tokens": 3}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with_mtp = LLM(model=str(dst), dtype="float32", progress=False, plugin_params=mtp).generate(["def fib(n):"], greedy)
    without = LLM(model=str(dst), dtype="float32", progress=False).generate(["def fib(n):"], greedy)
    assert with_mtp[0].token_ids == without[0].token_ids and with_mtp[0].spec_decode.num_accepted_tokens > 0
