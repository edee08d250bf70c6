"""EngineArgs: everything needed to build an engine, from Python keywords or a MindIE config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .scheduler import SchedulerConfig

GiB = 1 << 30
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: must be an integer >= {lo}, got {value!r}")


def default_compile_workers() -> int:
    """Compile processes of a server: one per core, at most 4 (each holds a copy of the step's
    program; they run at the lowest priority, so the server keeps the cores it uses)."""
    return max(1, min(4, os.cpu_count() or 1))


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
    # Decode steps as captured graphs (cuda/npu) or compiled AOTInductor packages (cpu); None: on where the backend
    # captures graphs, off on cpu (compiling takes minutes there).
    decode_graphs: Optional[bool] = None
    # cpu packages: worker processes that compile a shape first met while the step runs eagerly
    # (exported_step.py); 0: it compiles on the calling thread, the step waiting. A MindIE config
    # without compileWorkers gets default_compile_workers() (a server must not stall its requests).
    compile_workers: int = 0
    # Intra-op threads of the cpu backend, per process (LLM(cpu_threads=), --threads, ModelConfig
    # cpuThreads); None: $MINDSPEC_CPU_THREADS, else the default policy of
    # mindspec.backends.cpu.backend.set_cpu_threads.
    cpu_threads: Optional[int] = None
    # Automatic prefix caching (engine/prefix_cache.py); also on with plugin_type "prefix_cache".
    enable_prefix_caching: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> "EngineArgs":
        """Raise one ValueError naming the first bad field; returns self. Run on construction and
        after fields are replaced, before a checkpoint loads, so a bad value fails at once."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check_int("cache_block_size", self.cache_block_size, 1)
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 2)  # one block is the reserved dummy block
        gb = self.kv_cache_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0):
            raise ValueError(f"kv_cache_gb: must be a number > 0 (GB), got {self.kv_cache_gb!r}")
        _check_int("compile_workers", self.compile_workers, 0)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching: must be true or false, got {self.enable_prefix_caching!r}")
        if self.cpu_threads is not None:
            from mindspec.backends.cpu.backend import check_cpu_threads

            self.cpu_threads = check_cpu_threads(self.cpu_threads, "cpu_threads")
        return self

    def apply_cpu_threads(self, explicit: Optional[int] = None) -> Optional[int]:
        """Resolve and set this process's cpu threads before the engine is built: ``explicit``
        (LLM keyword, --threads) > $MINDSPEC_CPU_THREADS > this args' cpu_threads (the config's
        cpuThreads) > the default policy; a count chosen is stored in cpu_threads. Only the cpu
        backend sets torch's threads (others keep torch's setting). Returns the count set, or None."""
        from mindspec.backends.cpu.backend import THREADS_ENV, check_cpu_threads, cpu_threads_from_env, set_cpu_threads

        from_env = cpu_threads_from_env()
        if explicit is not None:
            self.cpu_threads, source = check_cpu_threads(explicit, "cpu_threads"), "requested"
        elif from_env is not None:
            self.cpu_threads, source = from_env, f"${THREADS_ENV}"
        else:
            source = "config cpuThreads"
        if not self._on_cpu():
            return None
        return set_cpu_threads(self.cpu_threads, source=source, hidden_size=self.model_hidden_size())

    def model_hidden_size(self) -> Optional[int]:
        """The checkpoint's hidden_size (config.json), for the cpu thread default; None if unreadable
        (the loader reports a bad checkpoint with its own error)."""
        from mindspec.modeling.errors import CheckpointError
        from mindspec.modeling.loader import read_hf_config
        from mindspec.modeling.model_path import is_gguf

        try:
            if is_gguf(self.model):
                value = read_hf_config(self.model).get("hidden_size")
            else:
                value = json.loads((Path(self.model) / "config.json").read_text(encoding="utf-8")).get("hidden_size")
        except (OSError, ValueError, AttributeError, CheckpointError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def rank_thread_env(self, distributed: bool) -> dict[str, str]:
        """What dp ranks need in their environment to keep a chosen count: spawned ranks and
        share_host_cores (which sets each rank's threads, every rank's own) read
        $MINDSPEC_CPU_THREADS. Empty without dp, off cpu, or with no count chosen."""
        from mindspec.backends.cpu.backend import THREADS_ENV

        if not distributed or self.cpu_threads is None or not self._on_cpu():
            return {}
        return {THREADS_ENV: str(self.cpu_threads)}

    def _on_cpu(self) -> bool:
        from mindspec.backend import resolve_backend_name

        return resolve_backend_name(self.backend) == "cpu"

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
            compile_workers=default_compile_workers() if model.compile_workers is None else model.compile_workers,
            cpu_threads=getattr(model, "cpu_threads", None),  # ModelConfig.cpuThreads
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
                split_fuse=sched.enable_split,
                split_chunk_tokens=sched.split_chunk_tokens,
                split_start_batch_size=sched.split_start_batch_size,
            ),
        )
        for key, value in overrides.items():
            setattr(args, key, value)
        return args.validate()
