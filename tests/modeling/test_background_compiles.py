"""Step packages compiled in worker processes (``compile_workers``): a shape first met runs
eagerly at once, with the eager tokens, while a worker compiles it; the package is used once it
arrives; the start-up warm-up waits for its shapes; failed and stopped workers leave the step
eager. Fake workers (a few lines of Python) test the queue; the engine tests run real ones."""
import sys
import time

import numpy as np
import pytest
import torch

from mindspec import SamplingParams
from mindspec.engine.args import EngineArgs
from mindspec.engine.llm_engine import EXPORT_AFTER_STEPS, LLMEngine
from mindspec.engine.scheduler import SchedulerConfig
from mindspec.modeling import background_compiles, exported_step
from mindspec.modeling.background_compiles import DONE, FAILED, PENDING, BackgroundCompiles
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

WRITES_PACKAGE = "import sys, time, pathlib; time.sleep(float(sys.argv[1])); pathlib.Path(sys.argv[3]).write_bytes(b'p')"
FAILS = "import sys; print('compiling'); print('RuntimeError: no C++ compiler'); sys.exit(1)"


def _fake_worker(monkeypatch, code: str, *args: str) -> None:
    monkeypatch.setattr(background_compiles, "WORKER", [sys.executable, "-c", code, *args])


def _job(tmp_path, name: str):
    recipe = tmp_path / f"{name}.recipe"
    recipe.write_bytes(b"recipe")
    return recipe, tmp_path / f"{name}.pt2"


def _two_jobs_on_one_worker(tmp_path):
    """-> (compiles, [(recipe, package)] * 2), both submitted."""
    compiles = BackgroundCompiles(workers=1, threads=1)
    jobs = [_job(tmp_path, "a"), _job(tmp_path, "b")]
    for recipe, package in jobs:
        compiles.submit(recipe, package)
    return compiles, jobs


def test_jobs_queue_for_the_workers_and_end_with_their_packages(tmp_path, monkeypatch):
    _fake_worker(monkeypatch, WRITES_PACKAGE, "0.5")
    compiles, [(p1, out1), (p2, out2)] = _two_jobs_on_one_worker(tmp_path)
    assert compiles.jobs[out1].proc is not None and compiles.jobs[out2].proc is None  # one worker: b waits
    assert compiles.state(out1) == compiles.state(out2) == PENDING
    compiles.wait(poll_s=0.05)
    assert compiles.state(out1) == compiles.state(out2) == DONE
    assert out1.read_bytes() == out2.read_bytes() == b"p"
    assert not p1.exists() and not p2.exists()  # recipes and logs are removed
    assert not list(tmp_path.glob("*.log"))


def test_a_failed_worker_reports_its_last_line(tmp_path, monkeypatch):
    _fake_worker(monkeypatch, FAILS)
    compiles = BackgroundCompiles(workers=2, threads=1)
    recipe, out = _job(tmp_path, "a")
    compiles.submit(recipe, out)
    compiles.wait(poll_s=0.05)
    assert compiles.state(out) == FAILED and compiles.jobs[out].error == "RuntimeError: no C++ compiler"
    assert not out.exists() and not recipe.exists()


def test_close_stops_running_workers(tmp_path, monkeypatch):
    _fake_worker(monkeypatch, WRITES_PACKAGE, "60")
    compiles, [(p1, out1), (p2, out2)] = _two_jobs_on_one_worker(tmp_path)
    proc = compiles.jobs[out1].proc
    start = time.perf_counter()
    compiles.close()
    assert proc.poll() is not None and time.perf_counter() - start < 10
    assert compiles.pending() == 0 and compiles.jobs[out1].error == "stopped"
    assert compiles.jobs[out2].proc is None  # queued: never started
    assert not out1.exists() and not p1.exists()


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="compile workers must be >= 1"):
        BackgroundCompiles(workers=0, threads=1)


# ---- real workers, through the engine --------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_hidden_layers=2, num_nextn_predict_layers=1)
    # bfloat16 weights: on an AVX-512 cpu the workers' packages call rows_gemm's kernels too
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("background"), cfg, seed=5, residual_scale=0.005,
                                           dtype=torch.bfloat16)


def _engine(path, warmup: bool, max_batch_size: int, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), dtype="float32", cache_block_size=4, num_blocks=64, progress=False,
                                warmup=warmup, scheduler=SchedulerConfig(max_batch_size=max_batch_size), **kw))


def _tokens(engine, n: int) -> list[list[int]]:
    prompts = [np.random.default_rng(s).integers(2, 60, 6).tolist() for s in range(n)]
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


@pytest.mark.slow
def test_a_shape_first_met_runs_eagerly_until_its_worker_is_done(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv(exported_step.CACHE_ENV, str(tmp_path))
    expected = _tokens(_engine(checkpoint, False, 1, decode_graphs=False), 1)
    engine = _engine(checkpoint, False, 1, decode_graphs=True, compile_workers=1)
    compiled = engine.model_wrapper.compiled

    def exported_here(*args):
        raise AssertionError("a step was exported on the serving thread")

    monkeypatch.setattr(exported_step, "_export", exported_here)  # the worker exports it (its own import)
    start = time.perf_counter()
    assert _tokens(engine, 1) == expected
    # The decode steps ran eagerly and did not wait for the export or the compile (tens of seconds).
    assert compiled.stats.compiling == 1 and compiled.stats.calls == 0 and compiled.stats.compiled == 0
    assert compiled.stats.export_s == 0 and time.perf_counter() - start < 10
    [name] = compiled.stats.by_key
    assert compiled.stats.by_key[name] == "compiling" and not (tmp_path / "steps" / f"{name}.pt2").exists()

    compiled.wait_for_compiles()
    assert compiled.stats.compiling == 0 and compiled.stats.by_key[name] == "compiled" and compiled.stats.compiled == 1
    assert (tmp_path / "steps" / f"{name}.pt2").is_file() and not list((tmp_path / "steps" / ".recipes").iterdir())
    assert _tokens(engine, 1) == expected and compiled.stats.calls > 0
    # After a server's warm-up a shape without a package is compiled on its export_after-th step
    # only; one whose package is in the cache loads at once.
    compiled.export_after = 3
    assert [compiled._due(("rare",), False) for _ in range(3)] == [False, False, True]
    assert compiled._due(next(iter(compiled._runners)), False)
    engine.close()

    # A server's start-up: the warm-up's new shape (bucket 2) compiles in a worker and the
    # engine is ready once it is there; bucket 1 loads from the cache.
    expected2 = _tokens(_engine(checkpoint, False, 2, decode_graphs=False), 2)
    served = _engine(checkpoint, True, 2, decode_graphs=True, compile_workers=2)
    stats = served.model_wrapper.compiled.stats
    assert sorted(stats.by_key.values()) == ["compiled", "loaded"] and stats.compiling == 0
    assert served.model_wrapper.compiled.export_after == EXPORT_AFTER_STEPS > 1
    calls = stats.calls
    assert _tokens(served, 2) == expected2 and stats.calls > calls and stats.failed == 0
    served.close()
