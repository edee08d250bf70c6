"""The out-of-the-box set-up: the shipped default model with MTP (K = 3) on the cpu backend.

``configs/config.json`` in the repository says the same in MindIE's format; a test keeps the two
in step. ``LLM()``, ``mindspec generate`` and ``mindspec serve`` without a model or config use it.
"""
from __future__ import annotations

from pathlib import Path

from mindspec.config.mindie_config import ConfigError, MindieConfig, parse_config

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "default_model"
DEFAULT_PLUGIN_PARAMS = '{"plugin_type": "mtp", "num_speculative_tokens": 3}'


def default_model_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ConfigError(f"the default model is missing from this installation ({DEFAULT_MODEL_DIR}); pass a model directory")
    return DEFAULT_MODEL_DIR


def default_config_dict(model_weight_path: str) -> dict:
    return {
        "Version": "1.0.0",
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 1025, "managementPort": 1026, "metricsPort": 1027,
                         "httpsEnabled": False},
        "BackendConfig": {
            "backendName": "mindieservice_llm_engine",
            "ModelDeployConfig": {
                "maxSeqLen": 2048,
                "maxInputTokenLen": 1536,
                "truncation": 0,
                "ModelConfig": [{
                    "modelInstanceType": "Standard",
                    "modelName": "mindspec-default",
                    "modelWeightPath": model_weight_path,
                    "worldSize": 1,
                    "cpuMemSize": 1,
                    "npuMemSize": -1,
                    "backendType": "cpu",
                    "dtype": "float32",
                    "plugin_params": DEFAULT_PLUGIN_PARAMS,
                }],
            },
            "ScheduleConfig": {"templateType": "Standard", "cacheBlockSize": 16, "maxPrefillBatchSize": 16,
                               "maxPrefillTokens": 8192, "maxBatchSize": 32, "maxIterTimes": 512},
        },
    }


def default_config() -> MindieConfig:
    return parse_config(default_config_dict(str(default_model_dir())), source="<default>")
