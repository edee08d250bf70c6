"""The Python API: ``LLM(model=DIR)`` or ``LLM(config=config.json | shipped name)``, then ``generate``."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

# Nothing imported here loads torch: the model's arguments (a config's errors among them) are
# resolved before the engine's modules load, which takes seconds.
from mindspec.distributed.parallel_config import MODEL_CONFIG_PATH, ParallelConfig
from mindspec.engine.args import EngineArgs
from mindspec.engine.scheduler import SchedulerConfig
from mindspec.modeling.model_path import check_model_path

if TYPE_CHECKING:
    from mindspec.engine.llm_engine import Prompt
    from mindspec.engine.outputs import RequestOutput
    from mindspec.text_generator.sampling.params import SamplingParams


class LLM:
    """Offline generation. With neither ``model`` nor ``config`` it runs the shipped default model
    with MTP (num_speculative_tokens 3). Keywords left at None keep the model's own setting (the
    shipped model's, the config's, or EngineArgs' defaults for ``model=``); a keyword given replaces
    it, with the shipped model and a config too (``LLM(backend="npu")`` runs the shipped model on
    npu or fails saying why). ``cpu_threads``: intra-op threads of the cpu backend (see
    ``mindspec.backends.cpu.backend.set_cpu_threads`` for the default policy).

    >>> llm = LLM(model="path/to/deepseek", backend="cpu", dtype="float32")
    >>> llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=32))[0].text
    """

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        config: Optional[Union[str, Path]] = None,
        backend: Optional[str] = None,
        dtype: Optional[str] = None,
        plugin_params: Union[str, dict, None] = None,
        cache_block_size: Optional[int] = None,
        num_blocks: Optional[int] = None,
        kv_cache_gb: Optional[float] = None,
        device: Optional[str] = None,
        progress: bool = True,
        dp: int = 1,
        moe_ep: int = 1,
        dist_timeout: float = 600.0,
        decode_graphs: Optional[bool] = None,
        compile_workers: Optional[int] = None,
        cpu_threads: Optional[int] = None,
        enable_prefix_caching: Optional[bool] = None,
        **scheduler_limits,
    ):
        if model is not None and config is not None:
            raise ValueError("pass model=DIR or config=PATH_TO_CONFIG_JSON, not both")
        # None means "the model's own default" (EngineArgs' for model=, the shipped model's or the
        # config's otherwise); a value given always replaces it, never silently ignored.
        given = dict(backend=backend, dtype=dtype, plugin_params=plugin_params, cache_block_size=cache_block_size,
                     num_blocks=num_blocks, kv_cache_gb=kv_cache_gb, device=device, decode_graphs=decode_graphs,
                     compile_workers=compile_workers, enable_prefix_caching=enable_prefix_caching)
        # dp ranks (attention data parallel) with moe_ep-way expert parallel: dp - 1 more processes
        parallel, where = ParallelConfig(world_size=dp, dp=dp, moe_ep=moe_ep, timeout_s=dist_timeout), ""
        if model is None and config is None:  # the shipped default model, MTP on (K = 3)
            from mindspec.config.defaults import default_config

            args = EngineArgs.from_mindie_config(default_config(), progress=progress)
            _override(args, **given, **scheduler_limits)
        elif config is not None:
            from mindspec.config.defaults import find_config
            from mindspec.config.mindie_config import load_config

            mindie = load_config(find_config(config))  # a path, or a shipped config's name
            args = EngineArgs.from_mindie_config(mindie, progress=progress)
            _override(args, **given, **scheduler_limits)
            parallel, where = mindie.model.parallel, MODEL_CONFIG_PATH
        else:
            args = EngineArgs(
                model=str(model),
                scheduler=SchedulerConfig(**scheduler_limits),
                progress=progress,
                **{k: v for k, v in given.items() if v is not None},
            )
        check_model_path(args.model)  # before torch loads: a wrong path answers at once
        # the keyword beats $MINDSPEC_CPU_THREADS, which beats the config's cpuThreads
        args.apply_cpu_threads(cpu_threads)
        from mindspec.distributed.launch import build_engine

        with _environ(args.rank_thread_env(parallel.is_distributed)):  # while dp ranks start
            self.engine = build_engine(args, parallel, where)

    def close(self) -> None:
        """Stop the other ranks of a multi-process engine (dp > 1); nothing to do otherwise."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
    ) -> list[RequestOutput]:
        """A prompt is a string or a list of token ids; returns one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return self.engine.generate(list(prompts), sampling_params)


def _override(args: EngineArgs, **given) -> None:
    """Arguments passed along with the shipped default model replace its config's values."""
    for key, value in given.items():
        if value is None:
            continue
        target = args.scheduler if hasattr(args.scheduler, key) else args
        if not hasattr(target, key):
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
        setattr(target, key, value)
    args.validate()


@contextmanager
def _environ(values: dict[str, str]):
    """``values`` in os.environ for the block only (spawned processes copy it when they start)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
