"""MindIE-style ``config.json`` (or YAML with the same structure), read into typed records.

Keys keep MindIE's camelCase spelling; defaults are MindIE's. mindspec adds to ``ModelConfig``:
``backendType`` also accepts cpu / cuda / auto (atb and torch mean npu), ``dtype``,
``decodeGraphs`` (decode steps as captured graphs on cuda/npu, compiled AOTInductor packages on cpu; absent: on
where graphs exist, off on cpu), ``cpuThreads`` (cpu backend threads per process), and to
``ScheduleConfig``: ``numBlocks`` (a fixed KV block count instead of a memory budget),
``asyncScheduling`` (MindIE's MINDIE_ASYNC_SCHEDULING_ENABLE as a config key), ``waitingServedRatio``
and ``maxWaitingSteps`` (prefill batching while sequences decode: TGI's waiting_served_ratio and
max_waiting_tokens; engine/scheduler.py).
Every bad value is one ConfigError naming its JSON path. mindspec.config.schema lists every MindIE
key and what mindspec does with it; MindIE keys mindspec ignores are named in one warning line.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from mindspec.config.plugin_params import PluginParamsError, parse_plugin_params
from mindspec.config.schema import EXT, MODEL_CONFIG, SCHEMA, USE, audit_keys, warn_keys
from mindspec.config.tls import PortsTls, ServerTls, parse_tls


logger = logging.getLogger(__name__)

class ConfigError(ValueError):
    """config.json is unreadable or holds a bad value; the message names the JSON path."""


BACKEND_TYPES = ("cpu", "cuda", "npu", "auto", "atb", "torch")
DTYPES = ("float32", "bfloat16", "float16")
# MindIE: 0/false = reject, -1/true = cut from the right, 1 = cut from the left (bool checked first:
# True == 1 in Python).
TRUNCATION = {0: "reject", -1: "right", 1: "left"}


@dataclass(frozen=True)
class ServerConfig:
    ip_address: str = "127.0.0.1"  # the business port's address
    # the management port's address, and the metrics port's unless it shares the business port
    management_ip_address: str = "127.0.0.1"
    port: int = 1025
    management_port: int = 1026
    metrics_port: int = 1027
    max_link_num: int = 1000
    token_timeout: int = 600
    e2e_timeout: int = 600
    allow_all_zero_ip_listening: bool = False
    max_request_length: int = 40  # MB (MindIE's maxRequestLength)
    # httpsEnabled: each port's certificate, key and client CAs (mindspec.config.tls); None: HTTP
    tls: Optional[PortsTls] = None
    # PD disaggregation (MindIE inferMode "dmi"; mindspec's keys: pdRole, pdPrefillAddress,
    # pdDecodeAddress). A prefill or decode node serves its PD routes on interCommPort; a router
    # sends each request through the prefill node, then the decode node (mindspec.service.pd_*).
    infer_mode: str = "standard"
    pd_role: Optional[str] = None  # "prefill" | "decode" | "router" with inferMode "dmi"
    inter_comm_port: int = 1121
    pd_prefill_address: Optional[str] = None  # host:port of the prefill node's interCommPort (router)
    pd_decode_address: Optional[str] = None  # host:port of the decode node's interCommPort (router)

    @property
    def max_request_length_bytes(self) -> int:
        return self.max_request_length * 1024 * 1024

    def tls_for_port(self, port: int) -> Optional[ServerTls]:
        """The business port (and ports merged with it) uses the tls* files, the management port
        its own, a metrics port of its own the metrics files. The PD routes on interCommPort stay
        plain HTTP: MindIE secures them with interCommTLSEnabled, which mindspec does not implement."""
        if self.tls is None or (port == self.inter_comm_port and self.pd_role in ("prefill", "decode")):
            return None
        if port == self.port:
            return self.tls.business
        return self.tls.management if port == self.management_port else self.tls.metrics


@dataclass(frozen=True)
class ModelConfig:
    model_name: str
    model_weight_path: str
    backend_type: str = "cpu"
    dtype: str = "auto"
    world_size: int = 1
    cpu_mem_size: float = 5
    npu_mem_size: float = -1
    plugin_params: Union[str, dict, None] = None  # validated, kept as given
    dp: int = 1
    tp: int = 1
    # mindspec: decode steps as captured graphs (cuda/npu) or compiled AOTInductor packages (cpu); None = backend default
    decode_graphs: Optional[bool] = None
    # mindspec (compileWorkers): processes compiling cpu packages of shapes first met; None = a server's default
    compile_workers: Optional[int] = None
    # mindspec (cpuThreads): intra-op threads per process on the cpu backend; None = default policy
    cpu_threads: Optional[int] = None
    extra: dict = field(default_factory=dict)
    # Multi-process runs (mindspec.distributed): MindIE's moe_ep; mindspec's distTimeout (seconds
    # any collective or rendezvous waits). PD: MindIE's kv_trans_timeout / kv_link_timeout.
    moe_ep: int = 1
    dist_timeout: float = 600.0
    kv_trans_timeout: float = 10.0
    kv_link_timeout: float = 1080.0

    @property
    def parallel(self):
        from mindspec.distributed.parallel_config import ParallelConfig

        return ParallelConfig(self.world_size, self.dp, self.tp, self.moe_ep, self.dist_timeout)


@dataclass(frozen=True)
class ModelDeployConfig:
    max_seq_len: int = 2560
    max_input_token_len: int = 2048
    truncation: str = "reject"
    models: tuple[ModelConfig, ...] = ()


@dataclass(frozen=True)
class ScheduleConfig:
    cache_block_size: int = 128
    max_prefill_batch_size: int = 50
    max_prefill_tokens: int = 8192
    max_batch_size: int = 200
    max_iter_times: int = 512
    num_blocks: Optional[int] = None
    async_scheduling: bool = False
    waiting_served_ratio: float = 0.3
    max_waiting_steps: int = 20
    # SplitFuse: templateType "Mix" with enableSplit (or plugin_type "splitfuse")
    enable_split: bool = False
    split_start_batch_size: int = 0  # splitStartBatchSize when splitStartType is true
    split_chunk_tokens: int = 512


@dataclass(frozen=True)
class BackendConfig:
    model_deploy: ModelDeployConfig
    schedule: ScheduleConfig


@dataclass(frozen=True)
class MindieConfig:
    server: ServerConfig
    backend: BackendConfig
    source: str = "<dict>"

    @property
    def model(self) -> ModelConfig:
        return self.backend.model_deploy.models[0]


# ---- field readers ---------------------------------------------------------------------------


class _Section:
    def __init__(self, data: Any, path: str):
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: must be an object, got {type(data).__name__}")
        self.data, self.path = data, path

    def _where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def int(self, key: str, default: Optional[int], lo: Optional[float] = None, hi: Optional[float] = None) -> Optional[int]:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self._where(key)}: must be an integer, got {value!r}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"{self._where(key)}: must be in {rng}, got {value}")
        return value

    def num(self, key: str, default: float, lo: Optional[float] = None) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN
            raise ConfigError(f"{self._where(key)}: must be a number, got {value!r}")
        if lo is not None and value < lo:
            raise ConfigError(f"{self._where(key)}: must be >= {lo}, got {value}")
        return float(value)

    def str(self, key: str, default: Optional[str], choices: Optional[tuple] = None) -> Optional[str]:
        value = self.data.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or (choices and value not in choices):
            want = f"one of {', '.join(choices)}" if choices else "a string"
            raise ConfigError(f"{self._where(key)}: must be {want}, got {value!r}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self._where(key)}: must be true or false, got {value!r}")
        return value


def _server(s: _Section, base_dir: Path) -> ServerConfig:
    allow_all_zero = s.bool("allowAllZeroIpListening", False)
    ip, management_ip = _addresses(s, allow_all_zero)
    # MindIE's default is true; mindspec ships no certificates, so absent means plain HTTP
    https = s.bool("httpsEnabled", False)
    return ServerConfig(
        tls=parse_tls(s.data, s._where, base_dir, management_ip != ip) if https else None,
        ip_address=ip,
        management_ip_address=management_ip,
        port=s.int("port", 1025, 1, 65535),
        management_port=s.int("managementPort", 1026, 1, 65535),
        metrics_port=s.int("metricsPort", 1027, 1, 65535),
        max_link_num=s.int("maxLinkNum", 1000, 1),
        token_timeout=s.int("tokenTimeout", 600, 1),
        e2e_timeout=s.int("e2eTimeout", 600, 1),
        allow_all_zero_ip_listening=allow_all_zero,
        max_request_length=s.int("maxRequestLength", 40, 1),
        **_pd_server(s),
    )


CONTAINER_IP_ENV = "MIES_CONTAINER_IP"
CONTAINER_MANAGEMENT_IP_ENV = "MIES_CONTAINER_MANAGEMENT_IP"


def _addresses(s: _Section, allow_all_zero: bool) -> tuple[str, str]:
    """(business, management) addresses as MindIE picks them: $MIES_CONTAINER_IP, else ipAddress;
    $MIES_CONTAINER_MANAGEMENT_IP, else managementIpAddress, else the business address."""
    ip = _address(s, "ipAddress", CONTAINER_IP_ENV, "127.0.0.1", allow_all_zero)
    management = _address(s, "managementIpAddress", CONTAINER_MANAGEMENT_IP_ENV, None, allow_all_zero)
    return ip, management or ip


def _address(s: _Section, key: str, env: str, default: Optional[str], allow_all_zero: bool) -> Optional[str]:
    configured = s.str(key, default)
    value, where = (os.environ[env], f"${env}") if os.environ.get(env) else (configured, s._where(key))
    if value is None:
        return None
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(f"{where}: must be an IPv4 or IPv6 address, got {value!r}") from None
    # MindIE: listening on every interface breaks the business/management split, so it is opt-in
    if address.is_unspecified and not allow_all_zero:
        raise ConfigError(f"{where}: {value} needs {s._where('allowAllZeroIpListening')} true")
    return value


PD_ROLES = ("prefill", "decode", "router")
_PD_ROLE_ALIASES = {"decoder": "decode"}  # MindIE's DmiModeNodeRole spelling


def _pd_server(s: _Section) -> dict:
    mode = s.str("inferMode", "standard", ("standard", "dmi"))
    raw_role = s.data.get("pdRole")
    role = _PD_ROLE_ALIASES.get(raw_role, raw_role)
    if mode == "dmi" and role not in PD_ROLES:
        raise ConfigError(f"{s._where('pdRole')}: inferMode 'dmi' needs one of {', '.join(PD_ROLES)}, got {raw_role!r}")
    if mode == "standard" and raw_role is not None:
        raise ConfigError(f"{s._where('pdRole')}: a PD role needs ServerConfig.inferMode 'dmi'")
    out = dict(infer_mode=mode, pd_role=role, inter_comm_port=s.int("interCommPort", 1121, 1, 65535),
               pd_prefill_address=s.str("pdPrefillAddress", None), pd_decode_address=s.str("pdDecodeAddress", None))
    for key, value in (("pdPrefillAddress", out["pd_prefill_address"]), ("pdDecodeAddress", out["pd_decode_address"])):
        if role == "router" and not value:
            raise ConfigError(f"{s._where(key)}: a PD router needs the node's host:port (its interCommPort)")
        if value is not None and not _is_host_port(value):
            raise ConfigError(f"{s._where(key)}: must be host:port, got {value!r}")
    return out


def _is_host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


# ModelConfig keys mindspec reads; every other key is kept in ModelConfig.extra
_MODEL_KEYS = {k for k, entry in SCHEMA[MODEL_CONFIG].items() if entry.status in (USE, EXT)}


def _parallel(s: _Section) -> dict:
    """worldSize / dp / tp / moe_ep (MindIE: tp * dp == worldSize; tp absent means 1 here, dp
    absent means worldSize / tp), checked together (mindspec.distributed.parallel_config)."""
    from mindspec.distributed.parallel_config import ParallelConfig

    world = s.int("worldSize", 1, 1)
    tp = s.int("tp", 1, 1)
    dp = s.int("dp", max(1, world // tp), 1)
    if s.int("moe_tp", 1, 1) != 1:
        raise ConfigError(f"{s._where('moe_tp')}: expert tensor parallelism is not available; use moe_ep")
    parallel = ParallelConfig(world, dp, tp, s.int("moe_ep", 1, 1), s.num("distTimeout", 600.0))
    parallel.check(s._where(""))
    return dict(world_size=world, dp=dp, tp=tp, moe_ep=parallel.moe_ep, dist_timeout=parallel.timeout_s)


def _weight_path(s: _Section, base_dir: Path) -> str:
    """The checkpoint folder: "mindspec:default" or no key is the shipped model; a relative path is
    taken from the config file's folder."""
    from mindspec.config.defaults import DEFAULT_MODEL_REF, default_model_dir  # late: defaults imports this module

    weight_path = s.str("modelWeightPath", DEFAULT_MODEL_REF)
    if weight_path == DEFAULT_MODEL_REF:
        return str(default_model_dir())
    if not weight_path:
        raise ConfigError(f"{s._where('modelWeightPath')}: must not be empty (omit it or write "
                          f"{DEFAULT_MODEL_REF!r} for the shipped model)")
    return weight_path if Path(weight_path).is_absolute() else str((base_dir / weight_path).resolve())


def _model(s: _Section, base_dir: Path) -> ModelConfig:
    weight_path = _weight_path(s, base_dir)
    raw = s.data.get("plugin_params")
    try:
        parse_plugin_params(raw)
    except PluginParamsError as exc:
        raise ConfigError(f"{s._where('plugin_params')}: {exc}") from None
    s.str("modelInstanceType", "Standard", ("Standard",))  # StandardMock: a server without a model
    return ModelConfig(
        model_name=s.str("modelName", Path(weight_path).name),
        model_weight_path=weight_path,
        backend_type=s.str("backendType", "cpu", BACKEND_TYPES),
        dtype=s.str("dtype", "auto", DTYPES + ("auto",)),
        cpu_mem_size=s.num("cpuMemSize", 5),
        npu_mem_size=s.num("npuMemSize", -1),
        plugin_params=raw,
        **_parallel(s),
        kv_trans_timeout=s.num("kv_trans_timeout", 10.0),
        kv_link_timeout=s.num("kv_link_timeout", 1080.0),
        decode_graphs=None if s.data.get("decodeGraphs") is None else s.bool("decodeGraphs", False),
        cpu_threads=s.int("cpuThreads", None, 1),
        compile_workers=s.int("compileWorkers", None, 0),
        extra={k: v for k, v in s.data.items() if k not in _MODEL_KEYS},
    )


def _deploy(s: _Section, base_dir: Path) -> ModelDeployConfig:
    models = s.data.get("ModelConfig")
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{s._where('ModelConfig')}: must be a non-empty list of models")
    truncation = s.data.get("truncation", 0)
    if isinstance(truncation, bool):
        truncation = -1 if truncation else 0
    if truncation not in TRUNCATION or isinstance(truncation, float):
        raise ConfigError(f"{s._where('truncation')}: must be 0 (reject), 1 (cut left) or -1 (cut right), got {truncation!r}")
    return ModelDeployConfig(
        max_seq_len=s.int("maxSeqLen", 2560, 2),
        max_input_token_len=s.int("maxInputTokenLen", 2048, 1),
        truncation=TRUNCATION[truncation],
        models=tuple(_model(_Section(m, f"{s._where('ModelConfig')}[{i}]"), base_dir) for i, m in enumerate(models)),
    )


def _schedule(s: _Section, max_input: int) -> ScheduleConfig:
    template = s.str("templateType", "Standard", ("Standard", "Mix"))  # Mix: SplitFuse
    enable_split = s.bool("enableSplit", False)
    if enable_split and template != "Mix":
        raise ConfigError(f"{s._where('enableSplit')}: SplitFuse needs templateType \"Mix\", got {template!r}")
    start = s.int("splitStartBatchSize", 16, 0) if s.bool("splitStartType", False) else 0
    cfg = ScheduleConfig(
        enable_split=enable_split,
        split_start_batch_size=start,
        split_chunk_tokens=s.int("splitChunkTokens", 512, 1),
        cache_block_size=s.int("cacheBlockSize", 128, 1, 128),
        max_prefill_batch_size=s.int("maxPrefillBatchSize", 50, 1),
        max_prefill_tokens=s.int("maxPrefillTokens", 8192, 1),
        max_batch_size=s.int("maxBatchSize", 200, 1),
        max_iter_times=s.int("maxIterTimes", 512, 1),
        num_blocks=s.int("numBlocks", None, 2),
        async_scheduling=s.bool("asyncScheduling", False),
        waiting_served_ratio=s.num("waitingServedRatio", 0.3, lo=0.0),
        max_waiting_steps=s.int("maxWaitingSteps", 20, 0),
    )
    if cfg.max_prefill_tokens < max_input:
        raise ConfigError(
            f"{s._where('maxPrefillTokens')}: must be >= maxInputTokenLen ({max_input}), got {cfg.max_prefill_tokens}"
        )
    return cfg


def parse_config(obj: Any, source: str = "<dict>", base_dir: Union[str, Path] = ".") -> MindieConfig:
    root = _Section(obj, "")
    warn_keys(audit_keys(root.data), source, logger)
    root.str("Version", "1.0.0", ("1.0.0",))
    backend = _Section(root.data.get("BackendConfig"), "BackendConfig")
    backend.str("backendName", "mindieservice_llm_engine", ("mindieservice_llm_engine",))
    deploy = _deploy(_Section(backend.data.get("ModelDeployConfig"), "BackendConfig.ModelDeployConfig"), Path(base_dir))
    effective_input = min(deploy.max_input_token_len, deploy.max_seq_len - 1)
    schedule = _schedule(_Section(backend.data.get("ScheduleConfig"), "BackendConfig.ScheduleConfig"), effective_input)
    return MindieConfig(
        server=_server(_Section(root.data.get("ServerConfig"), "ServerConfig"), Path(base_dir)),
        backend=BackendConfig(model_deploy=deploy, schedule=schedule),
        source=source,
    )


def load_config(path: Union[str, Path]) -> MindieConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            obj = yaml.safe_load(text)
        else:
            obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except Exception as exc:  # yaml.YAMLError carries its own line information
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    return parse_config(obj, str(path), path.parent)
