"""How many processes and how they split the model: MindIE's worldSize / dp / tp / moe_ep.

mindspec runs attention data parallel: every rank holds the attention weights and its own KV
cache, and keeps its own requests (``dp`` ranks, ``dp * tp == worldSize`` with ``tp == 1``).
Routed experts are split over groups of ``moe_ep`` consecutive ranks (each rank holds
``n_routed_experts / moe_ep`` of them); with ``moe_ep < worldSize`` each group holds all experts
(MindIE would call the rest ``moe_tp``; mindspec replicates experts instead of slicing them).

Every bad combination is one ConfigError naming the key (its JSON path when read from
config.json, the keyword when given to ``LLM``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Where a MindIE config.json keeps the parallel fields: the prefix of their error messages.
MODEL_CONFIG_PATH = "BackendConfig.ModelDeployConfig.ModelConfig[0]."
DEFAULT_TIMEOUT_S = 600.0  # MindIE's tokenTimeout default; collectives wait at most this long


def _config_error(message: str) -> Exception:
    from mindspec.config.mindie_config import ConfigError  # late: mindie_config imports this module

    return ConfigError(message)


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1
    dp: int = 1
    tp: int = 1
    moe_ep: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S  # collectives and rendezvous (mindspec key distTimeout)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def check(self, prefix: str = "") -> "ParallelConfig":
        """Raise ConfigError naming ``prefix + key`` for the first bad value; returns self."""
        for key in ("dp", "tp", "moe_ep", "world_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _config_error(f"{prefix}{_KEY[key]}: must be an integer >= 1, got {value!r}")
        if self.tp != 1:
            raise _config_error(
                f"{prefix}tp: tensor parallelism is not available in mindspec (got tp={self.tp}); "
                f"use dp (attention data parallel) with moe_ep (expert parallel)"
            )
        if self.dp * self.tp != self.world_size:
            raise _config_error(
                f"{prefix}dp: dp ({self.dp}) x tp ({self.tp}) must equal {_KEY['world_size']} ({self.world_size})"
            )
        if self.world_size % self.moe_ep:
            raise _config_error(f"{prefix}moe_ep: {self.moe_ep} does not divide {_KEY['world_size']} ({self.world_size})")
        if not self.timeout_s > 0:
            raise _config_error(f"{prefix}distTimeout: must be > 0 seconds, got {self.timeout_s!r}")
        return self

    def check_model(self, model_dir: str | Path, prefix: str = "") -> None:
        """The expert split must fit the checkpoint: moe_ep divides n_routed_experts."""
        if self.moe_ep == 1:
            return
        from mindspec.modeling.errors import CheckpointError
        from mindspec.modeling.loader import read_hf_config

        path = model_dir
        try:
            experts = read_hf_config(model_dir).get("n_routed_experts")
        except (OSError, ValueError, CheckpointError):
            return  # the model loader reports an unreadable checkpoint with its own error
        if not experts:
            raise _config_error(f"{prefix}moe_ep: {self.moe_ep} needs a MoE model; {path} has no n_routed_experts")
        if experts % self.moe_ep:
            raise _config_error(
                f"{prefix}moe_ep: {self.moe_ep} does not divide the checkpoint's {experts} routed experts ({path})"
            )


# Config-file spelling of each field (MindIE's keys).
_KEY = {"world_size": "worldSize", "dp": "dp", "tp": "tp", "moe_ep": "moe_ep"}
