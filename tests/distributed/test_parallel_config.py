"""worldSize / dp / tp / moe_ep / distTimeout from config.json: good values read, every bad one a
single ConfigError naming its JSON path; the shipped dp example parses."""
import copy
import json
import re
from pathlib import Path

import pytest

from mindspec.config.mindie_config import ConfigError, load_config, parse_config
from mindspec.service.server import build_engine

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODEL = "BackendConfig.ModelDeployConfig.ModelConfig[0]"


def _config(**model) -> dict:
    d = json.loads((CONFIGS / "config.json").read_text())
    d["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(model)
    return d


def test_dp_example_config():
    cfg = load_config(CONFIGS / "config_dp2_ep2.json")
    p = cfg.model.parallel
    assert (p.world_size, p.dp, p.tp, p.moe_ep, p.timeout_s) == (2, 2, 1, 2, 120.0)
    assert p.is_distributed and json.loads(cfg.model.plugin_params)["adaptive_speculation"] is False


def test_defaults_and_dp_from_world_size():
    assert parse_config(_config()).model.parallel.is_distributed is False
    p = parse_config(_config(worldSize=4)).model.parallel  # tp absent -> 1, dp absent -> worldSize / tp
    assert (p.dp, p.tp, p.moe_ep) == (4, 1, 1)


@pytest.mark.parametrize("model, message", [
    (dict(worldSize=4, dp=3), "dp: dp (3) x tp (1) must equal worldSize (4)"),
    (dict(worldSize=2, dp=1, tp=2), "tp: tensor parallelism is not available"),
    (dict(worldSize=4, dp=4, moe_ep=3), "moe_ep: 3 does not divide worldSize (4)"),
    (dict(worldSize=2, moe_tp=2), "moe_tp: expert tensor parallelism is not available"),
    (dict(worldSize=2, distTimeout=0), "distTimeout: must be > 0 seconds"),
    (dict(dp=0), "dp: must be in >= 1"),
    (dict(moe_ep="2"), "moe_ep: must be an integer"),
])
def test_bad_parallel_values_name_their_path(model, message):
    with pytest.raises(ConfigError, match=re.escape(f"{MODEL}.{message}")):
        parse_config(_config(**model))


def test_experts_must_split_evenly_before_any_rank_starts():
    # the shipped model has 6 routed experts
    cfg = parse_config(_config(worldSize=4, dp=4, moe_ep=4), base_dir=CONFIGS)
    with pytest.raises(ConfigError, match=re.escape(f"{MODEL}.moe_ep: 4 does not divide the checkpoint's 6 routed experts")):
        build_engine(cfg)


def test_adaptive_speculation_on_is_refused_with_dp():
    pp = {"plugin_type": "mtp", "num_speculative_tokens": 1, "adaptive_speculation": True}
    cfg = parse_config(_config(worldSize=2, plugin_params=pp), base_dir=CONFIGS)
    with pytest.raises(ConfigError, match=re.escape(f"{MODEL}.plugin_params.adaptive_speculation: must be false")):
        build_engine(cfg)
