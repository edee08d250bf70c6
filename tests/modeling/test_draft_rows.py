"""Draft steps on the lm_head rows alone (MTP Eagle after its first step): which steps qualify,
their inputs, and a speculative step that runs them so gives the drafts, logits and cache
entries of the full seed-000 layout."""
import numpy as np
import pytest
import torch

from mindspec.modeling.draft_rows import lm_rows_only_steps, on_lm_rows
from mindspec.modeling.forward_metadata import build_model_inputs, to_device
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.plugins.mtp import decode_inputs as di
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

K = 3
BLOCK_SIZE = 4
NUM_BLOCKS = 64
SEQ_LENS = np.array([6, 10, 15])  # tokens per sequence before the decode step
LAST_ACCEPTED = np.array([1, 4, 2])


def _subs(mode, tables, tokens=None):
    layout = di.decode_layout(SEQ_LENS, LAST_ACCEPTED, K, mode)
    tokens = tokens or [list(range(2, 2 + int(n))) for n in SEQ_LENS]
    return layout, di.sub_inputs(tokens, layout, di.block_tables(tables), BLOCK_SIZE, K, mode)


def _tables(extra=K + 1):
    perm = np.random.default_rng(0).permutation(NUM_BLOCKS - 1).tolist()  # never the dummy block
    return [[perm.pop() for _ in range(-(-(int(s) + extra) // BLOCK_SIZE))] for s in SEQ_LENS]


def test_eagle_steps_after_the_first_run_on_lm_rows_vanilla_steps_do_not():
    tables = _tables()
    assert lm_rows_only_steps(_subs("eagle", tables)[1]) == [False, True, True]
    assert lm_rows_only_steps(_subs("vanilla", tables)[1]) == [False, False, False]


def test_a_step_writing_another_row_ends_the_suffix():
    _, subs = _subs("eagle", _tables())
    other = int(np.setdiff1d(np.arange(subs[1].num_tokens), subs[1].lm_head_indices)[0])
    slots = subs[1].slots.copy()
    slots[other] = 7
    subs[1] = subs[1].with_(slots=slots)
    assert lm_rows_only_steps(subs) == [False, False, True]


def test_lm_rows_inputs_keep_each_sequences_lm_row():
    _, subs = _subs("eagle", _tables())
    step = subs[2]
    lm = step.lm_head_indices
    narrow = on_lm_rows(step)
    assert narrow.num_tokens == narrow.num_seqs == len(SEQ_LENS)
    np.testing.assert_array_equal(narrow.positions, step.positions[lm])
    np.testing.assert_array_equal(narrow.slots, step.slots[lm])
    np.testing.assert_array_equal(narrow.seq_lens, step.positions[lm] + 1)  # causal: up to its own entry
    np.testing.assert_array_equal(narrow.q_lens, np.ones(len(SEQ_LENS)))
    np.testing.assert_array_equal(narrow.lm_head_indices, np.arange(len(SEQ_LENS)))
    np.testing.assert_array_equal(narrow.block_tables, step.block_tables)
    # The lm_head row sits at position n - 2 + s (entry of the newest token, shifted by the step).
    np.testing.assert_array_equal(narrow.positions, SEQ_LENS - 2 + 2)


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=1)
    path = make_self_predicting_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, seed=5, residual_scale=0.01)
    w = ModelWrapper(path, backend="cpu", dtype="float32", num_mtp_modules=1, progress=False)
    w.allocate_cache(NUM_BLOCKS, BLOCK_SIZE)
    return w


def _caches(wrapper):
    return [c.latent.clone() for c in wrapper.caches]


def test_eagle_step_on_lm_rows_equals_the_full_layout(wrapper):
    rng = np.random.default_rng(1)
    vocab, hidden_size = wrapper.config.vocab_size, wrapper.config.hidden_size
    tokens = [rng.integers(2, vocab, int(n)).tolist() for n in SEQ_LENS]
    tables = _tables()
    with torch.inference_mode():
        wrapper.forward_prefill_mtp(to_device(build_model_inputs(tokens, [0] * 3, tables, BLOCK_SIZE), "cpu"), [0])
    layout, subs = _subs("eagle", tables, tokens)
    main = di.main_inputs(np.array([t[-1] for t in tokens]), SEQ_LENS, di.block_tables(tables), BLOCK_SIZE, K)
    hidden = torch.randn(int(layout.sub_q_lens.sum()), hidden_size, generator=torch.Generator().manual_seed(2))
    lm = torch.from_numpy(subs[0].lm_head_indices)
    before = _caches(wrapper)

    def step(narrow):
        steps = [to_device(on_lm_rows(s) if n else s, "cpu") for s, n in zip(subs, narrow)]
        with torch.inference_mode():
            return wrapper.forward_speculative(to_device(main, "cpu"), steps, [0] * K, hidden, lm, narrow)

    full = step([False] * K)
    after_full = _caches(wrapper)
    for cache, saved in zip(wrapper.caches, before):
        cache.latent.copy_(saved)
    narrow = step(lm_rows_only_steps(subs))
    assert narrow.draft_tokens.shape == (len(SEQ_LENS), K)
    assert torch.equal(narrow.draft_tokens, full.draft_tokens)
    torch.testing.assert_close(narrow.logits, full.logits, atol=1e-5, rtol=1e-5)
    for now, expected, old in zip(_caches(wrapper), after_full, before):
        torch.testing.assert_close(now, expected, atol=1e-5, rtol=1e-5)
        assert not torch.equal(now, old)  # every layer, the MTP module's too, wrote this step


def test_verify_source_places_each_sequences_own_drafts():
    from mindspec.modeling.draft_rows import verify_source

    # 3 sequences, k = 2 drafts made each; they verify 2, 0 and 1: rows [t0 d0 d0'] [t1] [t2 d2]
    src = verify_source(np.array([3, 1, 2]), 2)
    ids = np.array([10, 0, 0, 11, 12, 0])  # fed tokens at each sequence's first row
    drafts = np.array([[20, 21], [30, 31], [40, 41]])
    assert np.concatenate([ids, drafts.reshape(-1)])[src].tolist() == [10, 20, 21, 11, 12, 40]
    assert verify_source(np.array([3, 3]), 2) is None  # uniform: the model's view places them
    with pytest.raises(ValueError, match="1..3"):
        verify_source(np.array([4, 1]), 2)


def test_verify_source_keeps_host_drafts_in_their_input_rows():
    from mindspec.modeling.draft_rows import verify_source

    # k = 2 MTP drafts made; sequence 1 verifies 4 suffix drafts written into its rows on the host
    q, host = np.array([3, 5, 1]), np.array([False, True, False])
    src = verify_source(q, 2, host)
    ids = np.array([10, 0, 0, 11, 50, 51, 52, 53, 12])
    drafts = np.array([[20, 21], [30, 31], [40, 41]])
    assert np.concatenate([ids, drafts.reshape(-1)])[src].tolist() == [10, 20, 21, 11, 50, 51, 52, 53, 12]
    assert verify_source(np.array([3, 3]), 2, np.array([False, True])) is not None  # uniform, yet host rows
    with pytest.raises(ValueError, match="1..3"):
        verify_source(np.array([5, 1]), 2, np.array([False, True]))  # more rows than MTP drafts, not hosted
