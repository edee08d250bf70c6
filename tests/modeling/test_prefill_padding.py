"""Prefills padded to a static shape (prefill_padding.py): the bucket rule, what padding adds,
and, run eagerly, the unpadded prefill's logits, hidden states and cache entries (the padding rows
write nothing)."""
import numpy as np
import pytest
import torch

from mindspec.modeling.forward_metadata import build_model_inputs, to_device
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.modeling.prefill_padding import (
    PREFILL_ENV, PREFILL_MAX_ROWS, compiled_prefill_rows, pad_prefill, prefill_rows_bucket,
)
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

K = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 64
DUMMY = NUM_BLOCKS - 1


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=K)
    path = make_self_predicting_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, seed=5, residual_scale=0.01)
    w = ModelWrapper(path, backend="cpu", dtype="float32", num_mtp_modules=K, progress=False)
    w.allocate_cache(NUM_BLOCKS, BLOCK_SIZE)
    return w


def _host(lengths, first_block=0):
    rng = np.random.default_rng(sum(lengths))
    tokens = [rng.integers(2, 60, n).tolist() for n in lengths]
    tables, at = [], first_block
    for n in lengths:
        blocks = -(-(n + 1) // BLOCK_SIZE)  # room for the first new token, as the scheduler allocates
        tables.append(list(range(at, at + blocks)))
        at += blocks
    return build_model_inputs(tokens, [0] * len(lengths), tables, BLOCK_SIZE)


def test_rows_buckets_are_multiples_of_sixteen_then_of_sixty_four():
    assert [prefill_rows_bucket(n) for n in (1, 15, 16, 17, 64, 65, 128, 129, 300)] == [16, 16, 16, 32, 64, 80, 128,
                                                                                         192, 320]


def test_padding_puts_each_sequences_rows_first_and_writes_nothing():
    host = _host([5, 11])
    padded = pad_prefill(host, DUMMY, BLOCK_SIZE, PREFILL_MAX_ROWS)
    x, rows = padded.inputs, padded.row_map
    assert x.num_tokens == 32 and x.q_lens.tolist() == [16, 16] and x.seq_lens.tolist() == [16, 16]
    assert x.is_prefill
    assert rows.tolist() == list(range(5)) + list(range(16, 27))
    for name in ("input_ids", "positions", "slots"):
        assert np.array_equal(getattr(x, name)[rows], getattr(host, name))
    pad = np.setdiff1d(np.arange(32), rows)
    assert (x.slots[pad] == -1).all()
    assert x.positions[pad].tolist() == [4] * 11 + [10] * 5  # each sequence's last position
    assert np.array_equal(x.lm_head_indices, rows[host.lm_head_indices])
    assert x.block_tables.shape == (2, 16 // BLOCK_SIZE)  # the bucket's width, whatever was allocated
    assert host.block_tables.shape == (2, 3)
    assert np.array_equal(x.block_tables[:, :3], host.block_tables) and (x.block_tables[:, 3] == DUMMY).all()


def test_what_is_not_a_fitting_prefill_runs_eagerly(monkeypatch):
    assert pad_prefill(_host([5]).with_(is_prefill=False), DUMMY, BLOCK_SIZE, PREFILL_MAX_ROWS) is None
    assert pad_prefill(_host([1, 1, 1, 40]), DUMMY, BLOCK_SIZE, PREFILL_MAX_ROWS) is None  # 4 x 48 rows for 43
    assert pad_prefill(_host([260, 180]), DUMMY, BLOCK_SIZE, PREFILL_MAX_ROWS) is None  # 2 x 320 rows
    assert pad_prefill(_host([190, 180]), DUMMY, BLOCK_SIZE, PREFILL_MAX_ROWS) is not None  # 2 x 192
    assert pad_prefill(_host([5]), DUMMY, BLOCK_SIZE, max_rows=0) is None
    monkeypatch.setenv(PREFILL_ENV, "0")
    assert compiled_prefill_rows() == 0
    monkeypatch.setenv(PREFILL_ENV, "1")
    assert compiled_prefill_rows() == PREFILL_MAX_ROWS


def _caches(w):
    return [c.rows.clone() for c in w.caches]


@pytest.mark.parametrize("mtp", [False, True])
def test_a_padded_prefill_gives_the_unpadded_outputs_and_cache(wrapper, mtp):
    host = _host([5, 11, 3])
    padded = pad_prefill(host, DUMMY, BLOCK_SIZE, PREFILL_MAX_ROWS)
    model, caches = wrapper.model, wrapper.caches

    def run(inputs):
        for c in caches:
            c.rows.zero_()
        x = to_device(inputs, "cpu")
        wrapper.backend.prepare(x.meta)
        with torch.inference_mode():
            if mtp:
                out = model.forward_prefill_mtp(x.input_ids, x.positions, x.meta, x.lm_head_indices, list(range(K)),
                                                caches)
            else:
                out = model.forward(x.input_ids, x.positions, caches, x.meta, x.lm_head_indices)
        return out, _caches(wrapper)

    eager, eager_caches = run(host)
    got, got_caches = run(padded.inputs)
    torch.testing.assert_close(got.logits, eager.logits, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(got.hidden_states[torch.from_numpy(padded.row_map)], eager.hidden_states,
                               atol=2e-6, rtol=2e-6)
    written = torch.zeros(eager_caches[0].shape[0], dtype=torch.bool)
    written[torch.from_numpy(host.slots)] = True
    outside = ~written
    outside[-1] = False  # the spill row, where slot -1 lands (CpuBackend.write_latent_cache)
    for now, then in zip(got_caches, eager_caches):
        assert torch.equal(now[outside], then[outside])  # zeros: padding rows wrote no cache entry
        torch.testing.assert_close(now[written], then[written], atol=2e-6, rtol=2e-6)
    layers = len(got_caches) if mtp else wrapper.config.num_hidden_layers  # the MTP modules' when they ran
    assert all(torch.count_nonzero(c[written]) > 0 for c in got_caches[:layers])


@pytest.mark.parametrize("mtp", [False, True])
def test_a_prefill_without_its_package_yet_runs_eagerly_on_its_real_rows(tmp_path, monkeypatch, mtp):
    """While a bucket's package is not due (a server meets the shape for the first times), the
    prefill runs eagerly over the batch as it is: padding rows would cost as much as real ones."""
    monkeypatch.setenv("MINDSPEC_CACHE_DIR", str(tmp_path))  # an empty package cache
    monkeypatch.setenv(PREFILL_ENV, "1")
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=K)
    path = make_self_predicting_checkpoint(tmp_path / "ckpt", cfg, seed=5, residual_scale=0.01)
    w = ModelWrapper(path, backend="cpu", dtype="float32", num_mtp_modules=K, progress=False, decode_graphs=True)
    w.allocate_cache(NUM_BLOCKS, BLOCK_SIZE)
    w.compiled.export_after = 10**9  # never due: no package is compiled or loaded
    rows_run = []
    for name in ("forward", "forward_prefill_mtp"):
        original = getattr(w.model, name)

        def spy(input_ids, *args, _original=original, **kwargs):
            rows_run.append(int(input_ids.shape[0]))
            return _original(input_ids, *args, **kwargs)

        monkeypatch.setattr(w.model, name, spy)
    host = _host([5, 11])
    assert pad_prefill(host, DUMMY, BLOCK_SIZE, w.compiled.prefill_max_rows) is not None  # a fitting prefill
    out = w.forward_prefill_mtp_host(host, [0, 1]) if mtp else w.forward_host(host)
    assert rows_run[0] == 16 and w.compiled.stats.calls == 0  # 5 + 11 rows, not 2 x 16
    assert out.hidden_states.shape[0] == 16 and out.logits.shape[0] == 2
