"""fill_in_model_result: inputs built with placeholders while the previous step ran, then patched
from its accepted tokens, equal the inputs built after that step (main, drafter, hidden states)."""
import dataclasses

import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.engine.async_scheduling import _view
from mindspec.engine.sequence import Sequence
from mindspec.text_generator.step import PLACEHOLDER_TOKEN, StepBatch
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=K)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("fill"), cfg, seed=5, residual_scale=0.005)


def _engine_after_decode_steps(path, mode, steps):
    llm = LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=256, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": K, "mtp_mode": mode,
                             "adaptive_speculation": False})
    engine = llm.engine
    last = {}
    execute = engine.plugin_manager.execute

    def capture(batch, inputs):
        out = execute(batch, inputs)
        last.update(zip(batch.seq_ids, out.accepted))
        return out

    engine.plugin_manager.execute = capture
    rng = np.random.default_rng(1)
    for n in (3, 9, 5, 14, 2, 7):
        engine.add_request(rng.integers(2, 60, n).tolist(), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(1 + steps):  # the prefill, then decode steps
        engine.step()
    return engine, last


def _ahead_view(seq: Sequence, accepted: list[int]) -> Sequence:
    """The sequence as the host saw it while the step that accepted ``accepted`` still ran."""
    before = _view(seq, 0)
    before.output_token_ids = before.output_token_ids[: len(before.output_token_ids) - len(accepted)]
    return _view(before, K + 1)


def _assert_inputs_equal(got, want):
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=field.name)
        else:
            assert a == b, field.name


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
@pytest.mark.parametrize("steps", [1, 3])
def test_filled_inputs_equal_inputs_built_after_the_step(checkpoint, mode, steps):
    engine, accepted = _engine_after_decode_steps(checkpoint, mode, steps)
    pm, bm = engine.plugin_manager, engine.block_manager
    seqs = sorted(engine.scheduler.running, key=lambda s: s.seq_id)
    for seq in seqs:  # room for the placeholder layout (K+1 pending tokens + K drafts)
        bm.ensure(seq, seq.num_tokens + 2 * K + 1)
    pending = np.array([K + 1 if b % 2 == 0 else 0 for b in range(len(seqs))], dtype=np.int64)
    want = pm.prepare(StepBatch([_view(s, 0) for s in seqs], False, bm.block_size))

    views = [_ahead_view(s, accepted[s.seq_id]) if n else _view(s, 0) for s, n in zip(seqs, pending)]
    batch = StepBatch(views, False, bm.block_size)
    got = pm.prepare_ahead(batch, pending)
    assert (got.model_inputs.input_ids == PLACEHOLDER_TOKEN).sum() == (pending > 0).sum()
    counts = [len(accepted[s.seq_id]) for s in seqs]
    assert any(c < K + 1 for c, n in zip(counts, pending) if n), "every pending draft accepted: nothing to move back"

    pm.fill_in_model_result(batch, got, pending, [accepted[s.seq_id] if n else [] for s, n in zip(seqs, pending)])
    _assert_inputs_equal(got.model_inputs, want.model_inputs)
    assert len(got.sub_model_inputs) == len(want.sub_model_inputs) == K
    for g, w in zip(got.sub_model_inputs, want.sub_model_inputs):
        _assert_inputs_equal(g, w)
    np.testing.assert_array_equal(got.q_lens, want.q_lens)
    g, w = got.extra["hidden_cache"], want.extra["hidden_cache"]  # rows the step reads and keeps itself
    for name in ("read_rows", "counts", "keep_rows"):
        np.testing.assert_array_equal(getattr(g, name), getattr(w, name))
    assert g.accepts_in_step == w.accepts_in_step
    assert g.gathered().equal(w.gathered())
    for view, seq in zip(views, seqs):  # the views now read like the sequences themselves
        assert view.token_ids == seq.token_ids and view.num_cached_tokens == seq.num_cached_tokens


def test_a_count_outside_the_pending_range_is_refused(checkpoint):
    engine, accepted = _engine_after_decode_steps(checkpoint, "eagle", 1)
    pm, bm = engine.plugin_manager, engine.block_manager
    seqs = sorted(engine.scheduler.running, key=lambda s: s.seq_id)
    for seq in seqs:
        bm.ensure(seq, seq.num_tokens + 2 * K + 1)
    pending = np.full(len(seqs), K + 1, dtype=np.int64)
    batch = StepBatch([_ahead_view(s, accepted[s.seq_id]) for s in seqs], False, bm.block_size)
    inputs = pm.prepare_ahead(batch, pending)
    too_many = [[1] * (K + 2)] * len(seqs)
    with pytest.raises(ValueError, match="accepted counts"):
        pm.fill_in_model_result(batch, inputs, pending, too_many)
