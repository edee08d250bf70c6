"""A rank that hangs or dies is reported with one clear error; rank 0 waits at most distTimeout
and never hangs; the engine refuses further work instead of computing wrong outputs."""
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from mindspec import LLM, SamplingParams
from mindspec.distributed.errors import RankFailure
from mindspec.distributed.spmd_engine import SpmdEngine
from tests.support.checkpoints import make_checkpoint, tiny_v3_config

TIMEOUT_S = 8  # a normal step, or a rank starting on a loaded 2-core machine, stays far below it
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dp_fail"), tiny_v3_config(initializer_range=0.2), seed=3)


def _dp2(path):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=64, progress=False,
               dp=2, moe_ep=2, dist_timeout=TIMEOUT_S)


def test_a_hung_rank_fails_the_step_after_the_timeout(checkpoint):
    llm = _dp2(checkpoint)
    worker = llm.engine.workers[0]
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 4
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="a dp rank failed") as err:
            llm.generate([[5, 6, 7]], GREEDY)
        assert time.monotonic() - start < TIMEOUT_S + 15
        assert f"distTimeout={TIMEOUT_S} s" in str(err.value)
        with pytest.raises(RankFailure):  # and every later call, at once
            llm.generate([[8]], GREEDY)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < 15


def test_a_dead_rank_is_named(checkpoint):
    llm = _dp2(checkpoint)
    worker = llm.engine.workers[0]
    try:
        worker.kill()
        worker.wait(10)
        start = time.monotonic()
        with pytest.raises(RankFailure, match=rf"rank 1 \(pid {worker.pid}\) exited with code -9"):
            llm.generate([[5, 6, 7]], GREEDY)
        assert time.monotonic() - start < TIMEOUT_S + 10
    finally:
        llm.close()


def _engine_with(workers) -> SpmdEngine:
    """The failure bookkeeping of a leader, without a process group (only `_fail` runs)."""
    engine = SpmdEngine.__new__(SpmdEngine)
    engine.workers, engine.failure = list(workers), None
    engine.ctx = SimpleNamespace(config=SimpleNamespace(timeout_s=20))
    return engine


def test_a_rank_still_dying_when_its_socket_closes_is_named():
    # A killed rank's sockets close while the kernel tears it down: the collective fails
    # ("Connection reset by peer") a moment before the exit can be reaped.
    dying = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"])
    try:
        failure = _engine_with([dying])._fail(RuntimeError("Read error: Connection reset by peer"))
        assert f"rank 1 (pid {dying.pid}) exited with code 3" in str(failure)
        assert "distTimeout=20 s" in str(failure)
    finally:
        dying.kill()
        dying.wait()


def test_a_collective_error_with_every_rank_alive_is_quoted_after_a_short_grace():
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        failure = _engine_with([alive])._fail(RuntimeError("Read error: Connection reset by peer\nmore"))
        assert time.monotonic() - start < 10
        assert "(Read error: Connection reset by peer)" in str(failure)
    finally:
        alive.kill()
        alive.wait()
