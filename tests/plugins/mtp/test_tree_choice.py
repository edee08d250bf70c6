"""TreeOrPlain: per batch-size bucket, tree steps or plain steps by measured tokens per second."""
from mindspec.plugins.mtp.adaptive import MIN_SAMPLES, REEXPLORE_BURST, REEXPLORE_EVERY
from mindspec.plugins.mtp.tree_choice import TreeOrPlain


def _run(choice: TreeOrPlain, batch: int, steps: int, tree_rate: float, plain_rate: float) -> list[bool]:
    """Steps of a workload where a tree step yields 4 tokens per sequence and a plain step 1,
    at the given tokens per second; -> the kind of every step."""
    kinds = []
    for _ in range(steps):
        tree = choice.tree_step(batch)
        tokens = batch * (4 if tree else 1)
        choice.record(batch, tree, tokens, tokens / (tree_rate if tree else plain_rate))
        kinds.append(tree)
    return kinds


def test_times_both_kinds_then_keeps_the_faster_and_reexplores():
    choice = TreeOrPlain(enabled=True)
    kinds = _run(choice, 1, 2 * REEXPLORE_EVERY, tree_rate=200.0, plain_rate=150.0)
    assert kinds[:MIN_SAMPLES] == [True] * MIN_SAMPLES and kinds[MIN_SAMPLES:2 * MIN_SAMPLES] == [False] * MIN_SAMPLES
    steady = kinds[2 * MIN_SAMPLES:]
    assert steady.count(False) == REEXPLORE_BURST  # one try of plain steps, after REEXPLORE_EVERY steps
    # at batch 16 plain steps are faster: that bucket settles on them, batch 1's is unchanged
    kinds16 = _run(choice, 16, REEXPLORE_EVERY, tree_rate=600.0, plain_rate=700.0)
    assert kinds16[2 * MIN_SAMPLES:].count(True) <= REEXPLORE_BURST
    assert choice.buckets[1].choice and not choice.buckets[16].choice


def test_untimed_steps_count_for_nothing_and_disabled_always_trees():
    choice = TreeOrPlain(enabled=True)
    for _ in range(10):
        choice.record(1, True, 4, None)  # tree steps that caught up skipped entries
    assert choice.tree_step(1)  # still exploring: no tree step was timed
    off = TreeOrPlain(enabled=False)
    assert all(_run(off, 4, 20, tree_rate=1.0, plain_rate=100.0))
