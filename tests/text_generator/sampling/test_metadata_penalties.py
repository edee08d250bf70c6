from collections import Counter

import numpy as np
import pytest
import torch

from mindspec.text_generator.sampling.noise import row_keys
from mindspec.text_generator.sampling import (
    Sampler,
    SamplingMetadata,
    SamplingParams,
    apply_penalties,
)


def build(params, prompts=None, outputs=None, positions=None, vocab=8, eos=None):
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        positions,
        vocab,
        "cpu",
        eos_token_ids=eos,
    )


def test_flags_fast_path():
    md = build([SamplingParams(temperature=0), SamplingParams(top_k=1)])
    assert md.all_greedy and not md.all_random and not md.any_penalties and not md.any_filters
    assert md.output_counts is None and md.prompt_mask is None and md.banned_rows is None
    md = build([SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(min_p=0.1)])
    assert md.all_random and md.any_top_k and md.any_top_p and md.any_min_p
    assert md.top_k.tolist() == [3, 8, 8]  # off / >= V is stored as V
    assert md.max_num_logprobs is None and not md.any_seeded
    md = build([SamplingParams(top_k=-1, seed=5, logprobs=3), SamplingParams(logprobs=0)])
    assert not md.any_top_k and md.any_seeded and md.max_num_logprobs == 3
    assert md.seeded.tolist() == [True, False] and not md.all_seeded
    assert md.noise_keys.tolist() == row_keys([5, -1], [0, 0]).tolist()
    assert md.temperature.dtype == torch.float32 and md.top_k.dtype == torch.int64


def test_greedy_rows_do_not_raise_filter_flags():
    md = build([SamplingParams(temperature=0, top_k=3, top_p=0.5, seed=1)])
    assert md.all_greedy and not md.any_filters and not md.any_seeded
    assert md.temperature.tolist() == [1.0]  # safe divisor for greedy rows


def test_history_counts_vectorised():
    rng = np.random.default_rng(0)
    v = 37
    params = [SamplingParams(frequency_penalty=0.5, repetition_penalty=1.3) for _ in range(5)]
    prompts = [rng.integers(0, v, size=rng.integers(0, 20)).tolist() for _ in range(5)]
    outputs = [rng.integers(0, v, size=rng.integers(0, 30)).tolist() for _ in range(5)]
    md = build(params, prompts, outputs, vocab=v)
    assert md.output_counts.shape == (5, v) and md.prompt_mask.dtype == torch.bool
    for i in range(5):
        c = Counter(outputs[i])
        assert md.output_counts[i].tolist() == [c.get(t, 0) for t in range(v)]
        assert md.prompt_mask[i].tolist() == [t in set(prompts[i]) for t in range(v)]
    # positions default to len(output_ids)
    assert md.noise_keys.tolist() == row_keys([-1] * 5, [len(o) for o in outputs]).tolist()
    seeded = build([SamplingParams(seed=1)] * 5, prompts, outputs, vocab=v)
    assert seeded.all_seeded and seeded.noise_keys.tolist() == row_keys([1] * 5, [len(o) for o in outputs]).tolist()


def test_rows_without_penalties_skip_history():
    md = build(
        [SamplingParams(), SamplingParams(presence_penalty=1.0)],
        prompts=[[1, 2], [3]],
        outputs=[[1, 1], [2, 2]],
    )
    assert md.output_counts[0].sum() == 0 and md.output_counts[1, 2] == 2
    assert not md.prompt_mask.any()  # no row uses the repetition penalty


def test_spec_rows_have_their_own_history():
    # one sequence, 3 rows at consecutive positions; row j sees output + drafts[:j]
    out, drafts = [4, 5], [6, 6]
    p = SamplingParams(frequency_penalty=1.0)
    rows_out = [out + drafts[:j] for j in range(3)]
    md = build([p] * 3, [[0]] * 3, rows_out, positions=[2, 3, 4])
    assert md.output_counts[:, 6].tolist() == [0, 1, 2]
    seeded = build([SamplingParams(seed=9)] * 3, [[0]] * 3, rows_out, positions=[2, 3, 4])
    assert seeded.noise_keys.tolist() == row_keys([9] * 3, [2, 3, 4]).tolist()


def test_build_errors():
    with pytest.raises(ValueError, match="disagree"):
        build([SamplingParams()], prompts=[[], []])
    with pytest.raises(ValueError, match="outside"):
        build([SamplingParams(presence_penalty=1.0)], outputs=[[8]])
    with pytest.raises(ValueError, match="outside"):
        build([SamplingParams(min_tokens=2, stop_token_ids=[9])])


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    md = build([p], prompts=[[0]], outputs=[[1, 1, 3]], vocab=5)
    out = apply_penalties(logits, md)
    # t0: prompt only -> 2/2; t1: -1*2 - 0.5*2 - 0.25; t2 untouched; t3: 3/2 - 0.5 - 0.25; t4 untouched
    torch.testing.assert_close(out, torch.tensor([[1.0, -3.25, 0.5, 0.75, -2.0]]))
    assert logits[0, 0] == 2.0  # input untouched


def test_penalties_per_row_and_prompt_scope():
    logits = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 2.0], [1.0, -1.0, 2.0]])
    params = [
        SamplingParams(frequency_penalty=1.0, presence_penalty=0.5),  # prompt ignored
        SamplingParams(repetition_penalty=0.5),  # < 1 boosts seen tokens
        SamplingParams(),
    ]
    md = build(params, prompts=[[0, 1], [0, 1], [0]], outputs=[[2, 2], [], [2]], vocab=3)
    out = apply_penalties(logits, md)
    expected = torch.tensor([[1.0, -1.0, 2.0 - 2.0 - 0.5], [2.0, -0.5, 2.0], [1.0, -1.0, 2.0]])
    torch.testing.assert_close(out, expected)


def test_penalties_match_python_reference():
    rng = np.random.default_rng(1)
    v, n = 11, 6
    params = [
        SamplingParams(
            repetition_penalty=float(rng.uniform(0.5, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            presence_penalty=float(rng.uniform(-2, 2)),
        )
        for _ in range(n)
    ]
    prompts = [rng.integers(0, v, size=5).tolist() for _ in range(n)]
    outputs = [rng.integers(0, v, size=7).tolist() for _ in range(n)]
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(0))
    out = apply_penalties(logits, build(params, prompts, outputs, vocab=v))
    for i, p in enumerate(params):
        c = Counter(outputs[i])
        for t in range(v):
            x = logits[i, t].item()
            if t in c or t in prompts[i]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * c.get(t, 0) + p.presence_penalty * (t in c)
            assert out[i, t].item() == pytest.approx(x, rel=1e-5, abs=1e-5)


def test_min_tokens_bans_stop_and_eos():
    v = 6
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0]]).repeat(4, 1)
    logits[:, 4] = 8.0
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4], ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4]),  # position reached
        SamplingParams(min_tokens=3, stop_token_ids=[4], seed=3),
    ]
    md = build(params, positions=[2, 0, 3, 1], vocab=v, eos=[5])
    out = Sampler()(logits, md)
    assert out.token_ids.tolist()[:3] == [0, 5, 5]
    assert out.token_ids[3].item() not in (4, 5)
    probs = Sampler().processed_probs(logits, md)
    assert probs[3, 4] == 0 and probs[3, 5] == 0
    assert md.banned_rows.tolist() == [0, 0, 1, 3, 3]
