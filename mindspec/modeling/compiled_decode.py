"""torch.compile of the decode step, for backends whose ops run eagerly on the host (cpu).

At small batches a decode step is mostly per-op dispatch: a dozen thin layers issue a thousand
small ops. Inductor fuses the elementwise work into generated C++ loops and leaves the GEMMs to
the BLAS, which removes most of that overhead. What the compiled region must not contain, it
does not: the backend's ``prepare`` derives every per-forward plan (masks, gather indices) on the
host before the call, and the ops read only tensors, so one graph serves every batch size and
context length (dynamic shapes; a batch of one sequence gets its own graph, as torch specialises
size 1). Prefill stays eager: it runs once per request and its shapes vary the most.

The first call of each graph compiles (tens of seconds on a small CPU); a failed compile logs a
warning and the step runs eagerly from then on, so serving never depends on the compiler.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)


def _configure_dynamo() -> None:
    import torch._dynamo

    # Duck shapes stay on (turning them off broke guard creation in torch 2.13), so sizes that
    # happen to be equal can share a symbol and cost a recompile; room for those recompiles.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


class CompiledDecode:
    """Compiled versions of a model's decode entry points, with an eager fallback."""

    def __init__(self, model):
        _configure_dynamo()
        self.model = model
        self.enabled = True
        self._forward = torch.compile(model.forward, dynamic=True)
        self._forward_speculative = torch.compile(model.forward_speculative, dynamic=True)

    def forward(self, *args, **kwargs):
        return self._call(self._forward, self.model.forward, *args, **kwargs)

    def forward_speculative(self, *args, **kwargs):
        return self._call(self._forward_speculative, self.model.forward_speculative, *args, **kwargs)

    def _call(self, compiled: Callable, eager: Callable, *args, **kwargs):
        if not self.enabled:
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # no C++ toolchain, an unsupported op: run eagerly from now on
            log.warning("torch.compile of the decode step failed (%s: %s); running it eagerly",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.enabled = False
            return eager(*args, **kwargs)
