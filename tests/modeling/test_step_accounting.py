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


def test_copies_of_inference_tensors_count_though_the_dispatch_mode_misses_them():
    """A forward under torch.inference_mode returns inference tensors, whose ``.to()`` / ``.cpu()``
    never reaches a dispatch mode as ``aten._to_copy``: the sampled tokens' copy to the host went
    uncounted so."""
    with torch.inference_mode():
        tokens = torch.arange(6) * 2
    with StepAccounting() as mode:
        tokens[:4].double()  # a copy
        tokens.to(torch.int64)  # the same dtype and device: no copy
        torch.ones(2).double()  # an ordinary tensor: the dispatch mode's own count
        with outside_accounting():
            tokens.double()
    assert dict(mode.counts.by_op) == {"aten._to_copy.default": 2, "aten.ones.default": 1}
    assert torch._C._len_torch_function_stack() == 0


def test_per_step_divides_by_steps():
    with StepAccounting() as mode:
        for _ in range(4):
            torch.ones(2).add_(1)
    mode.counts.steps = 4
    assert mode.counts.per_step()["ops_outside_graphs"] == 2 and mode.counts.per_step()["steps"] == 4
    assert "ops" not in mode.counts.per_step()  # /metrics exports every value as a gauge


def test_ops_by_name_add_up_to_the_count():
    with StepAccounting() as mode:
        for _ in range(2):
            torch.ones(2).add_(1).view(2, 1)
    mode.counts.steps = 2
    ops = mode.counts.per_step(by_op=True)["ops"]
    assert ops == {"aten.ones.default": 1.0, "aten.add_.Tensor": 1.0}
    assert sum(ops.values()) == mode.counts.per_step()["ops_outside_graphs"]


def test_accounting_an_engine_runs_only_the_counted_steps(tmp_path):
    """The request is aborted after the counted steps, not decoded to its end: later steps would
    let adaptive speculation choose arms by measured time, and a start-up warm-up
    (LLMEngine.warmup_decode) would meet different compiled-step shapes on every start."""
    from mindspec import LLM
    from mindspec.modeling.step_accounting import account_decode_steps
    from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

    cfg = tiny_v3_config(num_hidden_layers=2, num_nextn_predict_layers=2)
    path = make_self_predicting_checkpoint(tmp_path / "ckpt", cfg, seed=1)
    llm = LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=64, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 2})
    engine, steps = llm.engine, []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    counts = account_decode_steps(llm, [3, 4, 5, 6], steps=4)
    assert len(steps) == 1 + 1 + 4  # prefill, the uncounted first decode step, the counted ones
    assert counts["steps"] == 4 and not engine.has_unfinished() and not engine.requests
