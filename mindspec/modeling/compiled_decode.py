"""torch.compile of the decode step's one-row blocks, for backends whose ops run eagerly on the
host (cpu).

At batch 1 a decode step is mostly per-op dispatch: a dozen thin layers issue a thousand small
ops. Inductor fuses the elementwise work into generated C++ loops and leaves the GEMMs to the
BLAS, which removes much of that overhead.

What is compiled is one decoder block, not the whole step (regional compilation, as PyTorch
recommends for stacks of repeated blocks): the compiled code takes the block as an argument and
its weights as inputs, so one graph serves the main model's MoE layers and every MTP module's
block, another the dense first layer. The embedding, the final norm, the heads and the draft loop
stay eager. Compiling the whole step instead unrolled every layer into one graph: on a 2-core
CPU that took 2 minutes for one sequence's main model and 3 more for batches, and the
speculative step did not finish in 26 minutes; the blocks compile in 10-20 seconds.

Only blocks over one row run compiled (a batch-1 decode step, an MTP Eagle draft step on one
lm_head row): there the sizes are known and the compiled block beats eager (main-model forward
2.6 against 3.5 ms at batch 1). Over more rows the graph must take symbolic sizes, and on this
model it lost to eager at every size measured (0.82-0.96x at 4 and 16 rows: the generated
wrapper's Python and Dynamo's guard checks over the cached graphs cost 70-130 us a block, more
than the fused loops save), so those blocks run eagerly. Prefill stays eager.

What the compiled region must not contain, it does not: the backend's ``prepare`` derives every
per-forward plan (masks, gather indices) on the host before the call, and the ops read only
tensors, so the graph serves every context length (the cache dimension stays symbolic).

The first call of each graph compiles; a failed compile logs a warning and the step runs eagerly
from then on (cache writes are idempotent, so the failed step simply runs again), so serving
never depends on the compiler.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

log = logging.getLogger(__name__)


def _configure_dynamo() -> None:
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    # No duck shapes: a context length that happens to equal another size (the number of heads)
    # would otherwise share its symbol and cost a recompile in the middle of serving.
    fx_config.use_duck_shape = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


def decoder_blocks(model) -> list:
    """Every decoder block of the model: the main layers, then each MTP module's block."""
    return list(model.layers) + [m.block for m in model.mtp_modules]


class CompiledDecode:
    """The model's decode entry points with its one-row blocks compiled, and an eager fallback."""

    def __init__(self, model):
        _configure_dynamo()
        self.model = model
        self.enabled = True
        self.compiled_calls = 0  # blocks that ran compiled (diagnostics, tests)
        self.blocks = decoder_blocks(model)
        eager = type(self.blocks[0]).forward_eager
        self.compiled_block: Callable = torch.compile(eager, dynamic=True)

        def block(layer, x: torch.Tensor, *args):
            if x.shape[0] != 1:
                return eager(layer, x, *args)
            self.compiled_calls += 1
            return self.compiled_block(layer, x, *args)

        self._block = block

    def forward(self, *args, **kwargs):
        return self._call(self.model.forward, *args, **kwargs)

    def forward_speculative(self, *args, **kwargs):
        return self._call(self.model.forward_speculative, *args, **kwargs)

    def _call(self, entry: Callable, *args, **kwargs):
        if not self.enabled:
            return entry(*args, **kwargs)
        try:
            with self._compiled_blocks():
                return entry(*args, **kwargs)
        except Exception as exc:  # no C++ toolchain, an unsupported op: run eagerly from now on
            log.warning("torch.compile of the decode step failed (%s: %s); running it eagerly",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.enabled = False
            return entry(*args, **kwargs)

    @contextmanager
    def _compiled_blocks(self) -> Iterator[None]:
        """Blocks run compiled only inside a decode call: prefill and the MTP prefill stay eager."""
        for block in self.blocks:
            block.compiled_forward = self._block
        try:
            yield
        finally:
            for block in self.blocks:
                block.compiled_forward = None
