"""Makes the repository root importable so tests can ``from tests.support... import ...``, and
orders the collection for the parallel workers (below)."""
import collections
import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def pytest_collection_modifyitems(config, items):
    """Files with the most slow tests first (each file's tests stay together, in their order):
    on the README's two parallel workers the longest files start at once instead of ending the
    run alone on one worker."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    first_seen = {}  # pytest may interleave a file's items (it groups parametrized fixtures by scope)
    for i, item in enumerate(items):
        first_seen.setdefault(item.path, i)
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


@pytest.fixture(autouse=True)
def _eager_prefills(monkeypatch):
    """Compiled steps compile decode steps only, unless a test turns compiled prefills back on
    (tests/modeling/test_exported_step.py does): each prefill bucket is one more package to
    compile, and most tests that compile steps test something else."""
    from mindspec.modeling.prefill_padding import PREFILL_ENV

    monkeypatch.setenv(PREFILL_ENV, "0")


@pytest.fixture(autouse=True)
def _aten_gemms(monkeypatch):
    """Packages compile without timing Inductor's GEMM templates against ATen's kernels (about a
    third of the compile time), unless a test turns the timing back on
    (tests/modeling/test_exported_step.py checks the default options)."""
    from mindspec.modeling.exported_step import AUTOTUNE_ENV

    monkeypatch.setenv(AUTOTUNE_ENV, "0")
