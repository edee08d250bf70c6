"""Step packages compiled in worker processes while the server keeps serving.

Compiling one package takes one to two minutes on two cores (Inductor's code generation, the
GEMM timing and the C++ compiler), almost all of it outside the traced model. A shape first met
while serving (a batch size or a draft count the warm-up did not meet) would stall every running
request for that long. Instead the serving thread saves the step's recipe (step_recipes.py: its
metadata and example inputs, milliseconds), and a worker process (``python -m
mindspec.modeling.compile_worker``, at the lowest scheduling priority) loads the model, exports
the step and compiles it into the package cache; the step runs eagerly until the package is
there, then loads it. At start-up the same workers compile the warm-up's shapes side
by side, and the warm-up waits for them.

The scheduler calls ``state`` once per step of a pending shape: a ``poll`` of the worker, no
waiting. Workers are stopped when the engine closes or the process exits.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

PENDING, DONE, FAILED = "pending", "done", "failed"
# A worker's command; it is given the recipe, the package and the thread count.
WORKER = [sys.executable, "-m", "mindspec.modeling.compile_worker"]


@dataclass
class CompileJob:
    recipe: Path  # the saved step recipe, removed when the job ends
    package: Path  # where the worker writes the package (atomically)
    submitted: float = field(default_factory=time.perf_counter)
    proc: Optional[subprocess.Popen] = None
    state: str = PENDING
    error: str = ""
    seconds: float = 0.0  # submission to the package's arrival (queueing included)

    @property
    def log_path(self) -> Path:
        return self.recipe.with_suffix(".log")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.state == PENDING

    def remove_files(self) -> None:
        for path in (self.recipe, self.log_path):
            path.unlink(missing_ok=True)


class BackgroundCompiles:
    """At most ``workers`` compile processes at once; further jobs queue."""

    def __init__(self, workers: int, threads: int):
        if workers < 1:
            raise ValueError(f"compile workers must be >= 1, got {workers}")
        self.workers, self.threads = workers, threads
        self.jobs: dict[Path, CompileJob] = {}  # by package path
        self._queue: deque[CompileJob] = deque()
        self._finalizer = weakref.finalize(self, _stop_all, self.jobs)  # also runs at interpreter exit

    def submit(self, recipe: Path, package: Path) -> None:
        job = self.jobs[package] = CompileJob(recipe, package)
        self._queue.append(job)
        self._advance()

    def state(self, package: Path) -> str:
        """PENDING, DONE or FAILED (then ``jobs[package].error`` says why); starts queued jobs."""
        self._advance()
        return self.jobs[package].state

    def pending(self) -> int:
        self._advance()
        return sum(job.state == PENDING for job in self.jobs.values())

    def wait(self, poll_s: float = 0.2) -> None:
        """Block until every submitted job has ended."""
        while self.pending():
            time.sleep(poll_s)

    def close(self) -> None:
        """Stop running workers (their packages are not written) and drop queued jobs."""
        self._queue.clear()
        self._finalizer()

    # ---- workers -------------------------------------------------------------------------------
    def _advance(self) -> None:
        for job in self.jobs.values():
            if job.running and job.proc.poll() is not None:
                self._finish(job)
        while self._queue and self._running() < self.workers:
            self._start(self._queue.popleft())

    def _running(self) -> int:
        return sum(job.running for job in self.jobs.values())

    def _start(self, job: CompileJob) -> None:
        cmd = [*WORKER, str(job.recipe), str(job.package), str(self.threads)]
        with open(job.log_path, "wb") as out:
            job.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env=_worker_env())

    def _finish(self, job: CompileJob) -> None:
        job.seconds = time.perf_counter() - job.submitted
        if job.proc.returncode == 0 and job.package.is_file():
            job.state = DONE
        else:
            job.state, job.error = FAILED, _last_line(job.log_path) or f"exit status {job.proc.returncode}"
        job.remove_files()


def _worker_env() -> dict[str, str]:
    """The parent's environment, with the import path it runs with (a source checkout included)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _stop_all(jobs: dict[Path, CompileJob]) -> None:
    for job in jobs.values():
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
        if job.state == PENDING:
            job.state, job.error = FAILED, "stopped"
            job.remove_files()
