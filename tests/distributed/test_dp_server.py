"""`mindspec serve` with worldSize 2 (dp 2, moe_ep 2): ranks spawned by the server, or started
by torchrun. Concurrent requests give the same greedy text as one process; a rank that dies is
one clear 503 for every client (the server stays up and says it is unhealthy); a follower whose
rank 0 dies exits instead of waiting forever."""
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mindspec import LLM, SamplingParams
from tests.distributed.serving import ServerProc, completion, free_port, served_model, start_servers, write_config

MTP = {"plugin_type": "mtp", "num_speculative_tokens": 2, "adaptive_speculation": False}
DP = {"worldSize": 2, "dp": 2, "moe_ep": 2, "distTimeout": 20, "plugin_params": MTP}
PROMPTS = ["hello world", "the quick brown fox jumps", "a", "numbers 1 2 3 4 5 6 7 8 9", "x y z"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return served_model(tmp_path_factory.mktemp("dp_srv_model"), seed=9)


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", cache_block_size=4, num_blocks=400, progress=False,
              plugin_params=MTP)
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]


def _concurrent_texts(base: str) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        resps = list(pool.map(lambda p: completion(base, p), PROMPTS))
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps]
    return [r.json()["choices"][0]["text"] for r in resps]


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_spawned_ranks_serve_like_one_process_and_a_dead_rank_is_a_503(model_dir, expected, tmp_path):
    cfg, ports = write_config(tmp_path / "dp.json", model_dir, model=DP)
    (server,) = start_servers([(cfg, ports, tmp_path / "dp.log")])
    try:
        (rank1,) = server.rank_pids()
        assert "dp=2 moe_ep=2" in server.log()
        assert _concurrent_texts(server.base) == expected
        os.kill(rank1, signal.SIGKILL)
        resp = completion(server.base, "hello again")
        assert resp.status_code == 503, resp.text
        message = resp.json()["error"]["message"]
        assert f"rank 1 (pid {rank1}) exited with code -9" in message, message
        assert server.health() == 500  # reported, not hidden
        assert completion(server.base, "and again").status_code == 503  # refused at once, no hang
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_torchrun_ranks_serve_and_a_follower_exits_when_rank_0_dies(model_dir, expected, tmp_path):
    cfg, ports = write_config(tmp_path / "dp_torchrun.json", model_dir, model=DP)
    log = open(tmp_path / "torchrun.log", "w")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, "-m", "mindspec.cli", "serve", "--config", str(cfg)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT)
             for r in range(2)]
    leader = ServerProc.__new__(ServerProc)  # rank 0's ports, without starting another process
    leader.ports, leader.log_path, leader.proc, leader._log = ports, tmp_path / "torchrun.log", ranks[0], log
    leader.base, leader.mgmt = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
    try:
        leader.wait_healthy(time.time() + 180)
        assert _concurrent_texts(leader.base) == expected
        ranks[0].kill()
        ranks[1].wait(30)  # gloo reports the closed peer; the follower stops with a message
        assert ranks[1].returncode == 1
        assert "mindspec dp rank 1: stopping" in leader.log()
    finally:
        for p in ranks:
            p.kill()
        log.close()
