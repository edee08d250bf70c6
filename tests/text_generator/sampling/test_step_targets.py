"""Targets sampled inside a step (sampling/step_targets.py) against the host sampler: the same
tokens for the same rows, keys and draws; where the sampler redoes a row over its whole
vocabulary (a top-p set past the ranked head, a top-k wider than it) the step does too with
``whole_rows``, and says ``exact`` False without."""
import random

import numpy as np
import pytest
import torch

from mindspec.text_generator.sampling import Sampler, SamplingMetadata, SamplingParams
from mindspec.text_generator.sampling import sampler as sampler_module
from mindspec.text_generator.sampling import step_targets
from mindspec.text_generator.sampling.noise import keyed_for_step, row_keys
from mindspec.text_generator.sampling.step_targets import TargetRows, sample_targets, samples_in_step


def _random_params(rng: np.random.Generator, v: int) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.6, 1.0, 1.3])),
        top_k=int(rng.choice([0, -1, 1, 5, v // 2, v + 3])),
        top_p=float(rng.choice([1.0, 0.9, rng.uniform(0.05, 1.0)])),
        seed=None if rng.random() < 0.4 else int(rng.integers(0, 1000)),
    )


def _host(logits: torch.Tensor, params, positions, draw: int) -> torch.Tensor:
    """The host sampler's tokens, its one unseeded draw per step being ``draw``."""
    md = SamplingMetadata.build(params, None, None, positions, logits.shape[1], "cpu")
    sampler = Sampler()
    sampler.step_key = lambda: draw
    return sampler(logits, md).token_ids


def _in_step(logits: torch.Tensor, params, positions, draw: int, whole_rows: bool = False):
    rows = TargetRows.build(params, positions, logits.shape[1], lambda: draw)
    return sample_targets(logits, *[torch.from_numpy(a) for a in rows.arrays()], whole_rows=whole_rows)


def test_the_sampler_s_tokens_for_every_row():
    """Greedy, seeded and unseeded rows, top-k up to past the head, any top-p: greedy rows take
    the argmax, and where the step says its targets are exact they are the host sampler's
    tokens, row for row."""
    exact_cases = 0
    for seed in range(24):
        rng = np.random.default_rng(seed)
        v, n = 600, 8
        logits = torch.from_numpy(rng.normal(size=(n, v)).astype(np.float32)) * float(rng.choice([0.05, 3.0, 8.0]))
        params = [_random_params(rng, v) for _ in range(n)]
        positions = rng.integers(0, 50, n).tolist()
        draw = int(rng.integers(0, 2**63))
        targets, exact = _in_step(logits, params, positions, draw)
        greedy = torch.tensor([p.greedy for p in params])
        assert torch.equal(targets[greedy], logits.argmax(dim=-1)[greedy])
        host = _host(logits, params, positions, draw)
        if bool(exact):
            assert torch.equal(targets, host)
            exact_cases += 1
        whole, exact = _in_step(logits, params, positions, draw, whole_rows=True)
        assert bool(exact) and torch.equal(whole, host), seed
    assert 4 <= exact_cases < 24


def test_peaked_rows_are_exact_and_equal_the_sampler():
    """Rows whose top-p mass the ranked head holds (the common case): exact, the sampler's tokens."""
    rng = np.random.default_rng(1)
    v, n = 700, 16
    logits = torch.from_numpy(rng.normal(size=(n, v)).astype(np.float32)) * 6.0
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=int(s)) for s in range(n // 2)]
    params += [SamplingParams(temperature=1.0, top_k=40, top_p=0.9)] * (n // 2 - 2)
    params += [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    positions = list(range(n))
    for draw in (0, 7, 2**62 + 5):
        targets, exact = _in_step(logits, params, positions, draw)
        assert bool(exact)
        assert torch.equal(targets, _host(logits, params, positions, draw))


def test_a_row_the_head_cannot_decide_makes_the_step_inexact():
    rng = np.random.default_rng(2)
    v = 700
    flat = torch.from_numpy(rng.normal(size=(1, v)).astype(np.float32)) * 0.05  # 0.9 of the mass: most of the row
    peaked = flat * 200
    cases = {
        "flat top-p": ([SamplingParams(top_p=0.9)], flat, False),
        "peaked top-p": ([SamplingParams(top_p=0.9)], peaked, True),
        "flat, no top-p": ([SamplingParams()], flat, True),
        "greedy flat top-p": ([SamplingParams(temperature=0, top_p=0.9)], flat, True),  # greedy rows never look
        "top-k past the head": ([SamplingParams(top_k=300)], peaked, False),
        "top-k within the head": ([SamplingParams(top_k=256)], peaked, True),
    }
    for name, (params, logits, want) in cases.items():
        _, exact = _in_step(logits, params, [0], draw=3)
        assert bool(exact) == want, name
        for draw in range(4):  # with whole_rows: decided, and the sampler's token
            targets, exact = _in_step(logits, params, [0], draw, whole_rows=True)
            assert bool(exact) and torch.equal(targets, _host(logits, params, [0], draw)), name


def test_whole_rows_cost_only_the_steps_that_need_them(monkeypatch):
    """The whole-row threshold runs when some sampled row needs it, not otherwise."""
    rng = np.random.default_rng(5)
    v = 700
    flat = torch.from_numpy(rng.normal(size=(2, v)).astype(np.float32)) * 0.05
    widths = []
    real = step_targets.threshold_over_head
    monkeypatch.setattr(step_targets, "threshold_over_head", lambda s, *a: widths.append(a[2]) or real(s, *a))
    params = [SamplingParams(top_p=0.9, seed=1), SamplingParams(temperature=0)]
    _in_step(flat * 200, params, [0, 0], draw=0, whole_rows=True)
    assert widths == [256]
    widths.clear()
    _in_step(flat, params, [0, 0], draw=0, whole_rows=True)
    assert widths == [256, v]


def test_the_host_sampler_reads_no_more_than_the_head_where_the_step_is_exact(monkeypatch):
    """Where the step is exact the host sampler decides every row from the same head (no row
    done again over its whole row)."""
    rng = np.random.default_rng(3)
    v = 700
    logits = torch.from_numpy(rng.normal(size=(6, v)).astype(np.float32)) * 5.0
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(6)]
    widths = []
    real = sampler_module.threshold_over_head
    monkeypatch.setattr(sampler_module, "threshold_over_head", lambda s, *a: widths.append(a[2]) or real(s, *a))
    _, exact = _in_step(logits, params, list(range(6)), draw=1)
    widths.clear()
    _host(logits, params, list(range(6)), draw=1)
    assert bool(exact) and widths == [256]


def test_keys_seeded_by_position_unseeded_by_one_draw():
    params = [SamplingParams(seed=5), SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=5)]
    positions = [3, 3, 3, 4]
    draws = []

    def draw():
        draws.append(2**63 + 17)  # above int64: wraps as the device's addition does
        return draws[-1]

    rows = TargetRows.build(params, positions, 100, draw)
    assert len(draws) == 1
    keys = torch.from_numpy(row_keys([5, -1, -1, 5], positions))
    seeded = torch.tensor([True, False, False, True])
    assert torch.equal(torch.from_numpy(rows.keys), keyed_for_step(keys, seeded, draws[0]))
    assert rows.temperature.tolist() == [1.0, 1.0, 0.0, 1.0] and rows.top_k.tolist() == [100] * 4
    # every sampled row seeded (or greedy): no draw
    TargetRows.build([SamplingParams(seed=1), SamplingParams(temperature=0)], [0, 0], 100, draw)
    assert len(draws) == 1


def test_padding_rows_are_greedy_and_real_rows_land_where_the_map_says():
    rows = TargetRows.build([SamplingParams(seed=1, top_k=3, top_p=0.5), SamplingParams(seed=2)], [0, 1], 50,
                            lambda: 0)
    padded = rows.padded(6, np.array([1, 4]), 50)
    assert padded.temperature.tolist() == [0, 1, 0, 0, 1, 0]
    assert padded.top_k.tolist() == [50, 3, 50, 50, 50, 50]
    assert padded.top_p.tolist() == pytest.approx([1, 0.5, 1, 1, 1, 1])
    assert padded.keys[[1, 4]].tolist() == rows.keys.tolist()
    assert rows.padded(3, None, 50).temperature.tolist() == [1, 1, 0]


def test_which_requests_sample_in_a_step():
    yes = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(temperature=0.6, top_p=0.95, seed=3),
           SamplingParams(top_k=20, stop=["x"], max_tokens=5)]
    no = [SamplingParams(repetition_penalty=1.1), SamplingParams(logit_bias={3: 1.0}), SamplingParams(min_tokens=2),
          SamplingParams(logprobs=1), SamplingParams(min_p=0.1), SamplingParams(typical_p=0.9),
          SamplingParams(regex="a+")]
    assert all(samples_in_step(p) for p in yes)
    assert not any(samples_in_step(p) for p in no)


def test_compiled_without_graph_breaks_gives_the_eager_tokens():
    """The step's sampling compiles whole (``fullgraph``) and gives the eager tokens."""
    rng = np.random.default_rng(4)
    v, n = 512, 8
    logits = torch.from_numpy(rng.normal(size=(n, v)).astype(np.float32)) * 4.0
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=int(k), seed=int(s))
              for k, s in zip(rng.integers(0, 50, n), range(n))]
    arrays = [torch.from_numpy(a) for a in TargetRows.build(params, list(range(n)), v, lambda: 0).arrays()]
    eager = sample_targets(logits, *arrays)
    compiled = torch.compile(sample_targets, fullgraph=True, dynamic=False)(logits, *arrays)
    assert torch.equal(compiled[0], eager[0]) and bool(compiled[1]) == bool(eager[1])


def test_compiled_whole_rows_branch_inside_and_give_the_eager_tokens():
    """``whole_rows`` compiles to a ``torch.cond`` (no graph break): both of its branches give the
    eager tokens, which are the host sampler's."""
    rng = np.random.default_rng(6)
    v, n = 600, 4
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in range(n - 1)] + [SamplingParams(temperature=0)]
    arrays = [torch.from_numpy(a) for a in TargetRows.build(params, list(range(n)), v, lambda: 0).arrays()]
    compiled = torch.compile(sample_targets, fullgraph=True, dynamic=False)
    for scale in (0.05, 8.0):  # flat rows take the whole-row branch, peaked ones do not
        logits = torch.from_numpy(rng.normal(size=(n, v)).astype(np.float32)) * scale
        eager = sample_targets(logits, *arrays, whole_rows=True)
        got = compiled(logits, *arrays, whole_rows=True)
        assert torch.equal(got[0], eager[0]) and bool(got[1]) and bool(eager[1])
        assert torch.equal(eager[0], _host(logits, params, list(range(n)), 0))
