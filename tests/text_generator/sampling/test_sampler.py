import math

import numpy as np
import pytest
import torch

from mindspec.text_generator.sampling import sampler as sampler_module
from mindspec.text_generator.sampling import (
    Sampler,
    SamplingMetadata,
    SamplingParams,
    filter_logits,
    processed_probs,
)


def build(params, vocab, outputs=None, positions=None, prompts=None):
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        positions,
        vocab,
        "cpu",
    )


def ref_keep(row, temperature, top_k, top_p, min_p):
    """Plain python reference: the set of token ids the filters keep (ties included)."""
    v = len(row)
    lg = [x / temperature for x in row]
    keep = set(range(v))
    if 0 < top_k < v:
        kth = sorted(lg, reverse=True)[top_k - 1]
        keep = {i for i in keep if lg[i] >= kth}
    if top_p < 1.0:
        z = sum(math.exp(lg[i]) for i in keep)
        p = {i: math.exp(lg[i]) / z for i in keep}
        keep = {i for i in keep if sum(q for q in p.values() if q > p[i]) < top_p}
    if min_p > 0.0:
        m = max(lg)
        keep = {i for i in keep if math.exp(lg[i] - m) >= min_p}
    return keep


@pytest.mark.parametrize("candidates", [256, 3], ids=["whole-rows", "3-candidates"])
def test_filters_match_reference_random_with_ties(candidates, monkeypatch):
    """With 3 candidates most top-k / top-p rows need more than the ranked head: the rows done
    again over their whole row give the reference's set too."""
    monkeypatch.setattr(sampler_module, "RANK_CANDIDATES", candidates)
    rng = np.random.default_rng(0)
    cases = 0
    for _ in range(40):
        v = int(rng.integers(2, 12))
        n = 8
        # logits from a small grid -> plenty of exact ties
        logits = torch.tensor(rng.integers(-4, 5, size=(n, v)) * 0.5, dtype=torch.float32)
        params = []
        for _ in range(n):
            params.append(
                SamplingParams(
                    temperature=float(rng.choice([0.5, 1.0, 1.7])),
                    top_k=int(rng.choice([0, -1, 1 + int(rng.integers(1, v + 2))])),
                    top_p=float(rng.choice([1.0, rng.uniform(0.05, 1.0)])),
                    min_p=float(rng.choice([0.0, rng.uniform(0.0, 1.0)])),
                )
            )
        md = build(params, v)
        scaled = logits / md.temperature.unsqueeze(1)
        kept = torch.isfinite(filter_logits(scaled, md))
        probs = processed_probs(logits, md)
        for i, p in enumerate(params):
            exp = ref_keep(logits[i].tolist(), p.temperature, p.top_k, p.top_p, p.min_p)
            assert set(torch.nonzero(kept[i]).flatten().tolist()) == exp, (i, p, logits[i])
            assert set(torch.nonzero(probs[i] > 0).flatten().tolist()) == exp
            cases += 1
        torch.testing.assert_close(probs.sum(-1), torch.ones(n))
    assert cases == 320


def test_top_p_beyond_the_ranked_candidates_matches_the_reference(monkeypatch):
    """V = 700 > RANK_CANDIDATES: peaked rows decided by the head, flat ones (top-p mass spread
    over more than 256 tokens) done again over the whole row, and a top-k above 256."""
    rng = np.random.default_rng(1)
    v = 700
    logits = torch.tensor(rng.normal(size=(6, v)), dtype=torch.float32)
    logits[:2] *= 8.0  # peaked
    logits[2:4] *= 0.05  # nearly flat: 0.9 of the mass takes most of the vocabulary
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=20), SamplingParams(top_p=0.9),
              SamplingParams(top_p=0.95, top_k=400), SamplingParams(top_k=300), SamplingParams(top_p=0.99, top_k=600)]
    md = build(params, v)
    ranked = []
    real = sampler_module.threshold_over_head
    monkeypatch.setattr(sampler_module, "threshold_over_head",
                        lambda scaled, *a: ranked.append((scaled.shape[0], a[2])) or real(scaled, *a))
    kept = torch.isfinite(filter_logits(logits / md.temperature.unsqueeze(1), md))
    for i, p in enumerate(params):
        assert set(torch.nonzero(kept[i]).flatten().tolist()) == ref_keep(logits[i].tolist(), 1.0, p.top_k, p.top_p, 0.0)
    assert ranked[0] == (6, 600) and ranked[1][1] == v  # the largest top-k widens the head; short rows again
    assert 1 <= ranked[1][0] < 6


def test_filter_ties_explicit():
    logits = torch.tensor([[2.0, 2.0, 2.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, -5.0]])
    md = build([SamplingParams(top_k=2), SamplingParams(top_p=0.3)], 5)
    probs = processed_probs(logits, md)
    # top_k=2 keeps every token tied with the 2nd largest; top_p keeps the tied pair
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]
    assert (probs[1] > 0).tolist() == [True, True, False, False, False]
    torch.testing.assert_close(probs[0, :3], torch.full((3,), 1 / 3))
    torch.testing.assert_close(probs[1, :2], torch.full((2,), 0.5))


def test_top_p_renormalises_over_top_k_and_min_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # over the top-2 (0.4, 0.3) renormalised: 0.571, 0.429 -> top_p 0.5 keeps only the first
    md = build([SamplingParams(top_k=2, top_p=0.5)], 4)
    assert (processed_probs(logits, md)[0] > 0).tolist() == [True, False, False, False]
    # min_p relative to the max: 0.45 * 0.4 = 0.18 keeps 0.4, 0.3, 0.2
    md = build([SamplingParams(min_p=0.45)], 4)
    torch.testing.assert_close(
        processed_probs(logits, md)[0], torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9
    )


def test_temperature_scaling():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 10, generator=g)
    temps = [0.3, 1.0, 2.0, 5.0]
    md = build([SamplingParams(temperature=t) for t in temps], 10)
    probs = processed_probs(logits, md)
    for i, t in enumerate(temps):
        torch.testing.assert_close(probs[i], torch.softmax(logits[i] / t, -1))


def test_greedy_rows_argmax_in_mixed_batch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 30, generator=g)
    logits[2, 7] = logits[2, 11] = logits[2].max() + 1.0  # tie -> lowest id
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(),
        SamplingParams(temperature=0, repetition_penalty=100.0),
    ]
    outputs = [[], [], [], [], [], [int(logits[5].argmax())]]
    md = build(params, 30, outputs=outputs)
    out = Sampler(torch.Generator().manual_seed(0))(logits, md)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    for i in (0, 3):
        assert out.token_ids[i] == logits[i].argmax()
    assert out.token_ids[2] == 7
    # the penalty pushes the previous argmax down; greedy picks the penalised argmax
    assert out.token_ids[5] != logits[5].argmax()
    assert out.token_ids[5] == logits[5].topk(2).indices[1]
    probs = processed_probs(logits, md)
    for i in (0, 2, 3, 5):
        assert probs[i].sum() == 1 and probs[i, out.token_ids[i]] == 1


def test_all_greedy_batch():
    logits = torch.tensor([[0.0, 3.0, 3.0], [5.0, 1.0, 0.0]])
    md = build([SamplingParams(temperature=0)] * 2, 3)
    out = Sampler()(logits, md)
    assert out.token_ids.tolist() == [1, 0]
    assert processed_probs(logits, md).tolist() == [[0, 1, 0], [1, 0, 0]]


def _seeded_tokens(seed, positions, logits, others=0, at=0, other_seed=None):
    """Sample the seeded row at each position, alone or mixed with `others` extra rows."""
    v = logits.shape[1]
    toks = []
    for pos in positions:
        params = [SamplingParams(seed=other_seed) for _ in range(others)]
        params.insert(at, SamplingParams(seed=seed, top_k=40, top_p=0.95))
        pos_list = [pos + 5 * j for j in range(others + 1)]
        pos_list[at] = pos
        md = build(params, v, positions=pos_list)
        batch = logits.repeat(others + 1, 1)
        out = Sampler(torch.Generator().manual_seed(pos * 7 + others))(batch, md)
        toks.append(out.token_ids[at].item())
    return toks


def test_seed_reproducible_and_batch_invariant():
    v = 64
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(5)) * 0.3
    positions = list(range(40))
    alone = _seeded_tokens(1234, positions, logits)
    assert alone == _seeded_tokens(1234, positions, logits)
    assert alone == _seeded_tokens(1234, positions, logits, others=3, at=2)
    assert alone == _seeded_tokens(1234, positions, logits, others=5, at=0, other_seed=99)
    assert len(set(alone)) > 5  # the draws actually vary with the position
    assert alone != _seeded_tokens(1235, positions, logits)


def test_spec_rows_same_seed_consecutive_positions():
    # rows of one sequence at consecutive positions each use their own position's noise
    v = 32
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(6))
    p = SamplingParams(seed=7)
    spec = Sampler()(logits, build([p] * 4, v, positions=[10, 11, 12, 13])).token_ids
    single = [
        Sampler()(logits[i : i + 1], build([p], v, positions=[10 + i])).token_ids.item()
        for i in range(4)
    ]
    assert spec.tolist() == single


def test_unseeded_rows_follow_the_host_generator():
    logits = torch.zeros(8, 50)
    md = build([SamplingParams()] * 8, 50)
    first = Sampler(torch.Generator().manual_seed(3))(logits, md).token_ids
    assert torch.equal(first, Sampler(torch.Generator().manual_seed(3))(logits, md).token_ids)
    assert not torch.equal(first, Sampler(torch.Generator().manual_seed(4))(logits, md).token_ids)
    assert len(set(first.tolist())) > 1  # rows of one step draw apart


def test_seed_restarts_the_unseeded_draws():
    """dp ranks build their samplers under different torch seeds and then seed them alike."""
    logits = torch.zeros(8, 50)
    md = build([SamplingParams()] * 8, 50)
    a, b = Sampler(torch.Generator().manual_seed(3)), Sampler(torch.Generator().manual_seed(4))
    a.seed(11)
    b.seed(11)
    for _ in range(3):  # every later step too
        assert torch.equal(a(logits, md).token_ids, b(logits, md).token_ids)


def _chi2(counts, probs, draws):
    exp = probs * draws
    nz = exp > 0
    assert (counts[~nz] == 0).all(), "sampled a zero-probability token"
    return float((((counts - exp) ** 2)[nz] / exp[nz]).sum())


PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])


def test_unseeded_frequencies_match_probs():
    draws = 20_000
    logits = torch.log(PROBS).repeat(draws, 1)
    md = build([SamplingParams()] * draws, 8)
    out = Sampler(torch.Generator().manual_seed(0))(logits, md)
    counts = torch.bincount(out.token_ids, minlength=8).double()
    # chi-square, 7 dof: the 99.9% quantile is 24.3
    assert _chi2(counts, PROBS.double(), draws) < 24.3


def test_seeded_frequencies_match_filtered_probs():
    draws = 20_000
    v = 8
    logits = torch.log(PROBS).unsqueeze(0)
    p = SamplingParams(seed=42, temperature=0.9, top_k=6, top_p=0.9)
    target = processed_probs(logits, build([p], v))[0].double()
    assert (target > 0).sum() == 5  # top_p cut the tail further
    # one row per output position, so every draw uses its own (seed, position) noise
    md = build([p] * draws, v, positions=list(range(draws)))
    out = Sampler()(logits.repeat(draws, 1), md)
    counts = torch.bincount(out.token_ids, minlength=v).double()
    assert _chi2(counts, target, draws) < 24.3


def test_logprobs_raw_after_penalties():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 20, generator=g)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5, presence_penalty=1.0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(seed=1),
    ]
    md = build(params, 20, outputs=[[0, 1], [], []])
    out = Sampler()(logits, md)
    pen = logits.clone()
    pen[0, [0, 1]] -= 1.0
    lsm = torch.log_softmax(pen, -1)
    torch.testing.assert_close(out.logprobs, lsm.gather(1, out.token_ids[:, None]).squeeze(1))
    ids, vals = out.top_logprobs
    assert ids.shape == (3, 5) and vals.dtype == torch.float32
    ref_vals, ref_ids = lsm.topk(5, -1)
    torch.testing.assert_close(vals, ref_vals)
    assert torch.equal(ids, ref_ids)
    # nobody asked: no logprobs computed at all
    md = build([SamplingParams(temperature=0)] * 3, 20)
    out = Sampler()(logits, md)
    assert out.logprobs is None and out.top_logprobs is None
    assert torch.equal(out.token_ids, logits.argmax(-1))
    # logprobs=0 everywhere: an empty [N, 0] top-n
    out = Sampler()(logits, build([SamplingParams(logprobs=0)] * 3, 20))
    assert out.top_logprobs[0].shape == (3, 0)
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1))


def test_input_not_mutated_and_shape_checked():
    logits = torch.randn(2, 5)
    keep = logits.clone()
    md = build([SamplingParams(repetition_penalty=2.0, min_tokens=1, stop_token_ids=[1])] * 2, 5,
               outputs=[[0], [2]], positions=[0, 0])
    Sampler()(logits, md)
    processed_probs(logits, md)
    assert torch.equal(logits, keep)
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.randn(3, 5), md)


def test_bf16_logits_accepted():
    logits = torch.randn(2, 16).to(torch.bfloat16)
    md = build([SamplingParams(temperature=0, logprobs=0), SamplingParams(seed=0, top_p=0.8)], 16)
    out = Sampler()(logits, md)
    assert out.token_ids[0] == logits[0].float().argmax()
    assert out.logprobs.dtype == torch.float32
    assert processed_probs(logits, md).dtype == torch.float32
