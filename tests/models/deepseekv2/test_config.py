import json

import pytest

from mindspec.models.deepseekv2.config import DeepseekV2Config, ModelConfigError
from mindspec.modeling.rotary import softmax_scale
from tests.support.checkpoints import make_checkpoint, tiny_v2_config, tiny_v3_config


def _dict(cfg) -> dict:
    return json.loads(cfg.to_json_string())


def test_v3_fields_from_saved_config(tmp_path):
    path = make_checkpoint(tmp_path, tiny_v3_config(), seed=0)
    cfg = DeepseekV2Config.from_model_dir(path)
    assert cfg.model_type == "deepseek_v3" and cfg.scoring == "sigmoid" and cfg.topk_method == "noaux_tc"
    assert cfg.num_nextn_predict_layers == 1 and cfg.q_lora_rank == 48
    assert cfg.rope["rope_type"] == "yarn" and cfg.rope["factor"] == 40
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert cfg.latent_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim


def test_v2_lite_fields():
    cfg = DeepseekV2Config.from_dict(_dict(tiny_v2_config()))
    assert cfg.q_lora_rank is None and cfg.scoring == "softmax" and cfg.topk_method == "greedy"
    assert cfg.router.norm_topk_prob is False


def test_legacy_rope_scaling_spelling_gives_the_same_scale():
    new = _dict(tiny_v3_config())
    legacy = dict(new)
    rope = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = rope.pop("rope_theta")
    legacy["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    a, b = DeepseekV2Config.from_dict(new), DeepseekV2Config.from_dict(legacy)
    assert softmax_scale(a.qk_head_dim, a.rope) == pytest.approx(softmax_scale(b.qk_head_dim, b.rope))


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 8, "topk_group": 1}, "num_experts_per_tok"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ],
)
def test_bad_values_name_the_field(change, needle):
    d = _dict(tiny_v3_config())
    d.update(change)
    with pytest.raises(ModelConfigError, match=needle):
        DeepseekV2Config.from_dict(d)


def test_missing_required_field_is_named():
    d = _dict(tiny_v3_config())
    del d["kv_lora_rank"]
    with pytest.raises(ModelConfigError, match="kv_lora_rank"):
        DeepseekV2Config.from_dict(d)
