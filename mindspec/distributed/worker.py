"""A spawned rank: ``python -m mindspec.distributed.worker SPEC.pkl`` (launch.py writes SPEC).

Joins the process groups, builds the same engine as rank 0 and follows its commands until told
to stop. Any failure (the leader gone, a hang past distTimeout, a bug) ends the process with one
line naming the rank and the cause, and exit code 1; rank 0 reports it to its callers.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys

from .errors import DistributedError
from .launch import RankSpec, exit_without_teardown, follow, join_as_worker, rank_args, share_host_cores


def main(spec_path: str) -> int:
    with open(spec_path, "rb") as f:
        spec: RankSpec = pickle.load(f)
    os.unlink(spec_path)
    logging.basicConfig(level=logging.WARNING, format=f"rank {spec.rank} %(levelname)s %(name)s: %(message)s")
    share_host_cores(spec.args.backend, spec.parallel.world_size, spec.args.model_hidden_size())
    from .spmd_engine import SpmdEngine

    try:
        engine = SpmdEngine(rank_args(spec.args, spec.parallel, spec.local_rank), join_as_worker(spec))
    except (DistributedError, RuntimeError) as exc:
        print(f"mindspec dp rank {spec.rank}: cannot start: {exc}", file=sys.stderr, flush=True)
        exit_without_teardown(1)  # the group may be half built; see follow()
    return follow(engine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
