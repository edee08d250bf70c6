"""Per-step accounting of a decode step's host work: device ops launched outside compiled graphs
or packages, host synchronisations, host-to-device copies.

A TorchDispatchMode sees every op torch dispatches while it is active. Compiled steps hide what
runs inside them (``outside_accounting``: the graph runner's replay and an exported package's
call), so what is counted is exactly what the engine still launches op by op. View ops (they
launch no kernel) are not counted. A host synchronisation is a read of a tensor's value on the
host (``item``, ``tolist``, ``bool``: ``aten._local_scalar_dense``) or a copy from a device to the
host; on the cpu backend everything is on the host, so only the value reads count.

``Tensor.to`` (and ``cpu``, ``cuda``, ``double`` ...) of an inference tensor, as every tensor a
forward under ``torch.inference_mode`` returns is, copies without passing the dispatch mode (no
``aten._to_copy`` reaches it): a function mode beside it counts those copies.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}
_TO_METHODS = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.double, torch.Tensor.float,
               torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.long, torch.Tensor.int, torch.Tensor.bool,
               torch.Tensor.type}


@dataclass
class StepCounts:
    ops_outside_graphs: float = 0.0
    host_syncs: float = 0.0
    h2d_copies: float = 0.0
    steps: int = 0
    by_op: Counter = field(default_factory=Counter)  # the counted ops by name (aten overload)

    def per_step(self, by_op: bool = False) -> dict:
        """The counts per step; ``by_op`` adds ``ops``: each counted op's launches per step, most first."""
        n = max(self.steps, 1)
        out = {"ops_outside_graphs": self.ops_outside_graphs / n, "host_syncs": self.host_syncs / n,
               "h2d_copies": self.h2d_copies / n, "steps": self.steps}
        if by_op:
            out["ops"] = {name: count / n for name, count in self.by_op.most_common()}
        return out


class StepAccounting(TorchDispatchMode):
    """Counts ops, host synchronisations and host-to-device copies while active."""

    def __init__(self):
        super().__init__()
        self.counts = StepCounts()
        self._inference_copies = _InferenceCopies(self)

    def __enter__(self):
        self._inference_copies.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._inference_copies.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _LOCAL_SCALAR:  # a read, not a launch
            self.counts.host_syncs += 1
            return out
        if func in _COPIES:
            src, dst = _copy_devices(func, args, kwargs, out)
            if src is not None:
                self.count_copy(src, dst)
        if not func.is_view:
            self.count_op(str(func))
        return out

    def count_op(self, name: str) -> None:
        self.counts.ops_outside_graphs += 1
        self.counts.by_op[name] += 1

    def count_copy(self, src: torch.device, dst: torch.device) -> None:
        if src.type == "cpu" and dst.type != "cpu":
            self.counts.h2d_copies += 1
        elif src.type != "cpu" and dst.type == "cpu":
            self.counts.host_syncs += 1


class _InferenceCopies(TorchFunctionMode):
    """The copies ``Tensor.to`` and its kin make of inference tensors, which the dispatch mode
    does not see, counted as the ``aten._to_copy`` they are; only while ``accounting`` is the
    current dispatch mode (not inside ``outside_accounting``)."""

    def __init__(self, accounting: StepAccounting):
        super().__init__()
        self.accounting = accounting

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args else None
        if (func in _TO_METHODS and isinstance(src, torch.Tensor) and src.is_inference()
                and isinstance(out, torch.Tensor) and out is not src
                and _get_current_dispatch_mode() is self.accounting):
            self.accounting.count_copy(src.device, out.device)
            self.accounting.count_op(str(torch.ops.aten._to_copy.default))
        return out


def _copy_devices(func, args, kwargs, out):
    """(source device, destination device) of a copy op, or (None, None)."""
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        return src.device, dst.device
    src = args[0]
    return (src.device, out.device) if isinstance(out, torch.Tensor) else (None, None)


@contextmanager
def outside_accounting() -> Iterator[None]:
    """Runs a compiled graph or package unseen by an active StepAccounting (its ops are not
    launched one by one by the host), or exports one without the accounting's modes in the
    way; a no-op otherwise."""
    mode = _get_current_dispatch_mode()
    if not isinstance(mode, StepAccounting):
        yield
        return
    with _disable_current_modes(), _function_mode_popped(mode._inference_copies):
        yield


@contextmanager
def _function_mode_popped(mode: TorchFunctionMode) -> Iterator[None]:
    stack = torch._C._len_torch_function_stack()
    if not stack or torch._C._get_function_stack_at(stack - 1) is not mode:
        yield
        return
    with _pop_mode_temporarily():
        yield


def account_decode_steps(llm, prompt: list[int], steps: int = 8, num_seqs: int = 1, by_op: bool = False,
                         temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None) -> dict:
    """Counts per decode step of ``num_seqs`` copies of ``prompt`` on an LLM or its engine:
    prefill first (not counted), then ``steps`` engine steps, each a decode step (speculative
    where the engine speculates); greedy unless ``temperature`` (and ``top_p``, ``seed``) say
    otherwise. ``by_op``: which ops, too (``StepCounts.per_step``)."""
    from mindspec.text_generator.sampling.params import SamplingParams

    engine = getattr(llm, "engine", llm)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=steps * 8 + 16,
                            ignore_eos=True)
    states = [engine.add_request(list(prompt), params) for _ in range(num_seqs)]
    engine.step()  # prefill
    engine.step()  # the first decode step sets up per-sequence state: counted from the next one
    mode = StepAccounting()
    with mode:
        for _ in range(steps):
            engine.step()
    mode.counts.steps = steps
    # Aborted, not decoded to the end: the steps after these would let adaptive speculation
    # choose arms by measured step times, which vary between runs, and a start-up warm-up
    # (LLMEngine.warmup_decode) would then meet different compiled-step shapes every time.
    for state in states:
        engine.abort(state.request_id)
    return mode.counts.per_step(by_op)
