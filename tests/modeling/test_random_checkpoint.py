"""A random-weights checkpoint (config.json + random_weights.json) loads like a safetensors one:
shapes are checked against the model, values are reproducible per tensor, and the published
shapes have the published parameter counts."""
import json

import pytest
import torch

from mindspec.bench.model_shapes import SHAPES, parameter_count, shape_config, write_shape_checkpoint
from mindspec.modeling.errors import NotACheckpointError, ShapeMismatchError
from mindspec.modeling.loader import checkpoint_keys, load_checkpoint
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.modeling.random_checkpoint import MANIFEST, RandomWeights, write_manifest
from mindspec.models.deepseekv2.config import DeepseekV2Config
from mindspec.models.deepseekv2.weights import model_specs
from tests.support.checkpoints import tiny_v3_config


def _tiny_random(tmp_path, seed=0, generator="device", **overrides):
    cfg = tiny_v3_config(num_nextn_predict_layers=1, **overrides)
    cfg.save_pretrained(tmp_path)
    specs = model_specs(DeepseekV2Config.from_model_dir(tmp_path), 1)
    write_manifest(tmp_path, {n: s.shape for n, s in specs.items()}, seed, generator=generator)
    return tmp_path, specs


def test_loads_every_tensor_with_its_shape_and_reproducible_values(tmp_path):
    path, specs = _tiny_random(tmp_path)
    a = load_checkpoint(path, specs, torch.float32, progress=False)
    b = load_checkpoint(path, specs, torch.float32, progress=False)
    assert set(a) == set(specs) == checkpoint_keys(path)
    assert all(tuple(a[n].shape) == s.shape for n, s in specs.items())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))
    q = a["model.layers.0.self_attn.q_a_proj.weight"]
    assert abs(q.std().item() - 0.02) < 0.004  # initializer_range
    assert not torch.equal(q, a["model.layers.1.self_attn.q_a_proj.weight"][: q.shape[0], : q.shape[1]])


def test_a_tensor_keeps_its_values_whatever_else_is_loaded(tmp_path):
    path, specs = _tiny_random(tmp_path, seed=3)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    alone = RandomWeights(path / MANIFEST).get_tensor(name)
    assert torch.equal(alone, load_checkpoint(path, specs, torch.float32, progress=False)[name])
    (tmp_path / "other").mkdir()
    other, _ = _tiny_random(tmp_path / "other", seed=4)
    assert not torch.equal(alone, RandomWeights(other / MANIFEST).get_tensor(name))


def test_the_cpu_generator_gives_every_device_the_cpu_values(tmp_path):
    """``generator: "cpu"`` draws on the CPU and copies to the load device (here "meta", where no
    generator exists): the values a cpu-backend run gets, whatever device loads them."""
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    path, _ = _tiny_random(tmp_path, generator="cpu")
    on_cpu = RandomWeights(path / MANIFEST).get_tensor(name)
    assert RandomWeights(path / MANIFEST, device="meta").get_tensor(name).device.type == "meta"
    (tmp_path / "default").mkdir()
    default, _ = _tiny_random(tmp_path / "default")
    assert torch.equal(on_cpu, RandomWeights(default / MANIFEST).get_tensor(name))  # on a CPU both draw alike
    with pytest.raises(RuntimeError):
        RandomWeights(default / MANIFEST, device="meta").get_tensor(name)  # "device" draws where it loads
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "generator": "gpu"}))
    with pytest.raises(NotACheckpointError, match="generator"):
        RandomWeights(path / MANIFEST)


def test_a_shape_that_does_not_fit_the_model_is_named(tmp_path):
    path, specs = _tiny_random(tmp_path)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["tensors"]["model.norm.weight"] = [7]
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShapeMismatchError, match="model.norm.weight"):
        load_checkpoint(path, specs, torch.float32, progress=False)
    (path / MANIFEST).write_text("{}")
    with pytest.raises(NotACheckpointError, match="random-weights manifest"):
        load_checkpoint(path, specs, torch.float32, progress=False)


def test_the_model_runs_from_a_random_checkpoint(tmp_path):
    path, _ = _tiny_random(tmp_path)
    wrapper = ModelWrapper(path, backend="cpu", dtype="float32", num_mtp_modules=1, progress=False)
    assert wrapper.model.num_mtp_modules == 1


def test_published_shapes_have_their_published_sizes(tmp_path):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tokenizer / f).write_bytes((_shipped() / f).read_bytes())
    lite = parameter_count(write_shape_checkpoint("deepseek-v2-lite", tmp_path / "lite", tokenizer))
    v3 = parameter_count(write_shape_checkpoint("deepseek-v3", tmp_path / "v3", tokenizer))
    # V2-Lite: 15.7B; V3: 671B + its 14B MTP module; here V2-Lite also carries one MTP module of its width.
    assert 15.7e9 < lite < 16.8e9 and 684e9 < v3 < 686e9
    sliced = write_shape_checkpoint("deepseek-v3", tmp_path / "v3s", tokenizer, num_layers=4)
    config = json.loads((sliced / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["first_k_dense_replace"] == 3
    with pytest.raises(ValueError, match="1..27"):
        shape_config("deepseek-v2-lite", 40)
    with pytest.raises(ValueError, match="unknown model shape"):
        shape_config("llama", None)
    assert set(SHAPES) == {"deepseek-v2-lite", "deepseek-v3"}


def _shipped():
    from mindspec.config.defaults import default_model_dir

    return default_model_dir()
