import json
import re
from pathlib import Path

import pytest
import yaml

from mindspec.config.mindie_config import ConfigError, load_config, parse_config

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "config.json"


def _sample() -> dict:
    return json.loads(SHIPPED.read_text())


def test_shipped_config_parses_with_mindie_defaults():
    from mindspec.config.defaults import DEFAULT_MODEL_DIR, default_config_dict

    cfg = load_config(SHIPPED)
    assert cfg.server.port == 1025 and cfg.backend.schedule.max_batch_size == 32
    assert cfg.model.backend_type == "cpu" and cfg.backend.model_deploy.truncation == "reject"
    assert json.loads(cfg.model.plugin_params) == {"plugin_type": "mtp", "num_speculative_tokens": 3}
    # configs/config.json is the built-in default written out, pointing at the shipped model
    assert Path(cfg.model.model_weight_path) == DEFAULT_MODEL_DIR
    raw = _sample()
    raw["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = "X"
    assert raw == default_config_dict("X")


def test_minimal_config_and_relative_path(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(
        {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": "weights"}]}}}))
    cfg = load_config(tmp_path / "c.json")
    assert cfg.model.model_weight_path == str((tmp_path / "weights").resolve())
    assert cfg.backend.schedule.max_batch_size == 200 and cfg.backend.model_deploy.max_seq_len == 2560


def test_yaml_equals_json(tmp_path):
    d = _sample()
    d["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = "/abs/model"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    (tmp_path / "c.json").write_text(json.dumps(d))
    assert load_config(tmp_path / "c.yaml").backend == load_config(tmp_path / "c.json").backend


def test_plugin_params_as_object():
    d = _sample()
    d["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] = {"plugin_type": "mtp", "num_speculative_tokens": 2}
    assert parse_config(d).model.plugin_params["num_speculative_tokens"] == 2


@pytest.mark.parametrize("truncation, expected", [(0, "reject"), (False, "reject"), (1, "left"), (-1, "right"), (True, "right")])
def test_truncation(truncation, expected):
    d = _sample()
    d["BackendConfig"]["ModelDeployConfig"]["truncation"] = truncation
    assert parse_config(d).backend.model_deploy.truncation == expected


MODEL = "BackendConfig.ModelDeployConfig.ModelConfig[0]"
BAD = [
    (("BackendConfig", "ScheduleConfig", "cacheBlockSize"), 0, "BackendConfig.ScheduleConfig.cacheBlockSize"),
    (("BackendConfig", "ScheduleConfig", "cacheBlockSize"), 256, "cacheBlockSize: must be in 1..128"),
    (("BackendConfig", "ScheduleConfig", "maxBatchSize"), "8", "maxBatchSize: must be an integer"),
    (("BackendConfig", "ScheduleConfig", "maxPrefillTokens"), 100, "maxPrefillTokens: must be >= maxInputTokenLen"),
    (("BackendConfig", "ScheduleConfig", "waitingServedRatio"), -0.5, "waitingServedRatio: must be >= 0.0"),
    (("BackendConfig", "ScheduleConfig", "waitingServedRatio"), "0.3", "waitingServedRatio: must be a number"),
    (("BackendConfig", "ScheduleConfig", "maxWaitingSteps"), -1, "maxWaitingSteps: must be in >= 0"),
    (("BackendConfig", "ModelDeployConfig", "truncation"), 2, "truncation"),
    (("BackendConfig", "ModelDeployConfig", "ModelConfig"), [], "ModelConfig: must be a non-empty list"),
    (("ServerConfig", "port"), 70000, "ServerConfig.port"),
    (("ServerConfig", "httpsEnabled"), True, "ServerConfig.tlsCert: "),  # no certificate files here
]


@pytest.mark.parametrize("keys, value, message", BAD)
def test_bad_values_name_their_path(keys, value, message):
    d = _sample()
    node = d
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(d)


@pytest.mark.parametrize(
    "key, value, message",
    [("backendType", "tpu", "backendType: must be one of"), ("dtype", "int8", "dtype"),
     ("plugin_params", "{bad", "plugin_params: plugin_params is not valid JSON"),
     ("modelWeightPath", "", "modelWeightPath: must not be empty"), ("dp", 0, "dp: must be in >= 1"),
     ("cpuThreads", 0, "cpuThreads: must be in >= 1"), ("cpuThreads", "4", "cpuThreads: must be an integer"),
     ("cpuThreads", 2.5, "cpuThreads: must be an integer"), ("compileWorkers", -1, "compileWorkers: must be in >= 0"),
     ("compileWorkers", True, "compileWorkers: must be an integer")],
)
def test_bad_model_values_name_their_path(key, value, message):
    d = _sample()
    d["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0][key] = value
    with pytest.raises(ConfigError, match=re.escape(f"{MODEL}.") + message):
        parse_config(d)


def test_prefill_batching_keys_reach_the_scheduler():
    from mindspec.engine.args import EngineArgs

    d = _sample()
    assert parse_config(d).backend.schedule.waiting_served_ratio == 0.3
    assert parse_config(d).backend.schedule.max_waiting_steps == 20
    d["BackendConfig"]["ScheduleConfig"].update(waitingServedRatio=0, maxWaitingSteps=5)
    sched = EngineArgs.from_mindie_config(parse_config(d)).scheduler
    assert (sched.waiting_served_ratio, sched.max_waiting_steps) == (0.0, 5)


def test_split_fuse_keys_reach_the_scheduler():
    from mindspec.engine.args import EngineArgs

    d = _sample()
    assert not EngineArgs.from_mindie_config(parse_config(d)).scheduler.split_fuse
    d["BackendConfig"]["ScheduleConfig"].update(templateType="Mix", enableSplit=True, splitChunkTokens=256,
                                                splitStartType=True, splitStartBatchSize=4)
    sched = EngineArgs.from_mindie_config(parse_config(d)).scheduler
    assert (sched.split_fuse, sched.split_chunk_tokens, sched.split_start_batch_size) == (True, 256, 4)
    d["BackendConfig"]["ScheduleConfig"]["splitStartType"] = False  # mixing from the first step
    assert EngineArgs.from_mindie_config(parse_config(d)).scheduler.split_start_batch_size == 0
    d["BackendConfig"]["ScheduleConfig"]["templateType"] = "Standard"
    with pytest.raises(ConfigError, match=re.escape('ScheduleConfig.enableSplit: SplitFuse needs templateType "Mix"')):
        parse_config(d)
    d["BackendConfig"]["ScheduleConfig"].update(templateType="Mix", splitChunkTokens=0)
    with pytest.raises(ConfigError, match="splitChunkTokens"):
        parse_config(d)


def test_engine_features_in_plugin_type():
    from mindspec.config.plugin_params import parse_plugin_params

    p = parse_plugin_params({"plugin_type": "mtp, prefix_cache,splitfuse", "num_speculative_tokens": 2})
    assert p.plugin_types == ("mtp",) and p.prefix_cache and p.splitfuse
    assert parse_plugin_params(p.as_dict(x=1)) == parse_plugin_params({**p.as_dict(), "x": 1})
    alone = parse_plugin_params('{"plugin_type": "prefix_cache"}')
    assert alone.plugin_types == () and alone.prefix_cache and not alone.splitfuse


def test_cpu_threads_reach_the_engine_args(caplog):
    from mindspec.engine.args import EngineArgs

    d = _sample()
    assert parse_config(d).model.cpu_threads is None  # absent: the default thread policy
    d["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["cpuThreads"] = 3
    with caplog.at_level("WARNING"):
        cfg = parse_config(d)
    assert cfg.model.cpu_threads == 3 and caplog.records == [] and "cpuThreads" not in cfg.model.extra
    assert EngineArgs.from_mindie_config(cfg).cpu_threads == 3


def test_compile_workers_default_to_a_servers_count():
    from mindspec.engine.args import EngineArgs, default_compile_workers

    d = _sample()
    cfg = parse_config(d)
    assert cfg.model.compile_workers is None
    assert EngineArgs.from_mindie_config(cfg).compile_workers == default_compile_workers() >= 1
    d["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["compileWorkers"] = 0
    cfg = parse_config(d)
    assert cfg.model.compile_workers == 0 and "compileWorkers" not in cfg.model.extra
    assert EngineArgs.from_mindie_config(cfg).compile_workers == 0
    assert EngineArgs(model="m").compile_workers == 0  # a library engine compiles on its own thread
    with pytest.raises(ValueError, match="compile_workers: must be an integer >= 0"):
        EngineArgs(model="m", compile_workers=-2)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"a": 1,,}')
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        load_config(tmp_path / "bad.json")


def test_unimplemented_keys_warn_not_fail(caplog):
    d = _sample()
    d["ServerConfig"]["kmcKsfMaster"] = "/x"
    d["BackendConfig"]["ScheduleConfig"]["prefillTimeMsPerReq"] = 150
    with caplog.at_level("WARNING"):
        parse_config(d)
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().endswith(
        "MindIE keys not implemented by mindspec (ignored): ServerConfig.kmcKsfMaster, "
        "BackendConfig.ScheduleConfig.prefillTimeMsPerReq")


@pytest.mark.parametrize("name", ["config.json", "config_cpu_no_mtp.json", "config_cuda.json", "config_npu.json"])
def test_ready_made_configs_parse(name):
    cfg = load_config(SHIPPED.parent / name)
    assert cfg.model.backend_type in ("cpu", "cuda", "npu")
