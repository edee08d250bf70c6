import math

import pytest
import torch

import op_references as ref
from mindspec.backend import RotaryEmbedding
from mindspec.backends.cpu import CpuBackend
from mindspec.modeling.rotary import build_rotary, rope_parameters, softmax_scale, yarn_get_mscale

YARN_V3 = {
    "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}
YARN_V2 = dict(YARN_V3, mscale=0.707, mscale_all_dim=0.707)


@pytest.mark.parametrize("attention_factor", [1.0, 1.25])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_rope_matches_complex_formula(attention_factor, dtype, atol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 7, 100, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    rot = RotaryEmbedding(inv_freq=inv_freq, attention_factor=attention_factor)
    out = CpuBackend().rope(x, positions, rot)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref.rope(x, positions, inv_freq, attention_factor), atol=atol, rtol=atol)


def _hf_yarn(config):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["yarn"](config)


@pytest.mark.parametrize("scaling", [YARN_V3, YARN_V2, dict(YARN_V3, factor=None), {"type": "yarn", "factor": 8},
                                     dict(YARN_V3, truncate=False, beta_fast=16, beta_slow=2)])
def test_yarn_matches_transformers_legacy_spelling(scaling):
    from transformers import DeepseekV3Config

    hf = {"rope_scaling": dict(scaling), "rope_theta": 10000.0, "max_position_embeddings": 163840}
    config = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840,
                              rope_scaling=dict(scaling), rope_theta=10000.0)
    inv_freq, factor = _hf_yarn(config)
    rot = build_rotary(64, rope_parameters(hf), 163840)
    assert rot.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rot.inv_freq, inv_freq, atol=0, rtol=0)
    assert rot.attention_factor == pytest.approx(factor, abs=1e-12)


def test_yarn_matches_transformers_new_spelling():
    from transformers import DeepseekV2Config

    params = dict(YARN_V2, rope_type="yarn", rope_theta=50000.0)
    params.pop("type")
    config = DeepseekV2Config(qk_rope_head_dim=32, max_position_embeddings=8192, rope_parameters=dict(params))
    inv_freq, factor = _hf_yarn(config)
    normalised = rope_parameters({"rope_parameters": params, "max_position_embeddings": 8192})
    assert normalised["rope_type"] == "yarn" and normalised["rope_theta"] == 50000.0
    rot = build_rotary(32, normalised, 8192)
    torch.testing.assert_close(rot.inv_freq, inv_freq, atol=0, rtol=0)
    assert rot.attention_factor == pytest.approx(factor)


def test_yarn_mscale_ratio_and_explicit_attention_factor():
    p = rope_parameters({"rope_scaling": dict(YARN_V3, mscale=1.0, mscale_all_dim=0.5)})
    expected = yarn_get_mscale(40, 1.0) / yarn_get_mscale(40, 0.5)
    assert build_rotary(64, p, 163840).attention_factor == pytest.approx(expected)
    p = rope_parameters({"rope_scaling": dict(YARN_V3, attention_factor=0.75)})
    assert build_rotary(64, p, 163840).attention_factor == 0.75


@pytest.mark.parametrize("hf", [{"rope_theta": 10000.0}, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                                {"rope_scaling": None, "rope_theta": 10000.0}, {}])
def test_default_rope_matches_transformers(hf):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    inv_freq, factor = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(config)
    params = rope_parameters(hf)
    assert params["rope_type"] == "default"
    rot = build_rotary(64, params, 4096)
    torch.testing.assert_close(rot.inv_freq, inv_freq, atol=0, rtol=0)
    assert rot.attention_factor == factor == 1.0
    assert softmax_scale(192, params) == pytest.approx(192 ** -0.5)


def test_softmax_scale_values():
    v3 = rope_parameters({"rope_scaling": YARN_V3, "rope_theta": 10000})
    v2 = rope_parameters({"rope_parameters": dict(YARN_V2, rope_theta=10000)})
    assert softmax_scale(192, v3) == pytest.approx(0.135234, abs=1e-6)
    assert softmax_scale(192, v2) == pytest.approx(0.114721, abs=1e-6)
    assert softmax_scale(192, dict(v3, mscale_all_dim=0)) == pytest.approx(192 ** -0.5)


def test_softmax_scale_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for scaling in (YARN_V3, YARN_V2):
        hf_params = dict(scaling, rope_type="yarn", rope_theta=10000.0)
        assert softmax_scale(192, rope_parameters({"rope_parameters": hf_params})) == pytest.approx(
            yarn_apply_mscale(hf_params, 192 ** -0.5), rel=1e-12)


def test_yarn_get_mscale():
    assert yarn_get_mscale(1.0, 1.0) == 1.0
    assert yarn_get_mscale(40, 1.0) == pytest.approx(0.1 * math.log(40) + 1)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "llama3"])
def test_unknown_rope_type_is_rejected(kind):
    with pytest.raises(ValueError, match=kind):
        rope_parameters({"rope_scaling": {"type": kind, "factor": 2.0}})
    with pytest.raises(ValueError, match=kind):
        rope_parameters({"rope_parameters": {"rope_type": kind, "factor": 2.0, "rope_theta": 1e4}})


def test_rope_rows_are_reused_only_for_the_same_positions_tensor():
    """The cos/sin rows are derived once per positions tensor (every layer of a forward passes
    the same one); a new tensor, even of the same shape, gets its own rows."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    rot = RotaryEmbedding(inv_freq=inv_freq, attention_factor=1.0)
    rot.build_cache(64)
    be = CpuBackend()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    for positions in (torch.tensor([0, 5]), torch.tensor([7, 9]), torch.tensor([7, 9])):
        for _ in range(2):
            out = be.rope(x, positions, rot)
            torch.testing.assert_close(out.double(), ref.rope(x, positions, inv_freq, 1.0), atol=1e-5, rtol=1e-5)
    other = RotaryEmbedding(inv_freq=inv_freq, attention_factor=1.25)
    torch.testing.assert_close(be.rope(x, positions, other).double(), ref.rope(x, positions, inv_freq, 1.25),
                               atol=1e-5, rtol=1e-5)


def test_rope_rows_are_built_on_the_device_of_x():
    """The npu backend composes this op on its device's tensors through a CpuBackend(): the rows
    must follow x, not the backend's own device (the meta device stands in for another one)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    rot = RotaryEmbedding(inv_freq=inv_freq.to("meta"), attention_factor=1.0)
    out = CpuBackend().rope(torch.randn(2, 3, 8, device="meta"), torch.tensor([0, 5]), rot)
    assert out.device.type == "meta" and out.shape == (2, 3, 8)


def test_a_positions_buffer_refilled_for_the_next_forward_is_read_again():
    """Every layer of one forward reuses the rotation of its positions tensor; a static buffer
    (graph_runner.py) is the same tensor in the next forward with new values: ``prepare``, which
    starts a forward, forgets the rotation."""
    from mindspec.backend import AttentionMetadata

    be = CpuBackend()
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    rot = RotaryEmbedding(inv_freq=inv_freq, attention_factor=1.0)
    positions = torch.tensor([0, 1, 2])
    be.rope(x, positions, rot)
    positions.copy_(torch.tensor([5, 9, 40]))
    meta = AttentionMetadata(slots=torch.zeros(3, dtype=torch.long), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             seq_lens=torch.tensor([3], dtype=torch.int32), q_lens=torch.tensor([3], dtype=torch.int32),
                             q_start_loc=torch.tensor([0, 3], dtype=torch.int32), seq_lens_host=[3], q_lens_host=[3],
                             is_prefill=True, block_size=4)
    be.prepare(meta)
    torch.testing.assert_close(be.rope(x, positions, rot).double(), ref.rope(x, positions, inv_freq, 1.0),
                               atol=1e-5, rtol=1e-5)
