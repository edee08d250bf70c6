"""With sampling, MTP emits exactly the target distribution: 100k two-token samples from one
prompt, compared cell by cell with the joint distribution computed by transformers."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from tests.support.checkpoints import load_hf_model, make_self_predicting_checkpoint, tiny_v3_config
from tests.support.hf_reference import hf_logits

PROMPT = [17, 42, 99, 5]
NUM_SAMPLES = 100_000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("dist"), cfg, seed=11, residual_scale=0.005)


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Independent restatement of temperature / top-k / top-p on one logits row."""
    probs = torch.softmax(logits.double() / params.temperature, -1)
    if params.top_k > 0:
        kth = probs.topk(params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
    if params.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep_sorted = (sorted_p.cumsum(0) - sorted_p) < params.top_p
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[keep_sorted]] = True
        probs = torch.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def _target_joint(hf, params, prefix: tuple[int, ...] = ()) -> dict[tuple[int, ...], float]:
    """P(the next params.max_tokens - len(prefix) tokens) after PROMPT + prefix, cell by cell."""
    p = _filtered_probs(hf_logits(hf, PROMPT + list(prefix))[-1], params)
    joint = {}
    for t in torch.nonzero(p).flatten().tolist():
        if len(prefix) + 1 == params.max_tokens:
            joint[prefix + (t,)] = float(p[t])
            continue
        for cell, q in _target_joint(hf, params, prefix + (t,)).items():
            joint[cell] = float(p[t]) * q
    return joint


def _tv(counts: dict, probs: dict, n: int) -> float:
    cells = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(c, 0) / n - probs.get(c, 0.0)) for c in cells)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=4, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.6, max_tokens=2, ignore_eos=True),
    ],
    ids=["top_k", "top_p"],
)
def test_mtp_sampling_matches_target_distribution(checkpoint, params):
    # every step must speculate for the test to mean anything: no adaptive plain steps
    _check_distribution(checkpoint, params, {"plugin_type": "mtp", "num_speculative_tokens": 2,
                                             "adaptive_speculation": False}, NUM_SAMPLES)


@pytest.mark.slow
def test_tree_sampling_matches_target_distribution(checkpoint):
    """A dynamic tree (three candidates per node, so sibling candidates are rejected in turn
    before the residual is sampled) emits the target distribution too: three tokens, the third
    drawn at an accepted node's row or, after a rejection, by the next step."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    tree = {"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 2, "tree_topk": 3,
            "num_draft_tokens": 6, "adaptive_speculation": False}
    _check_distribution(checkpoint, params, tree, NUM_SAMPLES // 2)


def _check_distribution(checkpoint, params, plugin_params, num_samples):
    # The unseeded requests draw their noise keys from torch's generator: a fixed sample, so that
    # an exact sampler cannot fail the 1.5x-noise bound by chance (~0.5 % of runs, seen once in CI).
    torch.manual_seed(2026)
    llm = LLM(model=str(checkpoint), dtype="float32", cache_block_size=16, num_blocks=2100, progress=False,
              max_batch_size=2048, max_prefill_batch_size=2048, max_prefill_tokens=10**6,
              plugin_params=plugin_params)
    outs = llm.generate([PROMPT] * num_samples, params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.token_ids)
        counts[key] = counts.get(key, 0) + 1
    target = _target_joint(load_hf_model(checkpoint), params)
    # A perturbed reference: the target blended towards uniform over its own support, 10% at
    # NUM_SAMPLES and more for fewer samples (sampling noise grows as 1 / sqrt(samples), so the
    # perturbation keeps the same size relative to it: at half the samples a 10% blend was within
    # noise of 2x the sampler's own distance once in a while).
    uniform, blend = 1.0 / len(target), 0.1 * np.sqrt(NUM_SAMPLES / num_samples)
    perturbed = {c: (1 - blend) * p + blend * uniform for c, p in target.items()}
    tv_target = _tv(counts, target, num_samples)
    tv_perturbed = _tv(counts, perturbed, num_samples)
    accepted = sum(o.spec_decode.num_accepted_tokens for o in outs)
    assert accepted > 0.1 * num_samples, "drafts must be accepted for the test to mean anything"
    # Expected TV of an exact sampler from multinomial noise alone: 0.5 * sum E|p_hat - p|.
    noise = 0.5 * sum(np.sqrt(2 * p * (1 - p) / (np.pi * num_samples)) for p in target.values())
    assert tv_target < 1.5 * noise
    assert tv_perturbed > 2 * tv_target


def test_same_seed_same_output_with_and_without_mtp(checkpoint):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=16, ignore_eos=True) for s in range(6)]
    prompts = [PROMPT, PROMPT[:2], [3, 1, 4, 1, 5, 9], [8], PROMPT * 3, [2, 7]]
    plain = LLM(model=str(checkpoint), dtype="float32", cache_block_size=4, num_blocks=256, progress=False)
    mtp = LLM(model=str(checkpoint), dtype="float32", cache_block_size=4, num_blocks=256, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 2})
    a = [o.token_ids for o in mtp.generate(prompts, params)]
    assert a == [o.token_ids for o in mtp.generate(prompts, params)]
    # Seeded noise depends only on (seed, output position), so speculation changes nothing.
    assert a == [o.token_ids for o in plain.generate(prompts, params)]
    assert a[0] == mtp.generate([prompts[0]], params[0])[0].token_ids
