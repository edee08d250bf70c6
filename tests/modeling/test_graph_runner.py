"""The decode graph runner, run eagerly over its static buffers on the cpu backend (no graphs on
CPU): padded batches give the unpadded call's outputs, and touch no cache entry but the real
sequences' slots and the reserved dummy block."""
import dataclasses
from dataclasses import replace
import logging

import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.backends.cpu import CpuBackend
from mindspec.modeling.forward_metadata import NUM_INPUT_ARRAYS, build_model_inputs, input_arrays, to_device
from mindspec.modeling.graph_runner import (
    STEADY_DRAFT_ROWS, DecodeGraphRunner, EagerStep, PadSpec, StaticInputs, _pad_draft_steps, catches_up,
    draft_rows_bucket, host_verify_rows, maybe_graph_runner, pad_inputs, pad_rows_per_seq, pad_verify_rows,
    verify_source_rows,
)
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.modeling.hidden_cache import HiddenKeep
from mindspec.plugins.mtp import decode_inputs as di
from mindspec.plugins.mtp.decoding_policy import strict_accept
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
from tests.support.static_graph import StaticGraph

K = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 64
SEQ_LENS = [5, 9, 14]  # tokens per sequence before the decode step
LAST_ACCEPTED = [1, 3, 2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=K)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, seed=4, residual_scale=0.01), cfg


@pytest.fixture
def wrapper(checkpoint):
    path, _ = checkpoint
    w = ModelWrapper(path, backend="cpu", dtype="float32", num_mtp_modules=K, progress=False)
    w.allocate_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert w.graph_runner is None  # the cpu backend captures no graphs
    return w


def _tables(seq_lens, extra):
    """Block tables over shuffled blocks (never the dummy block, the last one)."""
    perm = np.random.default_rng(0).permutation(NUM_BLOCKS - 1).tolist()
    return [[perm.pop() for _ in range(-(-(s + extra) // BLOCK_SIZE))] for s in seq_lens]


def _prefill(wrapper, tokens, tables):
    host = build_model_inputs(tokens, [0] * len(tokens), tables, BLOCK_SIZE)
    with torch.inference_mode():
        wrapper.forward_prefill_mtp(to_device(host, "cpu"), list(range(K)))


def _snapshot(wrapper):
    return [c.c_kv.clone() for c in wrapper.caches], [c.k_pe.clone() for c in wrapper.caches]


def _restore(wrapper, snap):
    for c, ckv, kpe in zip(wrapper.caches, *snap):
        c.c_kv.copy_(ckv)
        c.k_pe.copy_(kpe)


def _written_mask(slot_lists):
    """[num_blocks * block_size] True at every slot a real sequence writes this step."""
    mask = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    for slots in slot_lists:
        s = torch.as_tensor(slots)
        mask[s[s >= 0]] = True
    return mask


def _assert_cache_contract(wrapper, before, after_eager, written):
    """After the padded step: bit for bit the state before the step outside the real sequences'
    slots and the dummy block; at the real slots, what the unpadded step wrote (equal up to the
    float32 summation order of a larger batch on the cpu backend)."""
    dummy = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    dummy.view(NUM_BLOCKS, BLOCK_SIZE)[wrapper.cache_config.dummy_block_id] = True
    outside = ~written & ~dummy
    now_parts = ([c.c_kv for c in wrapper.caches], [c.k_pe for c in wrapper.caches])
    for now_list, eager_list, old_list in zip(now_parts, after_eager, before):
        for layer, (now, eager, old) in enumerate(zip(now_list, eager_list, old_list)):
            now, eager, old = (t.reshape(NUM_BLOCKS * BLOCK_SIZE, -1) for t in (now, eager, old))
            assert torch.equal(now[outside], old[outside])
            torch.testing.assert_close(now[written], eager[written], atol=2e-6, rtol=2e-6)
            if layer == 0:  # the main model's first layer stores the step's new tokens
                assert torch.count_nonzero(now[written] != old[written]) > 0


def _speculative_inputs(checkpoint_cfg, mode, tables):
    rng = np.random.default_rng(1)
    tokens = [rng.integers(2, checkpoint_cfg.vocab_size, s).tolist() for s in SEQ_LENS]
    num_tokens = np.array(SEQ_LENS)
    layout = di.decode_layout(num_tokens, np.array(LAST_ACCEPTED), K, mode)
    table_arr = di.block_tables(tables)
    main = di.main_inputs(np.array([t[-1] for t in tokens]), num_tokens, table_arr, BLOCK_SIZE, K)
    subs = di.sub_inputs(tokens, layout, table_arr, BLOCK_SIZE, K, mode)
    hidden = torch.randn(int(layout.sub_q_lens.sum()), checkpoint_cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    return tokens, main, subs, hidden


@pytest.mark.parametrize("uniform", [False, True], ids=["slack-seq", "uniform-rows"])
def test_draft_steps_sharing_rows_are_padded_once_as_the_first_would_be_alone(checkpoint, uniform):
    _, cfg = checkpoint
    _, _, subs, _ = _speculative_inputs(cfg, "vanilla", _tables(SEQ_LENS, K + 1))
    subs[1] = subs[1].with_(input_ids=np.arange(subs[1].num_tokens) + 7)  # the same rows, tokens of its own: never read
    per_seq = draft_rows_bucket(int(subs[0].q_lens.max())) if uniform else None
    spec = PadSpec(4, int(subs[0].q_lens[0]), 4 * (per_seq or 8), 8, NUM_BLOCKS - 1, BLOCK_SIZE, slack_seq=not uniform)
    if uniform:
        spec = dataclasses.replace(spec, q=per_seq)
    got, row_map = _pad_draft_steps(subs, per_seq, spec)
    alone = [pad_inputs(pad_rows_per_seq(s, per_seq)[0] if uniform else s, spec, 1) for s in subs]
    assert (row_map is not None) == uniform
    for g, a in zip(got, alone):
        for name, value in vars(a).items():
            if isinstance(value, np.ndarray) and name != "input_ids":
                assert np.array_equal(getattr(g, name), value), name
    assert np.array_equal(got[0].input_ids, alone[0].input_ids)
    assert all(g is got[0] for g in got)  # padded once: only the first step's tokens are read


@pytest.mark.parametrize("uniform", [False, True], ids=["slack-seq", "uniform-rows"])
@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
@pytest.mark.parametrize("buckets", [(3,), (4,), (8,)])
def test_speculative_step_padded_equals_unpadded(wrapper, checkpoint, mode, buckets, uniform):
    _, cfg = checkpoint
    tables = _tables(SEQ_LENS, K + 1)
    tokens, main, subs, hidden = _speculative_inputs(cfg, mode, tables)
    _prefill(wrapper, tokens, tables)
    before = _snapshot(wrapper)

    def step():
        with torch.inference_mode():
            return wrapper.forward_speculative_host(main, subs, list(range(K)) if mode == "vanilla" else [0] * K,
                                                    hidden, subs[0].lm_head_indices)

    expected = step()
    after_eager = _snapshot(wrapper)
    _restore(wrapper, before)
    runner = DecodeGraphRunner(wrapper, buckets=buckets, capture=False, uniform_draft_rows=uniform)
    wrapper.graph_runner = runner
    for _ in range(2):  # the second call reuses the bucket's static buffers
        got = step()
        assert torch.equal(got.draft_tokens, expected.draft_tokens)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-6, rtol=1e-6)
        assert torch.equal(got.logits.argmax(-1), expected.logits.argmax(-1))
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, atol=1e-6, rtol=1e-6)
        _assert_cache_contract(wrapper, before, after_eager, _written_mask([main.slots] + [s.slots for s in subs]))
    assert runner.stats.replays == 2 and len(runner._entries) == 1


@pytest.mark.parametrize("uniform", [False, True], ids=["slack-seq", "uniform-rows"])
@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
@pytest.mark.parametrize("counts", [[K, K, K], [2, 0, 1]], ids=["equal", "ragged"])
def test_speculative_step_with_its_hidden_cache_padded_equals_unpadded(wrapper, checkpoint, mode, uniform, counts):
    """The step reads its first hidden states from the cache and accepts and keeps inside: the
    padded step (bucket 4) gives the eager unpadded step's outputs, accepted counts, cache
    writes and hidden-cache rows, and the same as a step given the gathered states."""
    from mindspec.modeling.hidden_cache import HiddenCacheRows

    _, cfg = checkpoint
    tables = _tables(SEQ_LENS, K + 1)
    tokens, _, subs, hidden = _speculative_inputs(cfg, mode, tables)
    counts = np.array(counts, dtype=np.int64)
    main = di.main_inputs(np.array([t[-1] for t in tokens]), np.array(SEQ_LENS), di.block_tables(tables), BLOCK_SIZE,
                          counts)
    _prefill(wrapper, tokens, tables)
    before = _snapshot(wrapper)
    buffer = torch.cat([torch.zeros(1, hidden.shape[1]), hidden, torch.randn(8, hidden.shape[1])])
    read = np.arange(1, 1 + len(hidden))
    read[::5] = 0  # some rows read the zero row
    keep = 1 + len(hidden) + np.arange(3 * (K + 1)).reshape(3, K + 1)  # rows of the last 8 + 1
    keep[:, -1] = 0  # a position with nowhere to go
    cache = HiddenCacheRows(buffer.clone(), read, counts, keep)
    assert cache.accepts_in_step
    modules = list(range(K)) if mode == "vanilla" else [0] * K

    def step(rows: HiddenCacheRows):
        with torch.inference_mode():
            return wrapper.forward_speculative_host(main, subs, modules, None, subs[0].lm_head_indices, hidden_cache=rows)

    expected = step(cache)
    eager_buffer = cache.buffer.clone()
    with torch.inference_mode():
        gathered = wrapper.forward_speculative_host(main, subs, modules, HiddenCacheRows(
            buffer, read, counts, keep).gathered(), subs[0].lm_head_indices)
    assert torch.equal(gathered.draft_tokens, expected.draft_tokens) and torch.equal(gathered.logits, expected.logits)
    targets = expected.logits.argmax(-1).numpy()
    host = np.minimum(strict_accept(expected.draft_tokens.numpy(), targets[di.verify_grid(counts, K)]), counts)
    np.testing.assert_array_equal(expected.accepted_drafts.numpy(), host)
    after_eager = _snapshot(wrapper)
    _restore(wrapper, before)
    wrapper.graph_runner = DecodeGraphRunner(wrapper, buckets=(4,), capture=False, uniform_draft_rows=uniform)
    for _ in range(2):  # the second call reuses the bucket's static buffers
        rows = replace(cache, buffer=buffer.clone())
        got = step(rows)
        assert torch.equal(got.draft_tokens, expected.draft_tokens)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-6, rtol=1e-6)
        assert torch.equal(got.greedy_tokens, expected.greedy_tokens)
        assert torch.equal(got.accepted_drafts, expected.accepted_drafts)
        torch.testing.assert_close(rows.buffer, eager_buffer, atol=1e-6, rtol=1e-6)
        assert not rows.buffer[0].any()
        _assert_cache_contract(wrapper, before, after_eager, _written_mask([main.slots] + [s.slots for s in subs]))


@pytest.mark.parametrize("uniform", [False, True], ids=["slack-seq", "uniform-rows"])
@pytest.mark.parametrize("host_count", [1, 5])
def test_speculative_step_with_host_drafts_padded_equals_unpadded(wrapper, checkpoint, host_count, uniform):
    """Sequence 1 verifies drafts made on the host (suffix drafts: 1, or 5 > K, whose rows are
    bucketed to 8), the others MTP drafts (1 and 2 of K = 2): one replayed step, the eager
    forward's outputs and cache writes."""
    _, cfg = checkpoint
    tables = _tables(SEQ_LENS, 6)
    tokens, _, subs, hidden = _speculative_inputs(cfg, "vanilla", tables)
    _prefill(wrapper, tokens, tables)
    host_drafts = {1: list(range(11, 11 + host_count))}
    main = di.main_inputs(np.array([t[-1] for t in tokens]), np.array(SEQ_LENS), di.block_tables(tables), BLOCK_SIZE,
                          np.array([1, host_count, 2]), host_drafts)
    before = _snapshot(wrapper)

    def step():
        with torch.inference_mode():
            return wrapper.forward_speculative_host(main, subs, list(range(K)), hidden, subs[0].lm_head_indices)

    expected = step()
    after_eager = _snapshot(wrapper)
    _restore(wrapper, before)
    runner = DecodeGraphRunner(wrapper, buckets=(4,), capture=False, uniform_draft_rows=uniform)
    wrapper.graph_runner = runner
    assert runner.accepts(main, subs)
    for _ in range(2):
        got = step()
        assert torch.equal(got.draft_tokens, expected.draft_tokens)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, atol=1e-6, rtol=1e-6)
        _assert_cache_contract(wrapper, before, after_eager, _written_mask([main.slots] + [s.slots for s in subs]))
    (key,) = runner.shape_keys
    assert key[2] == (K + 1 if host_count <= K else 8) and key[-1] is True  # rows per sequence; host drafts


def test_verify_source_rows_take_mtp_drafts_only_where_a_sequence_verifies_them():
    # 2 real sequences of 3 padded to 4, 4 rows each, K = 3: sequence 0 verifies 2 MTP drafts,
    # sequence 1 host drafts; drafts follow the 16 input rows, sequence b's at 16 + 3 b.
    got = verify_source_rows(np.array([2, 3]), np.array([False, True]), 4, 4, 3)
    assert got.tolist() == [0, 16, 17, 3] + [4, 5, 6, 7] + list(range(8, 16))
    assert host_verify_rows(3, 4) == 4 and host_verify_rows(5, 4) == 8 and host_verify_rows(9, 4) == 12


def test_plain_decode_padded_equals_unpadded(wrapper, checkpoint):
    _, cfg = checkpoint
    tables = _tables(SEQ_LENS, 1)
    rng = np.random.default_rng(5)
    tokens = [rng.integers(2, cfg.vocab_size, s).tolist() for s in SEQ_LENS]
    _prefill(wrapper, tokens, tables)
    host = build_model_inputs([[7], [8], [9]], SEQ_LENS, tables, BLOCK_SIZE)
    expected, got = _eager_then_runner(wrapper, host, DecodeGraphRunner(wrapper, buckets=(1, 2, 4, 8), capture=False))
    assert got.logits.shape == expected.logits.shape and got.hidden_states.shape == expected.hidden_states.shape
    assert list(wrapper.graph_runner._entries) == [("decode", 4, 1, 1)]


@pytest.mark.parametrize("capture", [False, True], ids=["eager-step", "captured"])
def test_plain_decode_keeps_its_hidden_states_as_the_eager_step_does(wrapper, checkpoint, capture):
    """A plain step given a hidden cache and rows (an MTP engine's plain step) writes its hidden
    states there inside the step: what the eager step writes, padding sequences nothing; a
    captured step whose cache grew into a new buffer is captured again, on the new one."""
    _, cfg = checkpoint
    tables = _tables(SEQ_LENS, 1)
    tokens = [np.random.default_rng(6).integers(2, cfg.vocab_size, s).tolist() for s in SEQ_LENS]
    _prefill(wrapper, tokens, tables)
    host = build_model_inputs([[7], [8], [9]], SEQ_LENS, tables, BLOCK_SIZE)
    rows = np.array([3, 11, 6], dtype=np.int64)
    before = _snapshot(wrapper)

    def step(buffer):
        _restore(wrapper, before)
        with torch.inference_mode():
            return wrapper.forward_host(host, keep=HiddenKeep(buffer, rows))

    eager = torch.zeros(16, cfg.hidden_size)
    expected = step(eager)
    torch.testing.assert_close(eager[rows], expected.hidden_states)
    assert eager[[r for r in range(16) if r not in rows]].abs().sum() == 0  # row 0 and the others untouched
    if capture:
        wrapper.backend = _CapturingCpu()
    wrapper.graph_runner = DecodeGraphRunner(wrapper, buckets=(4,), capture=capture)
    for buffer in (torch.zeros(16, cfg.hidden_size), torch.zeros(24, cfg.hidden_size)):  # then it "grew"
        got = step(buffer)
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(buffer[:16], eager, atol=1e-6, rtol=1e-6)  # the padding sequence wrote nothing
        assert buffer[16:].abs().sum() == 0
    assert list(wrapper.graph_runner._entries) == [("decode", 4, 1, 1, "keep")]
    if capture:
        assert wrapper.backend.captures == 2


def _eager_then_runner(wrapper, host, runner):
    """``host``'s forward eagerly, then (the cache restored) through ``runner``: the outputs equal,
    and the runner writes what the eager call wrote and only the dummy block besides."""
    def step():
        with torch.inference_mode():
            return wrapper.forward_host(host)

    before = _snapshot(wrapper)
    expected = step()
    after_eager = _snapshot(wrapper)
    _restore(wrapper, before)
    wrapper.graph_runner = runner
    got = step()
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.hidden_states, expected.hidden_states, atol=1e-6, rtol=1e-6)
    _assert_cache_contract(wrapper, before, after_eager, _written_mask([host.slots]))
    return expected, got


def test_padding_rows_live_in_the_dummy_block_only():
    inputs = build_model_inputs([[1, 2, 3], [4, 5, 6]], [4, 10], [[3, 7], [1, 2, 5, 6]], BLOCK_SIZE)
    spec = PadSpec(num_seqs=4, q=3, num_tokens=4 * 3 + 5, width=6, dummy_block=63, block_size=BLOCK_SIZE, slack_seq=True)
    padded = pad_inputs(inputs, spec, lm_rows_per_seq=1)
    assert padded.q_lens.tolist() == [3, 3, 3, 3, 5] and padded.q_start_loc.tolist() == [0, 3, 6, 9, 12, 17]
    assert padded.seq_lens.tolist()[:2] == [7, 13] and padded.seq_lens.min() >= 1  # never a length-0 row
    assert (padded.block_tables[2:] == 63).all()  # padding rows see the dummy block only ...
    assert (padded.slots[6:] // BLOCK_SIZE == 63).all()  # ... and write nowhere else
    assert (padded.block_tables[:2, :4] == inputs.block_tables).all() and (padded.block_tables[:2, 4:] == 63).all()
    assert padded.lm_head_indices.tolist() == [2, 5, 8, 11]  # one row per padding sequence, not the slack one
    assert (padded.input_ids[:6] == inputs.input_ids).all() and (padded.positions[:6] == inputs.positions).all()
    assert padded.positions[6:].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4] and not padded.is_prefill
    assert [a.dtype for a in input_arrays(padded)] == [a.dtype for a in input_arrays(inputs)]
    # a slack sequence with no rows still has seq_len 1
    tight = pad_inputs(inputs, PadSpec(2, 3, 6, 6, 63, BLOCK_SIZE, slack_seq=True), 1)
    assert tight.q_lens.tolist() == [3, 3, 0] and tight.seq_lens.tolist()[-1] == 1
    # two lm_head rows per sequence (verification): the last two rows of each padding sequence
    two = pad_inputs(inputs.with_(lm_head_indices=np.array([1, 2, 4, 5])), PadSpec(3, 3, 9, 6, 63, BLOCK_SIZE), 2)
    assert two.lm_head_indices.tolist() == [1, 2, 4, 5, 7, 8]
    # a batch that fills its bucket: its own rows, the tables widened with the dummy block
    full = pad_inputs(inputs, PadSpec(2, 3, 6, 6, 63, BLOCK_SIZE), 1)
    for name in ("input_ids", "positions", "slots", "seq_lens", "q_lens", "lm_head_indices"):
        assert np.array_equal(getattr(full, name), getattr(inputs, name)), name
    assert full.block_tables.shape == (2, 6) and (full.block_tables[1, 4:] == 63).all() and not full.is_prefill


def test_draft_rows_buckets_are_one_for_steady_steps_then_powers_of_two():
    assert [draft_rows_bucket(n) for n in (1, 2, 3, 5, 6, 7, 8)] == [6, 6, 6, 6, 6, 8, 8]
    assert [draft_rows_bucket(n) for n in (9, 12, 16, 17, 35)] == [16, 16, 16, 32, 64]
    assert [catches_up(n) for n in (6, 8, 16)] == [False, True, True]


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_steady_steps_need_no_more_draft_rows_than_the_steady_bucket(mode):
    """Every K the modes allow (vanilla up to 3 modules, eagle up to 5), after any step accepting
    up to K + 1 tokens, whatever this step drafts: one shape per draft count."""
    for k_max in range(1, 4 if mode == "vanilla" else 6):
        for k in range(1, k_max + 1):
            accepted = np.arange(1, k_max + 2)
            layout = di.decode_layout(np.full(len(accepted), 100), accepted, k, mode)
            assert layout.sub_q_lens.max() <= STEADY_DRAFT_ROWS
            assert not catches_up(draft_rows_bucket(int(layout.sub_q_lens.max())))
    catch_up = di.decode_layout(np.array([100]), np.array([9]), 3, mode)  # after plain steps
    assert catches_up(draft_rows_bucket(int(catch_up.sub_q_lens.max())))


def test_rows_per_seq_padding_keeps_each_sequences_rows_first():
    inputs = build_model_inputs([[1, 2], [3], [4, 5, 6]], [4, 10, 2], [[3, 7], [1, 2, 5], [6]], BLOCK_SIZE)
    padded, row_map = pad_rows_per_seq(inputs, 3)
    assert row_map.tolist() == [0, 1, 3, 6, 7, 8]
    assert padded.q_lens.tolist() == [3, 3, 3] and padded.seq_lens.tolist() == [7, 13, 5]
    assert padded.input_ids.tolist() == [1, 2, 0, 3, 0, 0, 4, 5, 6]
    assert padded.positions.tolist() == [4, 5, 5, 10, 10, 10, 2, 3, 4]  # padding repeats the last position
    assert (padded.slots[[2, 4, 5]] == -1).all() and (padded.slots[row_map] == inputs.slots).all()
    assert padded.lm_head_indices.tolist() == [1, 3, 8]
    assert (padded.block_tables == inputs.block_tables).all()
    with pytest.raises(ValueError, match="do not fit"):
        pad_rows_per_seq(inputs, 2)
    # rows already in shape: the inputs as they are, each row where it was
    again, same = pad_rows_per_seq(padded, 3)
    assert again is padded and same.tolist() == list(range(9))


def test_pad_refuses_what_does_not_fit():
    inputs = build_model_inputs([[1], [2]], [3, 4], [[1], [2, 3]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="do not fit"):
        pad_inputs(inputs, PadSpec(2, 1, 3, 4, 63, BLOCK_SIZE), 1)  # rows left over, no slack sequence
    with pytest.raises(ValueError, match="width"):
        pad_inputs(inputs, PadSpec(2, 1, 2, 1, 63, BLOCK_SIZE), 1)


def test_accepts_only_uniform_decode_batches(wrapper):
    runner = DecodeGraphRunner(wrapper, buckets=(1, 2, 4), capture=False, max_blocks_per_seq=4)
    decode = build_model_inputs([[1], [2]], [3, 4], [[1], [2, 3]], BLOCK_SIZE)
    assert runner.accepts(decode)
    assert not runner.accepts(build_model_inputs([[1, 2], [3]], [0, 0], [[1], [2]], BLOCK_SIZE))  # prefill
    assert not runner.accepts(build_model_inputs([[1, 2], [3]], [4, 4], [[1, 4], [2, 5]], BLOCK_SIZE))  # ragged
    assert not runner.accepts(build_model_inputs([[1]] * 5, [3] * 5, [[b] for b in range(5)], BLOCK_SIZE))  # too many
    assert not runner.accepts(build_model_inputs([[1]], [30], [list(range(8))], BLOCK_SIZE))  # too wide
    # several tokens after cached ones without drafter steps (a prompt's tail after a shared
    # prefix, or a tree) run eagerly: no graph per tail length
    tail = build_model_inputs([[1, 2]], [3], [[1, 2]], BLOCK_SIZE)
    assert not runner.accepts(tail) and not runner.accepts(tail, tree_mask=torch.ones(1, 2, 2, dtype=torch.bool))
    sub_ok, sub_prefill = build_model_inputs([[1], [2]], [2, 3], [[1], [2, 3]], BLOCK_SIZE), decode.with_(is_prefill=True)
    assert runner.accepts(decode, [sub_ok]) and not runner.accepts(decode, [sub_prefill])


def test_static_inputs_loaded_through_staging_equal_the_host_views():
    """A GPU's static inputs are loaded through the staging buffer (the views it keeps): step
    after step they hold what the cpu's own views hold."""
    first = build_model_inputs([[1], [2]], [3, 4], [[1], [2, 3]], BLOCK_SIZE)
    views = StaticInputs([first, first.with_()], [np.array([0, 1])], torch.device("cpu"))
    staged = StaticInputs([first, first.with_()], [np.array([0, 1])], torch.device("cpu"))
    staged.host = None  # the path a GPU takes
    for step in range(3):
        x = build_model_inputs([[7 + step], [8]], [5 + step, 6], [[4, 5], [6, 9 + step]], BLOCK_SIZE)
        for statics in (views, staged):
            statics.load([x, first], [np.array([step, 1])])
        assert torch.equal(staged.buffer, views.buffer) and staged.inputs[0].input_ids.tolist() == [7 + step, 8]


def test_static_inputs_load_one_step_in_one_buffer(wrapper):
    """A bucket's padded inputs (and extra arrays) live in one device buffer; each load rewrites
    it in place with the next step's values, and the DeviceInputs views see them."""
    first = build_model_inputs([[1], [2]], [3, 4], [[1], [2, 3]], BLOCK_SIZE)
    statics = StaticInputs([first, first.with_()], [np.array([0, 1])], torch.device("cpu"))
    buffer = statics.buffer.data_ptr()
    nxt = build_model_inputs([[7], [8]], [5, 6], [[4, 5], [6, 9]], BLOCK_SIZE)
    statics.load([nxt, first], [np.array([1, 0])])
    assert statics.buffer.data_ptr() == buffer
    x = statics.inputs[0]
    assert x.input_ids.tolist() == [7, 8] and x.positions.tolist() == [5, 6] and x.meta.seq_lens_host == [6, 7]
    assert x.meta.block_tables.tolist() == [[4, 5], [6, 9]] and x.meta.slots.tolist() == nxt.slots.tolist()
    assert x.meta.q_start_loc.dtype == torch.int32 and x.lm_head_indices.dtype == torch.int64
    assert statics.inputs[1].input_ids.tolist() == [1, 2] and statics.extras[0].tolist() == [1, 0]
    with pytest.raises(ValueError, match="do not fit"):
        statics.load([build_model_inputs([[1]], [3], [[1]], BLOCK_SIZE), first], [np.array([0, 1])])


class _CapturingCpu(CpuBackend):
    """A cpu backend that pretends to capture: records captures, replays eagerly into static outputs."""

    def __init__(self, fail=False):
        super().__init__()
        self.captures, self.fail = 0, fail

    @property
    def supports_graph_capture(self):
        return True

    def capture_graph(self, fn):
        self.captures += 1
        if self.fail:
            raise RuntimeError("capture not permitted")
        return StaticGraph(fn)


@pytest.mark.parametrize("fail", [False, True])
def test_capture_once_per_bucket_and_fallback(checkpoint, monkeypatch, fail, caplog):
    path, cfg = checkpoint
    params = {"plugin_type": "mtp", "num_speculative_tokens": K, "mtp_mode": "eagle"}
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]
    expected = [o.token_ids for o in LLM(model=str(path), dtype="float32", cache_block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                         progress=False, plugin_params=params).generate(prompts, greedy)]
    backend = _CapturingCpu(fail)
    monkeypatch.setattr("mindspec.modeling.model_wrapper.get_backend", lambda name, device=None: backend)
    llm = LLM(model=str(path), dtype="float32", cache_block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False,
              plugin_params=params, max_batch_size=3)
    runner = llm.engine.model_wrapper.graph_runner
    assert isinstance(runner, DecodeGraphRunner)
    plain = {("decode", b, 1, 1) for b in (1, 2, 4)}  # captured at start-up, up to the bucket of 3 sequences
    assert set(runner._entries) == plain and backend.captures == 3
    with caplog.at_level(logging.WARNING):
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
        alone = llm.generate([prompts[0]], greedy)[0].token_ids
    assert alone == expected[0]
    buckets_used = {key[1] for key in runner._entries}
    assert backend.captures == len(runner._entries) and buckets_used <= {1, 2, 4}
    assert {k for k in runner._entries if k[0] == "decode" and k[2] == 1} == plain  # no plain capture while serving
    assert runner.stats.replays > backend.captures  # later steps replay what was captured
    if fail:
        assert runner.stats.eager_fallbacks == backend.captures and "capture" in caplog.text
    else:
        assert runner.stats.captures == backend.captures


def test_environment_switch_turns_graphs_off(wrapper, monkeypatch):
    monkeypatch.setattr(type(wrapper.backend), "supports_graph_capture", property(lambda self: True), raising=False)
    assert isinstance(maybe_graph_runner(wrapper), DecodeGraphRunner)
    monkeypatch.setenv("MINDSPEC_GRAPHS", "0")
    assert maybe_graph_runner(wrapper) is None


def test_verification_rows_padded_per_sequence():
    """Sequences verifying 0, 2 and 1 drafts: each padded to 3 rows, every row an lm_head row."""
    inputs = build_model_inputs([[1], [2, 3, 4], [5, 6]], [4, 6, 2], [[3, 7], [1, 2, 5], [6]], BLOCK_SIZE)
    inputs = inputs.with_(lm_head_indices=np.arange(6))
    padded, row_map = pad_verify_rows(inputs)
    assert row_map.tolist() == [0, 3, 4, 5, 6, 7] and padded.q_lens.tolist() == [3, 3, 3]
    assert padded.lm_head_indices.tolist() == list(range(9))
    assert (padded.slots[[1, 2, 8]] == -1).all()  # padding rows write nothing


@pytest.mark.parametrize("drafts", [[0, 2, 1], [2, 0, 2], [3, 3, 3], [4, 0, 7]])
def test_verification_with_a_draft_count_per_sequence_equals_unpadded(wrapper, checkpoint, drafts):
    """A verify-only forward (drafts from any drafter) whose sequences verify different numbers
    of drafts runs through the runner with the unpadded call's outputs and cache writes."""
    _, cfg = checkpoint
    tables = _tables(SEQ_LENS, 1 + max(drafts))
    rng = np.random.default_rng(6)
    tokens = [rng.integers(2, cfg.vocab_size, s).tolist() for s in SEQ_LENS]
    _prefill(wrapper, tokens, tables)
    rows = [rng.integers(2, cfg.vocab_size, 1 + d).tolist() for d in drafts]
    host = build_model_inputs(rows, SEQ_LENS, tables, BLOCK_SIZE)
    host = host.with_(lm_head_indices=np.arange(host.num_tokens))
    runner = DecodeGraphRunner(wrapper, buckets=(4,), capture=False)
    assert runner.accepts(host)
    expected, got = _eager_then_runner(wrapper, host, runner)
    assert got.logits.shape == expected.logits.shape == (host.num_tokens, cfg.vocab_size)
    rows_per_seq = 1 + max(drafts)  # the most drafts + 1
    assert list(runner._entries) == [("decode", 4, rows_per_seq, rows_per_seq)]
    # a prompt's tail (only its last row feeds the lm_head) and more rows than a graph holds run eagerly
    assert not runner.accepts(host.with_(lm_head_indices=np.cumsum(host.q_lens) - 1))
    assert not DecodeGraphRunner(wrapper, buckets=(4,), capture=False, max_verify_rows=2).accepts(host)


def test_static_inputs_load_steps_that_share_rows_with_their_own_tokens(wrapper):
    """Draft steps with the rows of the step before them keep their own tokens; a step given
    twice is one set of device inputs."""
    main = build_model_inputs([[1], [2]], [3, 4], [[1], [2, 3]], BLOCK_SIZE)
    d0 = build_model_inputs([[5, 6], [7]], [2, 3], [[1], [2, 3]], BLOCK_SIZE)
    d1 = d0.with_(input_ids=np.zeros(3, dtype=np.int64))
    padded = [main, d0, d1, d1]
    statics = StaticInputs(padded, [np.array([0, 1])], torch.device("cpu"))
    statics.load(padded, [np.array([1, 0])])
    for static, x in zip(statics.inputs, padded):
        want = input_arrays(x)
        got = [static.input_ids, static.positions, static.meta.slots, static.meta.block_tables, static.meta.seq_lens,
               static.meta.q_lens, static.meta.q_start_loc, static.lm_head_indices]
        for g, w in zip(got, want):
            assert g.numpy().dtype == w.dtype and np.array_equal(g.numpy(), w)
        assert static.meta.seq_lens_host == x.seq_lens.tolist() and static.meta.q_lens_host == x.q_lens.tolist()
    assert statics.inputs[1].input_ids.tolist() == [5, 6, 7] and statics.inputs[3].input_ids.tolist() == [0, 0, 0]
    assert statics.inputs[3] is statics.inputs[2] and len(statics.layout.fields) == 3 * NUM_INPUT_ARRAYS + 1


def test_vanilla_later_draft_steps_are_one_padded_step(checkpoint):
    """MTP Vanilla's draft steps are one step's inputs (later steps' tokens are rolled in on the
    device): padded once, given to the static buffers as one step repeated."""
    _, cfg = checkpoint
    k, num_tokens = 3, np.array(SEQ_LENS)
    tokens = [list(range(2, 2 + n)) for n in SEQ_LENS]
    layout = di.decode_layout(num_tokens, np.array(LAST_ACCEPTED), k, "vanilla")
    subs = di.sub_inputs(tokens, layout, di.block_tables(_tables(SEQ_LENS, k + 1)), BLOCK_SIZE, k, "vanilla")
    assert all(s is subs[0] for s in subs)
    spec = PadSpec(4, int(subs[0].q_lens[0]), 4 * 8, 8, NUM_BLOCKS - 1, BLOCK_SIZE, slack_seq=True)
    got, _ = _pad_draft_steps(subs, None, spec)
    assert got[2] is got[1] is got[0]
