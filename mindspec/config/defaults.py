"""The out-of-the-box set-up: the shipped default model with MTP (K = 3) on the cpu backend, and
the ready-made config files.

``configs/config.json`` in the repository says the same in MindIE's format; a test keeps the two
in step. ``LLM()``, ``mindspec generate`` and ``mindspec serve`` without a model or config use it.
``"modelWeightPath": "mindspec:default"`` (or no modelWeightPath) names the shipped model, so a
copied config works from any folder. The wheel carries ``configs/*.json`` as
``mindspec/configs/*.json``; ``shipped_config_path("config_cpu_no_mtp")`` finds one by name.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

from mindspec.config.mindie_config import ConfigError, MindieConfig, parse_config

PACKAGE_DIR = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = PACKAGE_DIR / "assets" / "default_model"
DEFAULT_MODEL_REF = "mindspec:default"  # modelWeightPath naming the shipped model
DEFAULT_PLUGIN_PARAMS = '{"plugin_type": "mtp", "num_speculative_tokens": 3}'
# an installed wheel has mindspec/configs/; a source checkout has the top-level configs/
SHIPPED_CONFIG_DIRS = (PACKAGE_DIR / "configs", PACKAGE_DIR.parent / "configs")


def default_model_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ConfigError(f"the default model is missing from this installation ({DEFAULT_MODEL_DIR}); pass a model directory")
    return DEFAULT_MODEL_DIR


def default_config_dict(model_weight_path: str = DEFAULT_MODEL_REF) -> dict:
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
    return parse_config(default_config_dict(), source="<default>")


def shipped_config_names() -> list[str]:
    """Names of the ready-made configs (file names without .json)."""
    folder = _shipped_config_dir()
    return sorted(p.stem for p in folder.glob("*.json")) if folder else []


def shipped_config_path(name: str) -> Path:
    """The ready-made config called ``name`` ("config_cpu_no_mtp" or "config_cpu_no_mtp.json")."""
    folder = _shipped_config_dir()
    stem = name[:-len(".json")] if name.endswith(".json") else name
    path = folder / f"{stem}.json" if folder and "/" not in stem and stem not in ("", ".", "..") else None
    if path is None or not path.is_file():
        raise ConfigError(f"no shipped config named {name!r}; shipped configs: {', '.join(shipped_config_names()) or 'none'}")
    return path


def find_config(path_or_name: Union[str, Path]) -> Path:
    """A config file's path: an existing file as given, else a shipped config of that name."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    if len(path.parts) == 1 and path.suffix in ("", ".json"):
        try:
            return shipped_config_path(str(path_or_name))
        except ConfigError:
            pass
    raise ConfigError(f"config file {str(path_or_name)!r} does not exist, and no shipped config has that name "
                      f"(shipped configs: {', '.join(shipped_config_names()) or 'none'})")


def _shipped_config_dir():
    return next((d for d in SHIPPED_CONFIG_DIRS if d.is_dir() and any(d.glob("*.json"))), None)
