"""MindIE-style config.json reading (mindie_config), its key table (schema), HTTPS files (tls) and
the shipped model and ready-made configs (defaults)."""
from mindspec.config.defaults import find_config, shipped_config_names, shipped_config_path
from mindspec.config.mindie_config import ConfigError, MindieConfig, load_config, parse_config

__all__ = ["ConfigError", "MindieConfig", "find_config", "load_config", "parse_config", "shipped_config_names",
           "shipped_config_path"]
