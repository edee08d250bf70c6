"""Export and compile one step into a package, in its own process (background_compiles.py).

    python -m mindspec.modeling.compile_worker RECIPE PACKAGE THREADS

RECIPE is a saved step recipe (step_recipes.py): the worker loads the model from its checkpoint,
exports the step (seconds of tracing kept off the serving thread) and compiles it; the package
is written to PACKAGE atomically, compiled for THREADS intra-op threads (the serving process's
count, part of the package's cache key). The worker runs at the lowest scheduling priority so
that the serving process keeps the cores it needs; it exits 1 with the error as its last line
on failure.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from mindspec.backend import get_backend
from mindspec.modeling.exported_step import compile_package, export_recipe, first_line
from mindspec.modeling.step_recipes import StepRecipe


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    recipe, package, threads = Path(argv[0]), Path(argv[1]), int(argv[2])
    try:
        os.nice(19)
    except OSError:
        pass
    torch.set_num_threads(threads)
    try:
        step = StepRecipe.load(recipe)
        compile_package(export_recipe(step), package, get_backend(step.backend).step_kernels())
    except Exception as exc:
        print(first_line(exc), file=sys.stderr)
        return 1
    finally:
        recipe.unlink(missing_ok=True)  # also when the server that staged it is gone
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
