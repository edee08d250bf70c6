"""The Python API: ``LLM(model=DIR)`` or ``LLM(config=config.json)``, then ``generate``."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from mindspec.distributed.launch import MODEL_CONFIG_PATH, build_engine
from mindspec.distributed.parallel_config import ParallelConfig
from mindspec.engine.args import EngineArgs
from mindspec.engine.llm_engine import LLMEngine, Prompt
from mindspec.engine.outputs import RequestOutput
from mindspec.engine.scheduler import SchedulerConfig
from mindspec.text_generator.sampling.params import SamplingParams


class LLM:
    """Offline generation. With neither ``model`` nor ``config`` it runs the shipped default model
    with MTP (num_speculative_tokens 3).

    >>> llm = LLM(model="path/to/deepseek", backend="cpu", dtype="float32")
    >>> llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=32))[0].text
    """

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        config: Optional[Union[str, Path]] = None,
        backend: str = "cpu",
        dtype: str = "auto",
        plugin_params: Union[str, dict, None] = None,
        cache_block_size: int = 128,
        num_blocks: Optional[int] = None,
        kv_cache_gb: Optional[float] = None,
        device: Optional[str] = None,
        progress: bool = True,
        dp: int = 1,
        moe_ep: int = 1,
        dist_timeout: float = 600.0,
        decode_graphs: Optional[bool] = None,
        **scheduler_limits,
    ):
        if model is not None and config is not None:
            raise ValueError("pass model=DIR or config=PATH_TO_CONFIG_JSON, not both")
        # dp ranks (attention data parallel) with moe_ep-way expert parallel: dp - 1 more processes
        parallel, where = ParallelConfig(world_size=dp, dp=dp, moe_ep=moe_ep, timeout_s=dist_timeout), ""
        if model is None and config is None:  # the shipped default model, MTP on (K = 3)
            from mindspec.config.defaults import default_config

            args = EngineArgs.from_mindie_config(default_config(), progress=progress)
            _override(args, plugin_params=plugin_params, num_blocks=num_blocks, kv_cache_gb=kv_cache_gb,
                      device=device, decode_graphs=decode_graphs, **scheduler_limits)
        elif config is not None:
            from mindspec.config.mindie_config import load_config

            mindie = load_config(config)
            args = EngineArgs.from_mindie_config(mindie, progress=progress)
            parallel, where = mindie.model.parallel, MODEL_CONFIG_PATH
        else:
            args = EngineArgs(
                model=str(model),
                backend=backend,
                dtype=dtype,
                device=device,
                plugin_params=plugin_params,
                cache_block_size=cache_block_size,
                num_blocks=num_blocks,
                kv_cache_gb=kv_cache_gb,
                scheduler=SchedulerConfig(**scheduler_limits),
                progress=progress,
                decode_graphs=decode_graphs,
            )
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
