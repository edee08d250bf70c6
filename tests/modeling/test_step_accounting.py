"""Per-step accounting: ops launched outside compiled steps, host synchronisations and
host-to-device copies, counted by a dispatch mode; compiled steps are hidden from it."""
import torch

from mindspec.modeling.step_accounting import StepAccounting, outside_accounting


def test_counts_ops_value_reads_and_skips_views():
    x = torch.arange(6.0)
    with StepAccounting() as mode:
        y = (x * 2).view(2, 3).t()  # one op; view and t launch nothing
        y.sum().item()  # one op, one host read (not an op)
        bool((x > 1).any())  # two ops, one host read
    c = mode.counts
    assert c.ops_outside_graphs == 1 + 1 + 2 and c.host_syncs == 2 and c.h2d_copies == 0


def test_a_compiled_region_is_not_counted():
    x = torch.ones(4)
    with StepAccounting() as mode:
        x + 1
        with outside_accounting():
            for _ in range(10):
                x * 3
    assert mode.counts.ops_outside_graphs == 1
    with outside_accounting():  # no accounting active: a no-op
        assert torch.equal(x + 1, torch.full((4,), 2.0))


def test_per_step_divides_by_steps():
    with StepAccounting() as mode:
        for _ in range(4):
            torch.ones(2).add_(1)
    mode.counts.steps = 4
    assert mode.counts.per_step()["ops_outside_graphs"] == 2 and mode.counts.per_step()["steps"] == 4
