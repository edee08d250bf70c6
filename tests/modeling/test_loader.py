"""The safetensors loader on hand-written checkpoints: layouts, dtypes and every named error."""
import json

import pytest
import torch
from safetensors.torch import save_file

from mindspec.modeling.errors import (
    CheckpointError, MissingTensorError, NotACheckpointError, ShapeMismatchError, UnexpectedTensorError,
    UnsupportedCheckpointError,
)
from mindspec.modeling.loader import WeightSpec, checkpoint_keys, load_checkpoint, read_hf_config

SPECS = {"a.weight": WeightSpec((2, 3)), "b.bias": WeightSpec((4,), keep_dtype=True), "c": WeightSpec((1,), optional=True)}


def _dir(tmp_path, model_type="deepseek_v3"):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return tmp_path


def _tensors():
    return {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(4)}


def test_single_file_dtypes(tmp_path):
    save_file(_tensors(), str(_dir(tmp_path) / "model.safetensors"))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = load_checkpoint(tmp_path, SPECS, dtype, progress=False)
        assert out["a.weight"].dtype == dtype and out["b.bias"].dtype == torch.float32
        assert torch.equal(out["a.weight"].float(), torch.arange(6.0).view(2, 3))
    assert checkpoint_keys(tmp_path) == {"a.weight", "b.bias"}


def test_sharded_with_index(tmp_path):
    _dir(tmp_path)
    save_file({"a.weight": torch.zeros(2, 3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.bias": torch.ones(4)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)) == {"a.weight", "b.bias"}
    assert checkpoint_keys(tmp_path) == {"a.weight", "b.bias"}
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(NotACheckpointError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)


def test_errors_name_tensor_and_file(tmp_path):
    _dir(tmp_path)
    save_file({"a.weight": torch.zeros(3, 3), "b.bias": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ShapeMismatchError, match=r"'a\.weight' in model\.safetensors has shape \[3, 3\], expected \[2, 3\]"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    save_file({**_tensors(), "zzz": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnexpectedTensorError, match="'zzz' in model.safetensors"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    assert "zzz" not in load_checkpoint(tmp_path, SPECS, torch.float32, ignore=("z+",), progress=False)
    save_file({"a.weight": torch.zeros(2, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingTensorError, match="lacks tensor 'b.bias'"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)


def test_fp8_and_duplicates(tmp_path):
    _dir(tmp_path)
    save_file({**_tensors(), "a.weight_scale_inv": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match="FP8"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    save_file({"a.weight": torch.zeros(2, 3)}, str(tmp_path / "model2.safetensors"))
    with pytest.raises(CheckpointError, match="both model.safetensors and model2.safetensors"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(NotACheckpointError, match="does not exist"):
        read_hf_config(tmp_path / "nope")
    with pytest.raises(NotACheckpointError, match="no config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(NotACheckpointError, match="not valid JSON"):
        read_hf_config(tmp_path)
    _dir(tmp_path, "llama")
    with pytest.raises(NotACheckpointError, match="model_type 'llama'"):
        read_hf_config(tmp_path)
    _dir(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(NotACheckpointError, match="only safetensors"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(tmp_path, SPECS, torch.int8, progress=False)
