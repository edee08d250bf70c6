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


def test_sharded_values_dtypes_and_optional(tmp_path):
    _dir(tmp_path)
    save_file({"a.weight": torch.arange(6.0).view(2, 3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.bias": torch.full((4,), 0.1), "c": torch.ones(1)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors",
                            "c": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    out = load_checkpoint(tmp_path, SPECS, torch.bfloat16, progress=False)
    assert out["a.weight"].dtype == torch.bfloat16 and torch.equal(out["a.weight"].float(), torch.arange(6.0).view(2, 3))
    # keep_dtype: float32 and exact, not rounded through bf16
    assert out["b.bias"].dtype == torch.float32 and torch.equal(out["b.bias"], torch.full((4,), 0.1))
    assert out["c"].dtype == torch.bfloat16  # an optional tensor loads when present
    # an unindexed stray file next to an index is not read
    save_file({"zzz": torch.ones(1)}, str(tmp_path / "stray.safetensors"))
    assert set(load_checkpoint(tmp_path, SPECS, torch.float16, progress=False)) == {"a.weight", "b.bias", "c"}


def test_missing_lists_others_and_names_dir(tmp_path):
    _dir(tmp_path)
    save_file({"x": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    specs = {"x": WeightSpec((1,))} | {f"w{i}": WeightSpec((1,)) for i in range(8)}
    with pytest.raises(MissingTensorError) as info:
        load_checkpoint(tmp_path, specs, torch.float32, progress=False)
    msg = str(info.value)
    assert "'w0'" in msg and "7 more" in msg and "w5" in msg and "w6" not in msg and str(tmp_path) in msg


def test_fp8_dtype_tensor(tmp_path):
    _dir(tmp_path)
    save_file({**_tensors(), "c": torch.ones(1).to(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match=r"'c' in model\.safetensors is F8_E4M3 but config\.json has no FP8 quantization_config"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)


def test_empty_missing_and_bad_dirs(tmp_path):
    with pytest.raises(NotACheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)  # empty dir
    with pytest.raises(NotACheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", SPECS, torch.float32, progress=False)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotACheckpointError, match="not a directory"):
        read_hf_config(tmp_path / "file.txt")
    with pytest.raises(NotACheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "file.txt", SPECS, torch.float32, progress=False)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(NotACheckpointError, match="model.safetensors"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    assert read_hf_config(_dir(tmp_path, "deepseek_v2"))["model_type"] == "deepseek_v2"
    with pytest.raises(NotACheckpointError, match="model_type 'deepseek_v3'"):
        read_hf_config(_dir(tmp_path), supported_model_types=("deepseek_v2",))


def test_progress_bar_enabled(tmp_path, capsys):
    save_file(_tensors(), str(_dir(tmp_path) / "model.safetensors"))
    assert set(load_checkpoint(tmp_path, SPECS, torch.float32, progress=True)) == {"a.weight", "b.bias"}
    assert f"Loading {tmp_path.name}" in capsys.readouterr().err


# ---- supplementary checks -------------------------------------------------------------------

from mindspec.modeling.loader import find_checkpoint_files  # noqa: E402


def _shards(tmp_path, shards, index=True):
    """``shards``: {file name: {tensor name: tensor}}; writes them and (optionally) the index."""
    _dir(tmp_path)
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(tmp_path / fname))
        weight_map.update({k: fname for k in tensors})
    if index:
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_single_file_values_and_optional_absent(tmp_path, dtype):
    w = torch.tensor([[0.5, -1.25, 3.0], [2.0, 0.0, -0.75]])  # exact in every dtype
    bias = torch.tensor([0.1, 0.2, 0.3, 1e-8])  # not exact in bf16/fp16: keep_dtype must keep it
    save_file({"a.weight": w, "b.bias": bias}, str(_dir(tmp_path) / "model.safetensors"))
    out = load_checkpoint(tmp_path, SPECS, dtype, progress=False)
    assert set(out) == {"a.weight", "b.bias"}  # optional "c" is absent and not invented
    assert out["a.weight"].dtype == dtype and out["a.weight"].shape == (2, 3)
    assert torch.equal(out["a.weight"].float(), w)
    assert out["b.bias"].dtype == torch.float32 and torch.equal(out["b.bias"], bias)
    assert out["a.weight"].device.type == "cpu"


def test_keep_dtype_from_a_bf16_checkpoint_is_float32(tmp_path):
    bias = torch.tensor([1.5, -2.0, 0.25, 8.0], dtype=torch.bfloat16)
    save_file({"a.weight": torch.ones(2, 3, dtype=torch.bfloat16), "b.bias": bias},
              str(_dir(tmp_path) / "model.safetensors"))
    out = load_checkpoint(tmp_path, SPECS, torch.float16, progress=False)
    assert out["b.bias"].dtype == torch.float32 and torch.equal(out["b.bias"], bias.float())
    assert out["a.weight"].dtype == torch.float16


def test_sharded_loads_the_right_values(tmp_path):
    g = torch.Generator().manual_seed(0)
    specs = {f"layers.{i}.w": WeightSpec((3, 2)) for i in range(5)} | {"norm": WeightSpec((2,), keep_dtype=True)}
    values = {name: torch.randn(spec.shape, generator=g) for name, spec in specs.items()}
    _shards(tmp_path, {
        "model-00001-of-00003.safetensors": {k: values[k] for k in ("layers.0.w", "layers.3.w")},
        "model-00002-of-00003.safetensors": {k: values[k] for k in ("layers.1.w", "norm")},
        "model-00003-of-00003.safetensors": {k: values[k] for k in ("layers.2.w", "layers.4.w")},
    })
    out = load_checkpoint(tmp_path, specs, torch.float32, progress=False)
    assert set(out) == set(specs)
    for name, value in values.items():
        assert torch.equal(out[name], value), name
    files, weight_map = find_checkpoint_files(tmp_path)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert weight_map["norm"].name == "model-00002-of-00003.safetensors"
    assert checkpoint_keys(tmp_path) == set(specs)


def test_unindexed_multi_file_checkpoint_keys_and_load(tmp_path):
    _shards(tmp_path, {"part-a.safetensors": {"a.weight": torch.zeros(2, 3)},
                       "part-b.safetensors": {"b.bias": torch.ones(4), "c": torch.full((1,), 7.0)}}, index=False)
    files, weight_map = find_checkpoint_files(tmp_path)
    assert [f.name for f in files] == ["part-a.safetensors", "part-b.safetensors"] and weight_map == {}
    assert checkpoint_keys(tmp_path) == {"a.weight", "b.bias", "c"}
    out = load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    assert out["c"].item() == 7.0


def test_ignore_regexes_are_full_matches(tmp_path):
    save_file({**_tensors(), "model.layers.61.mtp.w": torch.ones(1), "model.layers.61.mtp.b": torch.ones(2),
               "rotary.inv_freq": torch.ones(3)}, str(_dir(tmp_path) / "model.safetensors"))
    ignore = (r"model\.layers\.61\..*", r".*\.inv_freq")
    out = load_checkpoint(tmp_path, SPECS, torch.float32, ignore=ignore, progress=False)
    assert set(out) == {"a.weight", "b.bias"}
    # a pattern matching only part of a name does not skip it
    with pytest.raises(UnexpectedTensorError, match="'rotary.inv_freq' in model.safetensors"):
        load_checkpoint(tmp_path, SPECS, torch.float32, ignore=(r"model\.layers\.61\..*", "inv_freq"), progress=False)
    # ignoring a required tensor makes it missing
    with pytest.raises(MissingTensorError, match="'a.weight'"):
        load_checkpoint(tmp_path, SPECS, torch.float32, ignore=ignore + (r"a\.weight",), progress=False)


def test_shape_mismatch_names_tensor_file_and_both_shapes_in_a_shard(tmp_path):
    _shards(tmp_path, {"model-00001-of-00002.safetensors": {"a.weight": torch.zeros(2, 3)},
                       "model-00002-of-00002.safetensors": {"b.bias": torch.ones(5)}})
    with pytest.raises(ShapeMismatchError) as info:
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    msg = str(info.value)
    assert "'b.bias'" in msg and "model-00002-of-00002.safetensors" in msg and "[5]" in msg and "[4]" in msg
    # an optional tensor still has to have the right shape when present
    _shards(tmp_path, {"model-00001-of-00002.safetensors": {"a.weight": torch.zeros(2, 3), "c": torch.ones(2)},
                       "model-00002-of-00002.safetensors": {"b.bias": torch.ones(4)}})
    with pytest.raises(ShapeMismatchError, match=r"'c' in model-00001-of-00002\.safetensors has shape \[2\], expected \[1\]"):
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)


def test_unexpected_tensor_in_a_shard_names_the_shard(tmp_path):
    _shards(tmp_path, {"model-00001-of-00002.safetensors": {"a.weight": torch.zeros(2, 3)},
                       "model-00002-of-00002.safetensors": {"b.bias": torch.ones(4), "extra.w": torch.ones(1)}})
    with pytest.raises(UnexpectedTensorError) as info:
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    assert "'extra.w'" in str(info.value) and "model-00002-of-00002.safetensors" in str(info.value)


def test_missing_required_tensor_is_named_and_is_a_checkpoint_error(tmp_path):
    save_file({"a.weight": torch.zeros(2, 3)}, str(_dir(tmp_path) / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    assert isinstance(info.value, MissingTensorError)
    assert "'b.bias'" in str(info.value) and "more" not in str(info.value) and "'c'" not in str(info.value)


def test_not_a_checkpoint_cases(tmp_path):
    cases = {}
    cases["missing"] = tmp_path / "does-not-exist"
    f = tmp_path / "weights.safetensors"
    save_file(_tensors(), str(f))
    cases["file"] = f
    for name, content in [("noconfig", None), ("badjson", "{not json"), ("list", "[1, 2]"),
                          ("llama", json.dumps({"model_type": "llama"})), ("notype", json.dumps({}))]:
        d = tmp_path / name
        d.mkdir()
        if content is not None:
            (d / "config.json").write_text(content)
        save_file(_tensors(), str(d / "model.safetensors"))
        cases[name] = d
    expected = {"missing": "does not exist", "file": "not a directory", "noconfig": "no config.json",
                "badjson": "not valid JSON", "list": "JSON object", "llama": "model_type 'llama'",
                "notype": "model_type None"}
    for name, match in expected.items():
        with pytest.raises(NotACheckpointError, match=match):
            read_hf_config(cases[name])
    assert read_hf_config(_dir(tmp_path / "noconfig"))["model_type"] == "deepseek_v3"


def test_config_but_no_weights(tmp_path):
    _dir(tmp_path)
    assert read_hf_config(tmp_path)["model_type"] == "deepseek_v3"
    for fn in (lambda: load_checkpoint(tmp_path, SPECS, torch.float32, progress=False),
               lambda: checkpoint_keys(tmp_path), lambda: find_checkpoint_files(tmp_path)):
        with pytest.raises(NotACheckpointError, match=r"no \*\.safetensors weight files") as info:
            fn()
        assert "only safetensors" not in str(info.value)


def test_only_pytorch_bin_mentions_safetensors(tmp_path):
    _dir(tmp_path)
    torch.save(_tensors(), tmp_path / "pytorch_model.bin")
    for fn in (lambda: load_checkpoint(tmp_path, SPECS, torch.float32, progress=False), lambda: checkpoint_keys(tmp_path)):
        with pytest.raises(NotACheckpointError) as info:
            fn()
        msg = str(info.value)
        assert "safetensors" in msg and "pytorch_model.bin" in msg


def test_index_problems(tmp_path):
    _shards(tmp_path, {"model-00001-of-00002.safetensors": {"a.weight": torch.zeros(2, 3)},
                       "model-00002-of-00002.safetensors": {"b.bias": torch.ones(4)}})
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    for fn in (lambda: load_checkpoint(tmp_path, SPECS, torch.float32, progress=False), lambda: checkpoint_keys(tmp_path)):
        with pytest.raises(NotACheckpointError, match="shard 'model-00001-of-00002.safetensors'"):
            fn()
    for bad in ("{oops", json.dumps({"metadata": {}}), json.dumps({"weight_map": ["a"]}), json.dumps([1])):
        (tmp_path / "model.safetensors.index.json").write_text(bad)
        with pytest.raises(NotACheckpointError, match="not a safetensors index"):
            checkpoint_keys(tmp_path)


def test_fp8_scale_keys_and_dtypes_are_unsupported(tmp_path):
    _dir(tmp_path)
    save_file({**_tensors(), "layers.0.weight_scale_inv": torch.ones(1, 1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match=r"'layers\.0\.weight_scale_inv' in model\.safetensors"):
        load_checkpoint(tmp_path, SPECS, torch.bfloat16, progress=False)
    # a scale key listed in the specs would still be an FP8 scale
    with pytest.raises(UnsupportedCheckpointError):
        load_checkpoint(tmp_path, SPECS | {"layers.0.weight_scale_inv": WeightSpec((1, 1))}, torch.bfloat16,
                        progress=False)
    for f8 in ("float8_e4m3fn", "float8_e5m2"):
        if not hasattr(torch, f8):
            continue
        save_file({"a.weight": torch.zeros(2, 3).to(getattr(torch, f8)), "b.bias": torch.ones(4)},
                  str(tmp_path / "model.safetensors"))
        with pytest.raises(UnsupportedCheckpointError, match=r"'a\.weight' in model\.safetensors is F8"):
            load_checkpoint(tmp_path, SPECS, torch.bfloat16, progress=False)
    assert issubclass(UnsupportedCheckpointError, CheckpointError)


def test_duplicate_key_across_shards_names_both_files(tmp_path):
    _shards(tmp_path, {"model-00001-of-00002.safetensors": {"a.weight": torch.zeros(2, 3), "b.bias": torch.ones(4)},
                       "model-00002-of-00002.safetensors": {"b.bias": torch.ones(4)}})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, SPECS, torch.float32, progress=False)
    msg = str(info.value)
    assert "'b.bias'" in msg and "model-00001-of-00002.safetensors" in msg and "model-00002-of-00002.safetensors" in msg


def test_error_hierarchy():
    for cls in (NotACheckpointError, MissingTensorError, UnexpectedTensorError, ShapeMismatchError,
                UnsupportedCheckpointError):
        assert issubclass(cls, CheckpointError)
