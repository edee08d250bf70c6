"""The MTP hidden history: a ring buffer of the last ``keep`` positions per sequence slot."""
import numpy as np
import torch

from mindspec.plugins.mtp.hidden_history import HiddenHistory


def _rows(positions, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(positions), 4, generator=g)


def test_reads_back_the_last_keep_positions_across_the_wrap():
    h = HiddenHistory(keep=5)
    a = h.add(10, torch.zeros(1, 4))
    b = h.add(11, torch.zeros(1, 4))
    first, later = np.arange(0, 4), np.arange(4, 9)  # sequence 10 writes 9 positions: 4..8 survive
    h.write(np.array([a]), np.array([0]), np.array([4]), _rows(first, 0), np.array([0]))
    rows = _rows(later, 1)
    h.write(np.array([a]), np.array([4]), np.array([5]), rows, np.array([0]))
    other = _rows([0, 1], 2)
    h.write(np.array([b]), np.array([7]), np.array([2]), other, np.array([0]))  # another slot is untouched by slot a's writes
    assert torch.equal(h.read(np.full(5, a), later), rows)
    assert torch.equal(h.read(np.array([b, a, b]), np.array([8, 6, 7])), torch.stack([other[1], rows[2], other[0]]))


def test_slots_are_reused_and_growth_keeps_contents():
    h = HiddenHistory(keep=3)
    slots = [h.add(i, torch.zeros(1, 4)) for i in range(8)]
    assert slots == list(range(8))
    rows = _rows(range(8), 3)
    h.write(np.array(slots), np.full(8, 2), np.ones(8, dtype=np.int64), rows, np.arange(8))
    h.remove(3)
    assert h.add(99, torch.zeros(1, 4)) == 3  # a finished sequence's slot goes to the next one
    assert h.add(100, torch.zeros(1, 4)) == 8  # past the first 8 slots: the buffer grows
    assert h.capacity >= 9 and h.buf.shape[0] == 1 + h.capacity * 3
    keep = [0, 1, 2, 4, 5, 6, 7]
    assert torch.equal(h.read(np.array(keep), np.full(7, 2)), rows[keep])
    assert h.add(5, torch.zeros(1, 4)) == 5  # a sequence already holding a slot keeps it


def test_invalid_rows_read_zeros():
    """Padding rows of a draft window read the zero row, whatever slot and position they name."""
    h = HiddenHistory(keep=4)
    a = h.add(1, torch.zeros(1, 4))
    rows = _rows(range(3), 5)
    h.write(np.array([a]), np.array([0]), np.array([3]), rows, np.array([0]))
    got = h.read(np.array([a, a, a]), np.array([2, -7, 0]), valid=np.array([True, False, True]))
    assert torch.equal(got, torch.stack([rows[2], torch.zeros(4), rows[0]]))


def test_one_write_of_more_than_keep_positions_keeps_the_newest():
    """A step accepting more tokens than the history keeps (long suffix drafts): its last ``keep``
    positions survive, whatever order rows of one write land in."""
    h = HiddenHistory(keep=3)
    a = h.add(1, torch.zeros(1, 4))
    rows = _rows(range(7), 6)
    h.write(np.array([a]), np.array([10]), np.array([5]), rows, np.array([2]))  # positions 10..14 from rows 2..6
    assert torch.equal(h.read(np.full(3, a), np.array([12, 13, 14])), rows[4:7])


def test_one_row_per_sequence_from_a_padded_step_in_another_dtype():
    """A plain step's write: one row per sequence, from rows of a step padded past the batch
    (its padding rows are not kept), converted to the buffer's dtype."""
    h = HiddenHistory(keep=4)
    slots = np.array([h.add(i, torch.zeros(1, 4)) for i in (7, 8, 9)])
    step = _rows(range(4), 7).double()  # [4 padded rows, hidden]
    h.write(slots[[2, 0]], np.array([5, 9]), np.ones(2, dtype=np.int64), step, np.array([1, 3]))
    assert h.buf.dtype == torch.float32
    assert torch.equal(h.read(slots[[0, 2]], np.array([9, 5])), step[[3, 1]].float())
    assert torch.equal(h.read(slots[[1]], np.array([5])), torch.zeros(1, 4))  # sequence 8 wrote nothing


def test_plain_steps_keep_the_history_a_write_after_them_would(tmp_path, monkeypatch):
    """An MTP engine's plain steps keep each sequence's hidden state in the history inside the
    step (``keep_hidden``): the same history, drafts and tokens as writing it after the step,
    with no write left to do after it."""
    from mindspec import LLM, SamplingParams
    from mindspec.plugins.mtp.mtp_plugin import MtpPlugin
    from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
    from tests.support.draft_counts import script_mtp_counts

    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    path = make_self_predicting_checkpoint(tmp_path, cfg, seed=3, residual_scale=0.01)
    params = {"plugin_type": "mtp", "num_speculative_tokens": 2, "adaptive_speculation": False}
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    writes, accepted = [], []
    real_write, verify = HiddenHistory.write_rows, MtpPlugin.plugin_verify
    monkeypatch.setattr(HiddenHistory, "write_rows", lambda self, *a: writes.append(1) or real_write(self, *a))

    def spy(self, batch, inputs, outputs):  # drafts kept per step: the drafts read the history
        out = verify(self, batch, inputs, outputs)
        if out.num_draft_accepted is not None:
            accepted.append(list(out.num_draft_accepted))
        return out

    monkeypatch.setattr(MtpPlugin, "plugin_verify", spy)

    def run():
        writes.clear()
        accepted.clear()
        llm = LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=64, progress=False,
                  plugin_params=params, max_batch_size=2)
        scripted = script_mtp_counts(llm, [0, 0, 0, True, 0, True, True])  # plain steps before and between K=2
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
        plugin = llm.engine.plugin_manager.plugins[0]
        return [o.token_ids for o in out], list(accepted), plugin.history.buf.clone(), len(writes), scripted.log

    tokens, kept, history, written, drafts = run()
    plain_inputs = MtpPlugin._plain_inputs

    def writing_after(self, batch, inputs):
        inputs = plain_inputs(self, batch, inputs)
        inputs.extra.pop("keep_hidden", None)  # as before: _plain_done writes the states after the step
        return inputs

    monkeypatch.setattr(MtpPlugin, "_plain_inputs", writing_after)
    tokens_after, kept_after, history_after, written_after, _ = run()
    assert written == 0 and written_after > 0 and 0 in drafts and sum(map(sum, kept)) > 0
    assert tokens == tokens_after and kept == kept_after
    assert torch.equal(history, history_after)
