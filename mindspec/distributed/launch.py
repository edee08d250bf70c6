"""Starting the ranks of a multi-process engine.

- Local (``LLM(..., dp=2)``, ``mindspec serve`` with worldSize > 1): this process is rank 0 and
  spawns ranks 1.. as ``python -m mindspec.distributed.worker SPEC``; they meet on a TCPStore at
  127.0.0.1:<free port>. A rank that dies while starting is reported at once, not after the
  timeout.
- torchrun (multi-node): every process reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
  MASTER_PORT; rank 0 serves, the others follow (``mindspec serve`` does this).

Each rank gets its own device (``cuda:LOCAL_RANK``, ``npu:LOCAL_RANK``; the cpu backend shares
the host) and joins a data-plane group on the backend's dist_backend (gloo, nccl, hccl), a gloo
control group, and its expert-parallel group.
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from mindspec.backend import backend_class, resolve_backend_name
from mindspec.config.plugin_params import parse_plugin_params
from mindspec.engine.args import EngineArgs

from . import parallel_state
from .errors import DistributedError, RankFailure
from .parallel_config import ParallelConfig, _config_error
from .parallel_state import ParallelContext

WORKER_MODULE = "mindspec.distributed.worker"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class RankSpec:
    """What a spawned rank needs to join (pickled into a temporary file)."""

    args: EngineArgs
    parallel: ParallelConfig
    rank: int
    local_rank: int
    master_addr: str
    master_port: int


# ---- per-rank engine arguments -------------------------------------------------------------------
def rank_args(args: EngineArgs, parallel: ParallelConfig, local_rank: int, prefix: str = "") -> EngineArgs:
    """This rank's device, and MTP's adaptive speculation off: it decides from each process's own
    step timings, and every rank must take the same decision."""
    device = args.device
    name = resolve_backend_name(args.backend)
    if device is None and name != "cpu":
        device = f"{name}:{local_rank}"
    return replace(args, device=device, plugin_params=_without_adaptive(args.plugin_params, prefix))


def _without_adaptive(raw, prefix: str):
    params = parse_plugin_params(raw)
    if "mtp" not in params.plugin_types:
        return raw
    if params.options.get("adaptive_speculation", False) is not False:
        raise _config_error(
            f"{prefix}plugin_params.adaptive_speculation: must be false with dp > 1 (each rank would "
            f"decide from its own timings; every rank must take the same decision)"
        )
    return params.as_dict(adaptive_speculation=False)


# ---- local launch (rank 0 here) ------------------------------------------------------------------
def start_local(args: EngineArgs, parallel: ParallelConfig, prefix: str = ""):
    """Rank 0 in this process, ranks 1.. spawned; returns rank 0's SpmdEngine."""
    from .spmd_engine import SpmdEngine

    parallel.check(prefix).check_model(args.model, prefix)
    leader_args = rank_args(args, parallel, 0, prefix)  # bad plugin_params fail before any spawn
    if dist.is_initialized():
        raise RankFailure("this process already belongs to a process group (close the other multi-process LLM first)")
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, parallel.world_size, is_master=True,
                          timeout=timedelta(seconds=parallel.timeout_s), wait_for_workers=False)
    workers = [_spawn(RankSpec(args, parallel, r, r, "127.0.0.1", port)) for r in range(1, parallel.world_size)]
    threads = torch.get_num_threads()
    try:
        _wait_for_ranks(store, workers, parallel.timeout_s)
        ctx = join_groups(parallel, 0, 0, args.backend, store)
        share_host_cores(args.backend, parallel.world_size, args.model_hidden_size())
        engine = SpmdEngine(leader_args, ctx, workers)
        engine.on_close.append(lambda: torch.set_num_threads(threads))
        return engine
    except BaseException:
        torch.set_num_threads(threads)
        for w in workers:
            w.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        parallel_state.set_current(None)
        raise


def share_host_cores(backend: str, world_size: int, hidden_size: Optional[int] = None) -> None:
    """cpu backend: ranks on one host split its cores (oversubscribed, spinning OpenMP threads of
    one rank starve the other and every collective waits for them). A count set explicitly
    ($MINDSPEC_CPU_THREADS; LLM(cpu_threads=), --threads and cpuThreads export it there under dp) is
    each rank's own and is kept. Under torchrun only LOCAL_WORLD_SIZE ranks share this host."""
    if resolve_backend_name(backend) != "cpu":
        return
    from mindspec.backends.cpu.backend import set_cpu_threads

    local = os.environ.get("LOCAL_WORLD_SIZE") if torchrun_env() is not None else None
    set_cpu_threads(None, ranks_on_host=int(local) if local and local.isdigit() else world_size, hidden_size=hidden_size)


def _spawn(spec: RankSpec) -> subprocess.Popen:
    fd, path = tempfile.mkstemp(prefix=f"mindspec-rank{spec.rank}-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(spec, f)
    return subprocess.Popen([sys.executable, "-m", WORKER_MODULE, path])


def _wait_for_ranks(store, workers: list[subprocess.Popen], timeout_s: float) -> None:
    keys = [f"mindspec/ready/{r}" for r in range(1, len(workers) + 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        for r, w in enumerate(workers, start=1):
            if w.poll() is not None:
                raise RankFailure(f"dp rank {r} (pid {w.pid}) exited with code {w.returncode} while starting")
        if time.monotonic() > deadline:
            raise RankFailure(f"dp ranks did not join within distTimeout={timeout_s:g} s")
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- every rank -----------------------------------------------------------------------------------
def join_groups(parallel: ParallelConfig, rank: int, local_rank: int, backend: str, store=None) -> ParallelContext:
    """Init the default group on the backend's dist_backend (on ``store``, else torchrun's env://
    rendezvous), then the control and ep groups (every rank creates every group, in the same
    order, as torch.distributed requires)."""
    timeout = timedelta(seconds=parallel.timeout_s)
    dist_backend = backend_class(backend).dist_backend
    where = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(dist_backend, rank=rank, world_size=parallel.world_size, timeout=timeout, **where)
    control = dist.new_group(backend="gloo", timeout=timeout)
    ep_group = None
    if parallel.moe_ep == parallel.world_size:
        ep_group = dist.group.WORLD
    elif parallel.moe_ep > 1:
        for first in range(0, parallel.world_size, parallel.moe_ep):
            group = dist.new_group(list(range(first, first + parallel.moe_ep)), timeout=timeout)
            if first <= rank < first + parallel.moe_ep:
                ep_group = group
    ctx = ParallelContext(parallel, rank, local_rank, dist.group.WORLD, ep_group, control)
    parallel_state.set_current(ctx)
    return ctx


def join_as_worker(spec: RankSpec) -> ParallelContext:
    store = dist.TCPStore(spec.master_addr, spec.master_port, spec.parallel.world_size, is_master=False,
                          timeout=timedelta(seconds=spec.parallel.timeout_s))
    store.set(f"mindspec/ready/{spec.rank}", "1")
    return join_groups(spec.parallel, spec.rank, spec.local_rank, spec.args.backend, store)


# ---- torchrun ---------------------------------------------------------------------------------------
def torchrun_env() -> Optional[tuple[int, int, int]]:
    """(rank, world size, local rank) when started by torchrun, else None."""
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def join_torchrun(args: EngineArgs, parallel: ParallelConfig, prefix: str = ""):
    """Every torchrun process: join and build this rank's SpmdEngine (rank 0 serves it, the
    others ``follow`` it)."""
    from .spmd_engine import SpmdEngine

    rank, world, local_rank = torchrun_env()
    if world != parallel.world_size:
        raise _config_error(f"{prefix}worldSize: {parallel.world_size}, but torchrun started {world} processes")
    parallel.check(prefix).check_model(args.model, prefix)
    local_args = rank_args(args, parallel, local_rank, prefix)
    ctx = join_groups(parallel, rank, local_rank, args.backend)
    share_host_cores(args.backend, parallel.world_size, args.model_hidden_size())
    return SpmdEngine(local_args, ctx)


def follow(engine) -> int:
    """A rank > 0: apply rank 0's steps until it stops (returns exit code 0) or is lost (one line
    on stderr naming the cause, then the process ends at once with exit code 1)."""
    try:
        engine.follow()
        engine.close()
    except (DistributedError, RuntimeError) as exc:
        cause = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        print(f"mindspec dp rank {engine.ctx.rank}: stopping: {cause}", file=sys.stderr, flush=True)
        exit_without_teardown(1)
    return 0


def exit_without_teardown(code: int) -> None:
    """End a rank whose process group is broken. A normal interpreter exit tears down gloo's
    context with a dead peer, and its worker threads can then abort the process (SIGABRT, seen on
    CI: pytorch/pytorch#179291); a broken group has nothing left worth releasing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- entry point for LLM and the server -------------------------------------------------------------
def build_engine(args: EngineArgs, parallel: Optional[ParallelConfig] = None, prefix: str = ""):
    """A plain LLMEngine for one process; else rank 0 of a local multi-process engine."""
    if parallel is None or not parallel.check(prefix).is_distributed:
        from mindspec.engine.llm_engine import LLMEngine

        return LLMEngine(args)
    if args.scheduler.async_scheduling:
        raise _config_error(f"BackendConfig.ScheduleConfig.asyncScheduling: not available with dp > 1 (dp={parallel.dp})")
    if args.scheduler.split_fuse or parse_plugin_params(args.plugin_params).splitfuse:
        raise _config_error(f"BackendConfig.ScheduleConfig.enableSplit (SplitFuse, or plugin_type splitfuse): not "
                            f"available with dp > 1 (dp={parallel.dp})")
    engine = start_local(args, parallel, prefix)
    atexit.register(engine.close)  # followers stop cleanly even if the caller forgets close()
    return engine
