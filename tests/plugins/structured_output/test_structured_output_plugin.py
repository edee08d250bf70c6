"""The plugin's hooks on hand-made steps: verification cuts accepted tokens at the first one the
format refuses and takes that row's own target; matchers catch up with tokens appended since
the last step (a PD hand-off's first token, async fill-in) and are dropped with their sequence."""
import numpy as np
import pytest
import torch

from mindspec.config.defaults import DEFAULT_MODEL_DIR
from mindspec.config.plugin_params import PluginParamsError
from mindspec.engine.sequence import Sequence
from mindspec.plugins.structured_output.structured_output_plugin import StructuredOutputPlugin, parse_options
from mindspec.text_generator.sampling.params import SamplingParams
from mindspec.text_generator.sampling.sampler import unpack_bitmask
from mindspec.text_generator.step import StepBatch, StepInputs, StepOutputs
from mindspec.text_generator.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture()
def plugin(tok):
    return StructuredOutputPlugin(tok, 4096, [1])


def _digits(tok, text):
    """One token per character."""
    ids = [tok.encode(c, add_special_tokens=False) for c in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def _seq(seq_id, output, **params):
    return Sequence(seq_id=seq_id, prompt_token_ids=[5, 6], max_tokens=32, output_token_ids=list(output),
                    sampling_params=SamplingParams(temperature=0, **params))


def _outputs(accepted, rows, sampled):
    return StepOutputs(logits=torch.zeros(len(sampled), 4096), hidden_states=torch.zeros(1, 1),
                       sampled=np.array(sampled), accepted=accepted, accepted_rows=rows,
                       num_draft_accepted=[len(a) - 1 for a in accepted])


def test_verification_cuts_at_the_first_refused_token(tok, plugin):
    one, two, x = _digits(tok, "1")[0], _digits(tok, "2")[0], _digits(tok, "x")[0]
    seqs = [_seq(0, [one], regex="[0-9]+"), _seq(1, [x]), _seq(2, [one], regex="[0-9]+")]
    batch = StepBatch(seqs, is_prefill=False, block_size=4)
    # seq 0 kept drafts "2", "x" (refused), "1"; row 1, where "x" stands, sampled "1" under its mask
    out = _outputs([[two, x, one, two], [x, x], [two, two, one]], [[0, 1, 2, 3], [4, 5], [6, 7, 8]],
                   sampled=[two, one, two, one, x, x, two, two, one])
    out = plugin.plugin_verify(batch, None, out)
    assert out.accepted[0] == [two, one] and out.accepted_rows[0] == [0, 1] and out.num_draft_accepted[0] == 1
    assert out.accepted[1] == [x, x]  # a free sequence is untouched
    assert out.accepted[2] == [two, two, one] and out.num_draft_accepted[2] == 2


def test_masks_follow_tokens_appended_since_the_last_step(tok, plugin):
    digits = _digits(tok, "12")
    seq = _seq(0, [], regex="[0-9]{3}")
    batch = StepBatch([seq], is_prefill=False, block_size=4)
    inputs = StepInputs(model_inputs=None, q_lens=np.array([2]), row_seq=np.array([0, 0]), row_offset=np.array([0, 1]))
    bitmask, rows = plugin.token_bitmask(batch, inputs, [[], [digits[0]]])
    assert rows == [0, 1]
    seq.output_token_ids.extend(digits)  # two tokens appended (one step, or a hand-off and a step)
    bitmask, _ = plugin.token_bitmask(batch, inputs, [[], [digits[0]]])
    allowed = unpack_bitmask(bitmask, 4096)
    assert set(allowed[0].nonzero().flatten().tolist()) == set(_digits(tok, "0123456789"))  # the third digit
    assert allowed[1].nonzero().flatten().tolist() == [1]  # "121" is complete: EOS only
    plugin.plugin_cache_clear([0])
    assert plugin.states == {}


def test_a_batch_without_formats_costs_nothing(tok, plugin):
    batch = StepBatch([_seq(0, [3])], is_prefill=False, block_size=4)
    inputs = StepInputs(model_inputs=None, q_lens=np.array([1]), row_seq=np.array([0]), row_offset=np.array([0]))
    assert plugin.token_bitmask(batch, inputs, [[]]) is None
    assert plugin._grammars is None  # xgrammar not even loaded


def test_options():
    assert parse_options({}) == {"mask_drafts": True}
    assert parse_options({"mask_drafts": False, "num_speculative_tokens": 2}) == {"mask_drafts": False}
    with pytest.raises(PluginParamsError, match="plugin_params.mask_drafts must be true or false"):
        parse_options({"mask_drafts": "no"})
