"""A step's outputs read back to the host: greedy tokens, and a speculative step's drafts packed
after them in one buffer by a captured graph, come back in one copy."""
import numpy as np
import torch

from mindspec.text_generator.step import StepOutputs


def _outputs(greedy, drafts, host_drafts=None):
    return StepOutputs(logits=torch.zeros(len(greedy), 5), hidden_states=torch.zeros(len(greedy), 2),
                       draft_tokens=drafts, greedy_tokens=greedy, host_drafts=host_drafts)


def test_greedy_tokens_and_packed_drafts_come_back_in_one_copy(monkeypatch):
    # as graph_runner._with_greedy packs them: 6 padded greedy rows, then [3 padded seqs, K=2] drafts
    packed = torch.arange(100, 112)
    greedy, drafts = packed[:6][:4], packed[6:].view(3, 2)[:2]  # the real rows: 4 logits rows, 2 sequences
    out = _outputs(greedy, drafts, host_drafts={1: [7, 8, 9]})
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t: copies.append(t.numel()) or real_cpu(t))
    assert out.greedy_host().tolist() == [100, 101, 102, 103]
    assert out.drafts_host().tolist() == [[106, 107, 0], [7, 8, 9]]  # a sequence's host drafts in its row
    assert copies == [6 + 2 * 2]  # one copy, from the first greedy row to the last real draft


def test_tensors_of_separate_buffers_are_read_each_on_its_own():
    greedy, drafts = torch.tensor([3, 4]), torch.tensor([[5], [6]])
    out = _outputs(greedy, drafts)
    assert out.greedy_host().tolist() == [3, 4] and out.drafts_host().tolist() == [[5], [6]]
    logits = torch.tensor([[0.0, 2.0], [3.0, 1.0]])
    plain = StepOutputs(logits=logits, hidden_states=torch.zeros(2, 1))
    assert np.array_equal(plain.greedy_host(), [1, 0])  # no step-computed argmax: taken here
