"""EngineArgs: everything needed to build an engine, from Python keywords or a MindIE config.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .scheduler import SchedulerConfig

GiB = 1 << 30


@dataclass
class EngineArgs:
    model: str
    backend: str = "cpu"
    dtype: str = "auto"  # "auto": float32 on cpu, bfloat16 on accelerators
    device: Optional[str] = None
    plugin_params: Union[str, dict, None] = None
    cache_block_size: int = 128
    num_blocks: Optional[int] = None  # fixed KV block count; else from the memory budget
    kv_cache_gb: Optional[float] = None  # MindIE cpuMemSize / npuMemSize (GB); None/-1 = auto
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    progress: bool = True
    warmup: bool = True
    # Decode steps as captured graphs (cuda/npu) or torch.compile (cpu); None: on where the backend
    # captures graphs, off on cpu (compiling takes minutes there).
    decode_graphs: Optional[bool] = None

    def resolved_dtype(self, backend_name: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if backend_name == "cpu" else "bfloat16"

    @classmethod
    def from_mindie_config(cls, config: Any, **overrides) -> "EngineArgs":
        """From a parsed MindIE config (mindspec.config.mindie_config.MindieConfig)."""
        model = config.model
        deploy = config.backend.model_deploy
        sched = config.backend.schedule
        backend = model.backend_type
        mem_gb = model.cpu_mem_size if backend == "cpu" else model.npu_mem_size
        args = cls(
            model=str(model.model_weight_path),
            backend=backend,
            dtype=model.dtype,
            plugin_params=model.plugin_params,
            decode_graphs=model.decode_graphs,
            cache_block_size=sched.cache_block_size,
            num_blocks=sched.num_blocks,
            kv_cache_gb=None if mem_gb is None or mem_gb < 0 else float(mem_gb),
            scheduler=SchedulerConfig(
                max_batch_size=sched.max_batch_size,
                max_prefill_batch_size=sched.max_prefill_batch_size,
                max_prefill_tokens=sched.max_prefill_tokens,
                max_seq_len=deploy.max_seq_len,
                max_input_token_len=deploy.max_input_token_len,
                max_iter_times=sched.max_iter_times,
                truncation=deploy.truncation,
                async_scheduling=sched.async_scheduling,
                waiting_served_ratio=sched.waiting_served_ratio,
                max_waiting_steps=sched.max_waiting_steps,
            ),
        )
        for key, value in overrides.items():
            setattr(args, key, value)
        return args
