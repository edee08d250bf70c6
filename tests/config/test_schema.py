"""MindIE's own config.json files load: MindIE keys mindspec ignores are named in one warning line,
keys neither MindIE nor mindspec knows get a warning each with a suggestion."""
import json
import logging
import re
from pathlib import Path

import pytest

from mindspec.config.mindie_config import ConfigError, load_config, parse_config

DATA = Path(__file__).resolve().parent / "data"
SUMMARY = "MindIE keys not implemented by mindspec (ignored): "

# Written out by hand from MindIE's documentation (service_parameter_configuration.md), not from
# mindspec's table: the keys of the documented sample that mindspec does not implement.
DOCUMENTED_UNIMPLEMENTED = [
    "ServerConfig.fullTextEnabled", "ServerConfig.tlsCrlPath", "ServerConfig.tlsCrlFiles",
    "ServerConfig.managementTlsCrlPath", "ServerConfig.managementTlsCrlFiles",
    "ServerConfig.kmcKsfMaster", "ServerConfig.kmcKsfStandby",
    "ServerConfig.interCommTLSEnabled", "ServerConfig.interCommTlsCaPath", "ServerConfig.interCommTlsCaFiles",
    "ServerConfig.interCommTlsCert", "ServerConfig.interCommPk", "ServerConfig.interCommPkPwd",
    "ServerConfig.interCommTlsCrlPath", "ServerConfig.interCommTlsCrlFiles",
    "ServerConfig.openAiSupport", "ServerConfig.distDPServerEnabled",
    "BackendConfig.modelInstanceNumber", "BackendConfig.npuDeviceIds", "BackendConfig.tokenizerProcessNumber",
    "BackendConfig.multiNodesInferEnabled", "BackendConfig.multiNodesInferPort", "BackendConfig.interNodeTLSEnabled",
    "BackendConfig.interNodeTlsCaPath", "BackendConfig.interNodeTlsCaFiles", "BackendConfig.interNodeTlsCert",
    "BackendConfig.interNodeTlsPk", "BackendConfig.interNodeTlsPkPwd", "BackendConfig.interNodeTlsCrlPath",
    "BackendConfig.interNodeTlsCrlFiles", "BackendConfig.interNodeKmcKsfMaster", "BackendConfig.interNodeKmcKsfStandby",
    "BackendConfig.ModelDeployConfig.ModelConfig[0].trustRemoteCode",
    "BackendConfig.ModelDeployConfig.ModelConfig[0].async_scheduler_wait_time",
    "BackendConfig.ScheduleConfig.templateName", "BackendConfig.ScheduleConfig.prefillTimeMsPerReq",
    "BackendConfig.ScheduleConfig.prefillPolicyType", "BackendConfig.ScheduleConfig.decodeTimeMsPerReq",
    "BackendConfig.ScheduleConfig.decodePolicyType", "BackendConfig.ScheduleConfig.maxPreemptCount",
    "BackendConfig.ScheduleConfig.supportSelectBatch", "BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds",
]
# src/server/conf/config.json has these on top (and no tlsPkPwd / kmcKsf* / interCommPkPwd /
# interNodeTlsPkPwd / interNodeKmcKsf*)
REPO_EXTRA = [
    "ServerConfig.metricsTlsCrlPath", "ServerConfig.metricsTlsCrlFiles", "ServerConfig.layerwiseDisaggregated",
    "ServerConfig.layerwiseDisaggregatedRoleType", "ServerConfig.layerwiseDisaggregatedMasterIpAddress",
    "ServerConfig.layerwiseDisaggregatedSlaveIpAddress", "ServerConfig.layerwiseDisaggregatedDataPort",
    "ServerConfig.layerwiseDisaggregatedCrtlPort", "ServerConfig.HealthCheckConfig", "BackendConfig.kvPoolConfig",
    "BackendConfig.ModelDeployConfig.ModelConfig[0].models", "BackendConfig.ScheduleConfig.maxFirstTokenWaitTime",
    "LogConfig", "EnableDynamicAdjustTimeoutConfig",
]
REPO_MISSING = ["ServerConfig.kmcKsfMaster", "ServerConfig.kmcKsfStandby", "ServerConfig.interCommPkPwd",
                "BackendConfig.interNodeTlsPkPwd", "BackendConfig.interNodeKmcKsfMaster",
                "BackendConfig.interNodeKmcKsfStandby"]


def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def _http_copy(name: str, tmp_path: Path) -> Path:
    """The sample with httpsEnabled false (its certificate files do not exist here)."""
    raw = _load(name)
    raw["ServerConfig"]["httpsEnabled"] = False
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _summary_keys(message: str) -> list[str]:
    assert SUMMARY in message, message
    return message.split(SUMMARY, 1)[1].split(", ")


def test_documented_config_loads_with_one_summary_line(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("MIES_CONTAINER_IP", raising=False)
    monkeypatch.delenv("MIES_CONTAINER_MANAGEMENT_IP", raising=False)
    path = _http_copy("mindie_documented_config.json", tmp_path)
    with caplog.at_level(logging.WARNING):
        cfg = load_config(path)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"{path}: {SUMMARY}")
    assert sorted(_summary_keys(warnings[0])) == sorted(DOCUMENTED_UNIMPLEMENTED)
    # the implemented keys took MindIE's documented values
    assert (cfg.server.ip_address, cfg.server.port, cfg.server.management_port, cfg.server.metrics_port) == (
        "127.0.0.1", 1025, 1026, 1027)
    assert cfg.server.management_ip_address == "127.0.0.2"
    assert cfg.server.max_link_num == 1000 and cfg.server.inter_comm_port == 1121
    assert cfg.model.backend_type == "atb" and cfg.model.world_size == 4 and cfg.model.cpu_mem_size == 5
    assert cfg.model.model_weight_path == "/data/atb_testdata/weights/llama1-65b-safetensors"
    deploy, sched = cfg.backend.model_deploy, cfg.backend.schedule
    assert (deploy.max_seq_len, deploy.max_input_token_len, deploy.truncation) == (2560, 2048, "reject")
    assert (sched.cache_block_size, sched.max_prefill_batch_size, sched.max_batch_size) == (128, 50, 200)


def test_repository_config_loads_with_one_summary_line(tmp_path, caplog):
    path = _http_copy("mindie_repo_config.json", tmp_path)
    with caplog.at_level(logging.WARNING):
        load_config(path)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    expected = [k for k in DOCUMENTED_UNIMPLEMENTED if k not in REPO_MISSING] + REPO_EXTRA
    assert sorted(_summary_keys(warnings[0])) == sorted(expected)


def test_documented_only_keys_are_known(caplog):
    """Keys the documentation lists that neither sample file holds."""
    raw = _load("mindie_documented_config.json")
    raw["ServerConfig"].update(httpsEnabled=False, maxRequestLength=40, metricsTlsPkPwd="security/pass/metrics/key_pwd.txt")
    raw["ServerConfig"]["HealthCheckConfig"] = {"npuUsageThreshold": 0}
    raw["BackendConfig"]["ScheduleConfig"]["maxN"] = 128
    raw["BackendConfig"]["ModelDeployConfig"]["LoraModules"] = []
    with caplog.at_level(logging.WARNING):
        parse_config(raw)
    keys = _summary_keys(_warnings(caplog)[0])
    assert len(_warnings(caplog)) == 1
    assert {"ServerConfig.HealthCheckConfig", "BackendConfig.ScheduleConfig.maxN",
            "BackendConfig.ModelDeployConfig.LoraModules"} <= set(keys)


def _minimal(**server) -> dict:
    return {"ServerConfig": dict(server),
            "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": "/m"}]}}}


@pytest.mark.parametrize("section, key, hint", [
    ("ServerConfig", "managmentPort", "did you mean ServerConfig.managementPort?"),
    ("ServerConfig", "maxBatchSize", "did you mean BackendConfig.ScheduleConfig.maxBatchSize?"),
    ("ServerConfig", "httpsenabled", "did you mean ServerConfig.httpsEnabled?"),
    ("BackendConfig.ScheduleConfig", "maxBatchSzie", "did you mean BackendConfig.ScheduleConfig.maxBatchSize?"),
    ("model", "modelWeightPth", "did you mean BackendConfig.ModelDeployConfig.ModelConfig[i].modelWeightPath?"),
])
def test_unknown_key_gets_its_own_warning_with_a_suggestion(section, key, hint, caplog):
    raw = _minimal()
    if section == "model":
        raw["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0][key] = 1
        path = f"BackendConfig.ModelDeployConfig.ModelConfig[0].{key}"
    else:
        node = raw
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[key] = 1
        path = f"{section}.{key}"
    with caplog.at_level(logging.WARNING):
        parse_config(raw, source="c.json")
    assert _warnings(caplog) == [f"c.json: {path} is not a MindIE or mindspec config key (ignored); {hint}"]


def test_unknown_key_without_a_near_match_has_no_hint(caplog):
    raw = _minimal(zzzQuux=1)
    with caplog.at_level(logging.WARNING):
        parse_config(raw, source="c.json")
    assert _warnings(caplog) == ["c.json: ServerConfig.zzzQuux is not a MindIE or mindspec config key (ignored)"]


def test_model_options_stay_accepted(caplog):
    """MindIE forwards other ModelConfig keys to the model: accepted, kept, named in the summary."""
    raw = _minimal(fullTextEnabled=False)
    raw["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["enable_custom_rope"] = "1"
    with caplog.at_level(logging.WARNING):
        cfg = parse_config(raw, source="c.json")
    assert cfg.model.extra == {"enable_custom_rope": "1"}
    assert _warnings(caplog) == [
        f"c.json: {SUMMARY}ServerConfig.fullTextEnabled, BackendConfig.ModelDeployConfig.ModelConfig[0].enable_custom_rope"]


def test_mindspec_config_has_no_warnings(caplog):
    shipped = Path(__file__).resolve().parents[2] / "configs"
    with caplog.at_level(logging.WARNING):
        for name in ("config.json", "config_dp2_ep2.json", "config_pd_prefill.json", "config_pd_router.json"):
            load_config(shipped / name)
    assert _warnings(caplog) == []


@pytest.mark.parametrize("where, value, message", [
    (("Version",), "2.0.0", "Version: must be one of 1.0.0, got '2.0.0'"),
    (("BackendConfig", "backendName"), "other", "BackendConfig.backendName: must be one of mindieservice_llm_engine"),
    (("BackendConfig", "ScheduleConfig", "templateType"), "Split", "BackendConfig.ScheduleConfig.templateType: must be one of Standard, Mix"),
    (("BackendConfig", "ModelDeployConfig", "ModelConfig", 0, "modelInstanceType"), "StandardMock",
     "BackendConfig.ModelDeployConfig.ModelConfig[0].modelInstanceType: must be one of Standard"),
])
def test_checked_mindie_values(where, value, message):
    raw = _minimal()
    raw["BackendConfig"]["ScheduleConfig"] = {}
    node = raw
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)
