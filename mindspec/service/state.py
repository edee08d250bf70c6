"""What every route needs: the engine, the runner, metrics and a few facts about the model."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

from .async_engine import AsyncEngine
from .logprobs import TokenText
from .metrics import ServiceMetrics
from .runner import RequestRunner


@dataclass
class ServiceState:
    engine: AsyncEngine
    runner: RequestRunner
    metrics: ServiceMetrics
    model_name: str
    max_seq_len: int
    api_key: str | None = None
    started: int = field(default_factory=lambda: int(time.time()))

    @cached_property
    def token_text(self) -> TokenText:
        """Token display strings and bytes for logprobs and TGI token lists (cached per id)."""
        return TokenText(self.engine.tokenizer)
