"""MindIE's whole ``config.json`` schema in one table, and what mindspec does with each key.

Sources: MindIE-LLM ``docs/en/user_guide/user_manual/service_parameter_configuration.md`` and
``src/server/conf/config.json`` (Ascend/MindIE-LLM); tests/config/data holds both sample files.

Every key is one of
- ``use``: implemented; the entry says which field of the parsed config it sets
  (mindspec.config.mindie_config) or what it checks;
- ``ext``: a mindspec key MindIE does not have (also implemented);
- ``skip``: a MindIE key mindspec does not implement; a config holding it still loads, and all
  such keys are named in ONE warning line (``MindIE keys not implemented by mindspec (ignored)``).
A key in neither MindIE nor mindspec is a warning of its own, with difflib's closest key as a
"did you mean" hint. MindIE forwards any other ``ModelConfig`` key to the model as a model option,
so an unknown ``ModelConfig`` key counts as an unimplemented MindIE key, unless it is close to a
known key (then it is more likely a typo and gets its own warning).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Optional

USE, EXT, SKIP = "use", "ext", "skip"


@dataclass(frozen=True)
class Key:
    status: str  # USE, EXT or SKIP
    note: str  # USE/EXT: where the value goes; SKIP: what MindIE does with it


def _use(note: str) -> Key:
    return Key(USE, note)


def _ext(note: str) -> Key:
    return Key(EXT, note)


def _skip(note: str) -> Key:
    return Key(SKIP, note)


MODEL_CONFIG = "BackendConfig.ModelDeployConfig.ModelConfig[]"  # the section of each ModelConfig entry

_TLS_FILE = "TLS file, relative to the config file's folder (ServerTls)"
_CRL = "certificate revocation lists (mindspec does not check CRLs)"

# section (dotted path; "" is the top level) -> key -> Key. A key whose value is an object or a
# list of objects and that has a section of its own here is checked key by key as well.
SCHEMA: dict[str, dict[str, Key]] = {
    "": {
        "Version": _use("checked: must be \"1.0.0\", MindIE's only config version"),
        "ServerConfig": _use("MindieConfig.server"),
        "BackendConfig": _use("MindieConfig.backend"),
        "LogConfig": _skip("dynamic log level (dynamicLogLevel, dynamicLogLevelValidHours, dynamicLogLevelValidTime)"),
        "EnableDynamicAdjustTimeoutConfig": _skip("raises every inference timeout to its maximum"),
    },
    "ServerConfig": {
        "ipAddress": _use("ServerConfig.ip_address (business port); $MIES_CONTAINER_IP overrides it"),
        "managementIpAddress": _use("ServerConfig.management_ip_address (management/metrics ports); "
                                    "$MIES_CONTAINER_MANAGEMENT_IP overrides it; absent: ipAddress"),
        "port": _use("ServerConfig.port"),
        "managementPort": _use("ServerConfig.management_port"),
        "metricsPort": _use("ServerConfig.metrics_port"),
        "allowAllZeroIpListening": _use("ServerConfig.allow_all_zero_ip_listening (gates 0.0.0.0)"),
        "maxLinkNum": _use("ServerConfig.max_link_num (concurrent requests on the business port)"),
        "maxRequestLength": _use("ServerConfig.max_request_length (MB per request body)"),
        "httpsEnabled": _use("ServerConfig.tls: HTTPS on every port (absent: false in mindspec, true in MindIE)"),
        "fullTextEnabled": _skip("streaming responses repeat all text so far"),
        "tlsCaPath": _use("folder of tlsCaFile / managementTlsCaFile / metricsTlsCaFile"),
        "tlsCaFile": _use("ServerTls.ca_files: client certificates must be signed by one of these CAs"),
        "tlsCert": _use("ServerTls.cert_file: " + _TLS_FILE),
        "tlsPk": _use("ServerTls.key_file: " + _TLS_FILE),
        "tlsPkPwd": _use("ServerTls.key_password: a plain-text file holding the key's password"),
        "tlsCrlPath": _skip(_CRL),
        "tlsCrlFiles": _skip(_CRL),
        "managementTlsCaFile": _use("management port's ServerTls.ca_files (in tlsCaPath)"),
        "managementTlsCert": _use("management port's ServerTls.cert_file"),
        "managementTlsPk": _use("management port's ServerTls.key_file"),
        "managementTlsPkPwd": _use("management port's ServerTls.key_password"),
        "managementTlsCrlPath": _skip(_CRL),
        "managementTlsCrlFiles": _skip(_CRL),
        "metricsTlsCaFile": _use("metrics port's ServerTls.ca_files (in tlsCaPath)"),
        "metricsTlsCert": _use("metrics port's ServerTls.cert_file"),
        "metricsTlsPk": _use("metrics port's ServerTls.key_file"),
        "metricsTlsPkPwd": _use("metrics port's ServerTls.key_password"),
        "metricsTlsCrlPath": _skip(_CRL),
        "metricsTlsCrlFiles": _skip(_CRL),
        "kmcKsfMaster": _skip("KMC keystore that decrypts KMC-encrypted key passwords (mindspec reads plain-text ones)"),
        "kmcKsfStandby": _skip("KMC keystore backup"),
        "inferMode": _use("ServerConfig.infer_mode (standard | dmi = PD disaggregation)"),
        "interCommTLSEnabled": _skip("TLS between PD instances (mindspec's PD routes are plain HTTP)"),
        "interCommPort": _use("ServerConfig.inter_comm_port (PD routes)"),
        "interCommTlsCaPath": _skip("TLS between PD instances"),
        "interCommTlsCaFiles": _skip("TLS between PD instances"),
        "interCommTlsCert": _skip("TLS between PD instances"),
        "interCommPk": _skip("TLS between PD instances"),
        "interCommPkPwd": _skip("TLS between PD instances"),
        "interCommTlsCrlPath": _skip("TLS between PD instances"),
        "interCommTlsCrlFiles": _skip("TLS between PD instances"),
        "openAiSupport": _skip("vllm-flavoured or native OpenAI chat API (mindspec serves the vLLM-compatible one)"),
        "tokenTimeout": _use("ServerConfig.token_timeout"),
        "e2eTimeout": _use("ServerConfig.e2e_timeout"),
        "distDPServerEnabled": _skip("distributed DP server for MoE EP"),
        "layerwiseDisaggregated": _skip("layer-wise disaggregation"),
        "layerwiseDisaggregatedRoleType": _skip("layer-wise disaggregation"),
        "layerwiseDisaggregatedMasterIpAddress": _skip("layer-wise disaggregation"),
        "layerwiseDisaggregatedSlaveIpAddress": _skip("layer-wise disaggregation"),
        "layerwiseDisaggregatedDataPort": _skip("layer-wise disaggregation"),
        "layerwiseDisaggregatedCrtlPort": _skip("layer-wise disaggregation"),
        "HealthCheckConfig": _skip("npuUsageThreshold: NPU-usage health probe"),
        "pdRole": _ext("ServerConfig.pd_role (prefill | decode | router with inferMode dmi)"),
        "pdPrefillAddress": _ext("ServerConfig.pd_prefill_address (router)"),
        "pdDecodeAddress": _ext("ServerConfig.pd_decode_address (router)"),
    },
    "BackendConfig": {
        "backendName": _use("checked: must be \"mindieservice_llm_engine\", MindIE's only backend"),
        "modelInstanceNumber": _skip("model instances per server (mindspec serves one)"),
        "npuDeviceIds": _skip("devices per instance (mindspec: worldSize ranks on the visible devices)"),
        "tokenizerProcessNumber": _skip("tokenizer processes"),
        "multiNodesInferEnabled": _skip("multi-node inference (mindspec: torchrun, see docs/distributed.md)"),
        "multiNodesInferPort": _skip("multi-node inference"),
        "interNodeTLSEnabled": _skip("TLS between nodes"),
        "interNodeTlsCaPath": _skip("TLS between nodes"),
        "interNodeTlsCaFiles": _skip("TLS between nodes"),
        "interNodeTlsCert": _skip("TLS between nodes"),
        "interNodeTlsPk": _skip("TLS between nodes"),
        "interNodeTlsPkPwd": _skip("TLS between nodes"),
        "interNodeTlsCrlPath": _skip("TLS between nodes"),
        "interNodeTlsCrlFiles": _skip("TLS between nodes"),
        "interNodeKmcKsfMaster": _skip("KMC keystore between nodes"),
        "interNodeKmcKsfStandby": _skip("KMC keystore between nodes"),
        "kvPoolConfig": _skip("KV cache pool backend"),
        "ModelDeployConfig": _use("BackendConfig.model_deploy"),
        "ScheduleConfig": _use("BackendConfig.schedule"),
    },
    "BackendConfig.ModelDeployConfig": {
        "maxSeqLen": _use("ModelDeployConfig.max_seq_len"),
        "maxInputTokenLen": _use("ModelDeployConfig.max_input_token_len"),
        "truncation": _use("ModelDeployConfig.truncation"),
        "ModelConfig": _use("ModelDeployConfig.models"),
        "LoraModules": _skip("LoRA adapters"),
    },
    MODEL_CONFIG: {
        "modelInstanceType": _use("checked: \"Standard\" (StandardMock, a server without a model, is not available)"),
        "modelName": _use("ModelConfig.model_name"),
        "modelWeightPath": _use("ModelConfig.model_weight_path (\"mindspec:default\" or absent: the shipped model)"),
        "worldSize": _use("ModelConfig.world_size"),
        "cpuMemSize": _use("ModelConfig.cpu_mem_size (KV cache GB on the cpu backend)"),
        "npuMemSize": _use("ModelConfig.npu_mem_size (KV cache GB on cuda/npu)"),
        "backendType": _use("ModelConfig.backend_type (atb/torch mean npu; mindspec adds cpu, cuda, auto)"),
        "trustRemoteCode": _skip("run the checkpoint's own modelling code (mindspec runs its DeepSeek code only)"),
        "plugin_params": _use("ModelConfig.plugin_params"),
        "async_scheduler_wait_time": _skip("PD async scheduler wait"),
        "kv_trans_timeout": _use("ModelConfig.kv_trans_timeout (PD)"),
        "kv_link_timeout": _use("ModelConfig.kv_link_timeout (PD)"),
        "dp": _use("ModelConfig.dp"),
        "tp": _use("ModelConfig.tp (1 only)"),
        "moe_ep": _use("ModelConfig.moe_ep"),
        "moe_tp": _use("checked: 1 only"),
        "cp": _skip("context parallelism"),
        "sp": _skip("sequence parallelism"),
        "pp": _skip("pipeline parallelism"),
        "models": _skip("per-architecture options (ep_level, ...)"),
        "dtype": _ext("ModelConfig.dtype"),
        "decodeGraphs": _ext("ModelConfig.decode_graphs"),
        "compileWorkers": _ext("ModelConfig.compile_workers -> EngineArgs.compile_workers (cpu packages of shapes "
                               "first met compile in that many worker processes while the step runs eagerly; 0: "
                               "on the serving thread; absent: one per core, at most 4)"),
        "distTimeout": _ext("ModelConfig.dist_timeout"),
        "cpuThreads": _ext("ModelConfig.cpu_threads -> EngineArgs.cpu_threads (cpu backend threads per process; "
                           "absent: the default policy)"),
    },
    "BackendConfig.ScheduleConfig": {
        "templateType": _use("\"Standard\" (prefill and decode in separate batches) or \"Mix\" (SplitFuse: prefill "
                             "chunks inside decode steps; with plugin_type splitfuse or enableSplit)"),
        "enableSplit": _use("ScheduleConfig.split_fuse (with templateType Mix)"),
        "splitType": _skip("how MindIE splits (mindspec: chunks of splitChunkTokens rows per step)"),
        "splitStartType": _use("ScheduleConfig.split_start_batch_size applies when true"),
        "splitStartBatchSize": _use("ScheduleConfig.split_start_batch_size"),
        "splitChunkTokens": _use("ScheduleConfig.split_chunk_tokens"),
        "templateName": _skip("scheduling workflow name (Standard_LLM only)"),
        "cacheBlockSize": _use("ScheduleConfig.cache_block_size"),
        "maxPrefillBatchSize": _use("ScheduleConfig.max_prefill_batch_size"),
        "maxPrefillTokens": _use("ScheduleConfig.max_prefill_tokens"),
        "prefillTimeMsPerReq": _skip("prefill/decode choice with supportSelectBatch"),
        "prefillPolicyType": _skip("prefill policy (0 = FCFS, what mindspec does)"),
        "decodeTimeMsPerReq": _skip("prefill/decode choice with supportSelectBatch"),
        "decodePolicyType": _skip("decode policy (0 = FCFS, what mindspec does)"),
        "maxBatchSize": _use("ScheduleConfig.max_batch_size"),
        "maxIterTimes": _use("ScheduleConfig.max_iter_times"),
        "maxPreemptCount": _skip("preemption cap (mindspec preempts by recomputation when KV blocks run out)"),
        "supportSelectBatch": _skip("prefill/decode choice by timing"),
        "maxQueueDelayMicroseconds": _skip("queue delay before a partial batch runs"),
        "maxFirstTokenWaitTime": _skip("TTFT-driven preemption"),
        "maxN": _skip("beam width / parallel samples"),
        "numBlocks": _ext("ScheduleConfig.num_blocks (fixed KV block count)"),
        "asyncScheduling": _ext("ScheduleConfig.async_scheduling (MindIE's MINDIE_ASYNC_SCHEDULING_ENABLE)"),
        "waitingServedRatio": _ext("ScheduleConfig.waiting_served_ratio"),
        "maxWaitingSteps": _ext("ScheduleConfig.max_waiting_steps"),
    },
}


@dataclass
class KeyAudit:
    unimplemented: list[str] = field(default_factory=list)  # MindIE keys mindspec ignores, JSON paths
    unknown: list[tuple[str, Optional[str]]] = field(default_factory=list)  # (path, suggested key path)


def audit_keys(obj: Any) -> KeyAudit:
    """Sorts every key of a config object into used / unimplemented / unknown (see module doc).
    Values are not checked here; parsing does that."""
    audit = KeyAudit()
    if isinstance(obj, dict):
        _walk("", obj, "", audit)
    return audit


def _walk(section: str, node: dict, prefix: str, audit: KeyAudit) -> None:
    table = SCHEMA[section]
    for key, value in node.items():
        path = prefix + key
        entry = table.get(key)
        if entry is None:
            _unknown(section, key, path, audit)
        elif entry.status == SKIP:
            audit.unimplemented.append(path)
        else:
            _descend(_child(section, key), value, path, audit)


def _child(section: str, key: str) -> str:
    if section == "BackendConfig.ModelDeployConfig" and key == "ModelConfig":
        return MODEL_CONFIG
    return f"{section}.{key}" if section else key


def _descend(child: str, value: Any, path: str, audit: KeyAudit) -> None:
    if child not in SCHEMA:
        return
    if isinstance(value, dict):
        _walk(child, value, path + ".", audit)
    elif isinstance(value, list):  # ModelConfig: one section per entry
        for i, item in enumerate(value):
            if isinstance(item, dict):
                _walk(child, item, f"{path}[{i}].", audit)


def _unknown(section: str, key: str, path: str, audit: KeyAudit) -> None:
    suggestion = suggest(section, key)
    if section == MODEL_CONFIG and suggestion is None:
        audit.unimplemented.append(path)  # a model option MindIE would forward to the model
    else:
        audit.unknown.append((path, suggestion))


def suggest(section: str, key: str) -> Optional[str]:
    """The closest known key: in the same section (difflib), else the same key in another section
    (a key put in the wrong section), as a JSON path. None if nothing is close."""
    close = difflib.get_close_matches(key, SCHEMA[section], n=1, cutoff=0.75)
    if close:
        return _display(section, close[0])
    lowered = {k.lower(): k for k in SCHEMA[section]}
    if key.lower() in lowered:  # difflib's ratio misses a case-only difference in a short key
        return _display(section, lowered[key.lower()])
    for other, table in SCHEMA.items():
        if other != section and key in table:
            return _display(other, key)
    return None


def _display(section: str, key: str) -> str:
    return f"{section.replace('[]', '[i]')}.{key}" if section else key


def warn_keys(audit: KeyAudit, source: str, logger) -> None:
    """One summary line for MindIE keys mindspec ignores; one line per key neither knows."""
    if audit.unimplemented:
        logger.warning("%s: MindIE keys not implemented by mindspec (ignored): %s", source,
                       ", ".join(audit.unimplemented))
    for path, suggestion in audit.unknown:
        hint = f"; did you mean {suggestion}?" if suggestion else ""
        logger.warning("%s: %s is not a MindIE or mindspec config key (ignored)%s", source, path, hint)
