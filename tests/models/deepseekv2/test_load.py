"""Loading real safetensors checkpoints into the model: dtypes, shards, MTP presence, errors."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from mindspec.backend import get_backend
from mindspec.modeling.errors import MissingTensorError, NotACheckpointError, ShapeMismatchError
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.models.deepseekv2.flash_causal_deepseekv2 import FlashCausalDeepseekV2
from tests.support.checkpoints import make_checkpoint, tiny_v3_config


def _load(path, **kw):
    return FlashCausalDeepseekV2.load(path, get_backend("cpu"), kw.pop("dtype", torch.float32), progress=False, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_router_bias_stays_fp32(tmp_path, dtype):
    path = make_checkpoint(tmp_path, tiny_v3_config(), seed=0)
    model = _load(path, dtype=dtype)
    assert model.embed.dtype == dtype and model.layers[1].mlp.experts.w13.dtype == dtype
    assert model.layers[1].mlp.correction_bias.dtype == torch.float32


def test_sharded_checkpoint_equals_single_file(tmp_path):
    single = _load(make_checkpoint(tmp_path / "a", tiny_v3_config(), seed=4))
    sharded = _load(make_checkpoint(tmp_path / "b", tiny_v3_config(), seed=4, max_shard_size="100KB"))
    assert torch.equal(single.layers[2].mlp.experts.w2, sharded.layers[2].mlp.experts.w2)
    assert torch.equal(single.mtp_modules[0].eh_proj.weight, sharded.mtp_modules[0].eh_proj.weight)


def test_checkpoint_without_mtp_tensors_loads_main_model(tmp_path):
    path = make_checkpoint(tmp_path, tiny_v3_config(), seed=0, num_mtp_modules=0)
    model = _load(path)
    assert model.num_mtp_modules == 0
    with pytest.raises(ValueError, match="MTP module"):
        _load(path, num_mtp_modules=1)


def _rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_checkpoint(tmp_path, tiny_v3_config(), seed=0)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        _load(path)


def test_wrong_shape_names_tensor_and_file(tmp_path):
    path = make_checkpoint(tmp_path, tiny_v3_config(), seed=0)
    _rewrite(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ShapeMismatchError, match=r"model\.norm\.weight.*model\.safetensors"):
        _load(path)


def test_not_a_checkpoint_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(NotACheckpointError, match="not a DeepSeek checkpoint"):
        ModelWrapper(tmp_path, backend="cpu", dtype="float32", progress=False)
