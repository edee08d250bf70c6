"""Adaptive speculation: the controller's choices, and losslessness when steps alternate between
speculative and plain decoding (the MTP caches catch up on the entries plain steps skipped)."""
import numpy as np
import torch
import pytest

from mindspec import LLM, SamplingParams
from mindspec.plugins.mtp import adaptive, sequence_acceptance
from mindspec.plugins.mtp.sequence_acceptance import SequenceAcceptance, sequence_alphas
from mindspec.plugins.mtp.adaptive import AdaptiveSpeculation, batch_bucket
from mindspec.modeling.graph_runner import STEADY_DRAFT_ROWS
from mindspec.plugins.mtp.mtp_plugin import CATCH_UP
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
from tests.support.draft_counts import ScriptedSpeculation, script_mtp_counts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# ---- the controller -----------------------------------------------------------------------------
def _counts(ctl: AdaptiveSpeculation, steps: int, seconds: dict[int, float], runs: list[int], ids=None,
            tries: list | None = None):
    """Run `steps` decisions for len(runs) sequences. Sequence b would keep runs[b] drafts if it
    had enough, so verifying c drafts it keeps min(runs[b], c); a step drafting k (the most any
    sequence verifies) takes seconds[k]. Returns every step's per-sequence counts; ``tries``
    gets, per step, whether it was a step of a re-exploration burst."""
    ids = list(range(len(runs))) if ids is None else ids
    out = []
    for _ in range(steps):
        counts = ctl.draft_counts(ids)
        if tries is not None:
            tries.append(_in_try(ctl.buckets[batch_bucket(len(ids))]))
        out.append(counts.tolist())
        _step(ctl, ids, counts, [min(r, c) for r, c in zip(runs, counts)], seconds[int(counts.max())])
    return out


def _step(ctl: AdaptiveSpeculation, ids, counts, accepted, seconds):
    """One step as the plugin reports it: what was kept, then the step's time."""
    ctl.record(ids, counts, accepted)
    ctl.time_step(len(ids), int(max(counts)), seconds)


def _in_try(b) -> bool:
    t = b.last_try
    return t is not None and t.start <= b.steps < t.start + TRY


def _feed(ctl: AdaptiveSpeculation, steps: int, seconds: dict[int, float], runs: list[int], ids=None):
    """As _counts; returns each step's draft count (the most any sequence verified)."""
    return [max(c) for c in _counts(ctl, steps, seconds, runs, ids)]


TIMING = adaptive.SETTLE + adaptive.MIN_SAMPLES  # steps of an arm's first run in a bucket
TRY = adaptive.SETTLE + adaptive.REEXPLORE_BURST  # steps of a re-exploration try
MOST = [3, 3]  # every draft kept: K=3 yields 4 tokens per sequence
ON_WINS = {0: 1.0, 1: 1.4, 2: 1.7, 3: 2.0}  # with MOST: 3 drafts give 4 tokens in 2 s (2/s); plain 1/s
# Accepted at position 1, 2, 3 when reached: 0.8, 0.75, 2/3 -> 1.8, 2.4, 2.8 tokens for k = 1, 2, 3.
RUNS = [0] * 3 + [1] * 3 + [2] * 3 + [3] * 6
CPU_LIKE = {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9}  # batch-1 step cost by draft count, eager cpu (~)


def test_explores_every_arm_then_keeps_the_fastest():
    ctl = AdaptiveSpeculation(range(4))
    first = _feed(ctl, 4 * TIMING, ON_WINS, MOST)
    assert first == [k for k in (3, 2, 1, 0) for _ in range(TIMING)]  # one run each, the most speculative first
    later = _counts(ctl, 40, ON_WINS, MOST)
    assert all(c == [3, 3] for c in later)
    rates = ctl.summary()[2]
    assert rates["k"] == 3 and rates["tokens_per_s"][3] > rates["tokens_per_s"][0] == 1.0


def test_each_sequence_blends_its_counts_with_its_prior_scaled_by_its_first_position():
    """sequence_alphas, one pass over the batch, by hand: a sequence that kept 3 of 4 first drafts
    against a prior of 0.5 has the prior's later positions scaled by 1.5; one that verified
    nothing has its own prior."""
    a, b = SequenceAcceptance(3), SequenceAcceptance(3)
    a.verified[:], a.accepted[:] = [4, 2, 0], [3, 1, 0]
    prior = np.array([[0.5, 0.5, 0.5], [0.9, 0.8, 0.7]])  # one row per sequence (their kinds differ)
    want = np.array([[(3 + 2 * 0.5) / 6, (1 + 2 * 0.75) / 4, (0 + 2 * 0.75) / 2], [0.9, 0.8, 0.7]])
    np.testing.assert_allclose(sequence_alphas([a, b], prior), want)
    np.testing.assert_allclose(sequence_alphas([a], prior[0]), want[:1])  # one prior for all


def test_expected_tokens_from_acceptance_per_position():
    acc = adaptive.Acceptance(3)
    acc.record(3, [min(r, 3) for r in RUNS])
    assert [round(acc.tokens(k), 6) for k in range(4)] == [1.0, 1.8, 2.4, 2.8]
    acc.record(1, [min(r, 1) for r in RUNS])  # one draft: position 1 again, the later ones decay only
    assert acc.tokens(1) == pytest.approx(1.8) and acc.tokens(3) == pytest.approx(2.8)
    acc.record(2, [0] * 15)  # nothing accepted: position 1 drops, positions 2-3 keep their rate
    alpha1 = (12 * adaptive.DECAY ** 2 + 12 * adaptive.DECAY) / (15 * adaptive.DECAY ** 2 + 15 * adaptive.DECAY + 15)
    assert acc.tokens(1) == pytest.approx(1 + alpha1)
    assert acc.tokens(3) == pytest.approx(1 + alpha1 * (1 + 0.75 + 0.75 * 2 / 3))
    ragged = adaptive.Acceptance(3)  # per-sequence counts: a sequence verifying 1 never reaches position 2
    ragged.record([3, 1, 0], [2, 1, 0])
    assert ragged.verified.tolist() == [2, 1, 1] and ragged.accepted.tolist() == [2, 1, 0]


def test_a_sequence_whose_drafts_miss_stops_drafting_within_a_few_steps_and_retries():
    ctl = AdaptiveSpeculation(range(4))
    _feed(ctl, 4 * TIMING, CPU_LIKE, [3, 3], ids=[1, 9])  # every arm timed on easy sequences
    ctl.finish([9])
    tries = []  # per step, whether it belonged to a re-exploration burst
    # sequence 1 keeps every draft (the steps draft), sequence 2 none of its own
    counts = [c[1] for c in _counts(ctl, 120, CPU_LIKE, [3, 0], ids=[1, 2], tries=tries)]
    first_plain = counts.index(0)
    assert first_plain <= 12  # its one-draft row stops paying (~0.2 tokens) within a few steps
    # retries: one draft each (outside the re-exploration bursts, which time every arm now and
    # then), the waits doubling up to RETRY_MAX
    retries = [i for i in range(first_plain, len(counts)) if counts[i] > 0 and not tries[i]]
    assert retries and all(counts[i] == 1 for i in retries)
    drafted = [first_plain - 1] + retries
    gaps = np.diff(drafted)
    assert gaps[0] >= sequence_acceptance.RETRY_AFTER and gaps.max() <= sequence_acceptance.RETRY_MAX + 1
    assert retries[1] - retries[0] == 2 * sequence_acceptance.RETRY_AFTER + 1  # the second wait doubled
    assert sum(counts[first_plain:]) <= 0.15 * len(counts[first_plain:])  # drafting is rare now


def test_a_plain_bucket_holds_back_sequences_whose_drafts_pay_without_retries():
    """Every draft is kept, but at this batch size no step that drafts pays: the steps go plain and
    the sequence retries nothing (each retry would catch up its MTP caches); the bucket's own tries
    re-time the arms now and then."""
    ctl = AdaptiveSpeculation(range(4))
    slow = {0: 1.0, 1: 2.5, 2: 3.5, 3: 4.5}  # one draft kept: 2 tokens in 2.5 s against 1 in 1 s
    tries = []
    counts = [c[0] for c in _counts(ctl, 200, slow, [3], tries=tries)]
    settled = range(4 * TIMING + 4, len(counts))
    assert all(counts[i] == 0 for i in settled if not tries[i])
    assert any(tries[i] for i in settled)


def test_a_new_request_starts_from_the_prior_not_from_the_last_requests_state():
    """The issue's case: after one request whose drafts all missed, the next request drafts from
    its first step (the prior is the mean of the last finished sequences, each counted once)."""
    ctl = AdaptiveSpeculation(range(4))
    for seq_id in range(5):  # five requests whose drafts are kept
        _feed(ctl, 20, CPU_LIKE, [3], ids=[seq_id])
        ctl.finish([seq_id])
    bad = _counts(ctl, 40, CPU_LIKE, [0], ids=[5])
    assert bad[-1] == [0]
    ctl.finish([5])
    assert ctl.draft_counts([6]).tolist() == [3]


def test_sequences_of_one_step_verify_their_own_counts():
    ctl = AdaptiveSpeculation(range(4))
    runs = [3, 0, 3, 1]  # per sequence: drafts it would keep
    last = np.array(_counts(ctl, 60, CPU_LIKE, runs)[-10:])
    assert (last[:, 0] == 3).all() and (last[:, 2] == 3).all()  # easy text: every draft
    assert np.median(last[:, 1]) == 0  # drafts that miss: none (retries aside)
    assert (last[:, 3] == 1).all()  # one kept per step: its second draft is never worth a row


def test_picks_the_best_step_draft_count_for_the_batch():
    """Eagle's arms 0..K: at a large batch one draft can beat both three and none; sequences whose
    drafts miss verify none inside those one-draft steps."""
    ctl = AdaptiveSpeculation(range(4))
    seconds = {0: 1.0, 1: 1.5, 2: 2.2, 3: 3.0}
    first = _feed(ctl, 4 * TIMING, seconds, RUNS)
    assert first == [k for k in (3, 2, 1, 0) for _ in range(TIMING)]  # one run each, the most speculative first
    steps = _counts(ctl, 40, seconds, RUNS)
    assert {max(c) for c in steps[-20:]} == {1} and ctl.summary()[16]["k"] == 1
    assert all(c[:3] == [0, 0, 0] for c in steps[-5:])


def test_switches_off_when_speculation_loses_and_back_when_it_wins():
    ctl = AdaptiveSpeculation(range(4))
    loses = {0: 1.0, 1: 2.0, 2: 2.2, 3: 2.4}  # with one draft kept in two: 1.5 tokens in 2 s at best
    half = [0, 1] * 16
    _feed(ctl, 4 * TIMING, loses, half)
    off = _feed(ctl, 20, loses, half)
    assert off[-5:] == [0] * 5 and sum(1 for k in off if k) <= 3  # retries aside
    # Speculation becomes cheaper and better accepted; the estimate follows as re-explored steps
    # replace old ones (a few every REEXPLORE_EVERY steps; a window's worth is more than enough).
    choices = _feed(ctl, adaptive.REEXPLORE_EVERY * adaptive.WINDOW, {k: 1.0 for k in range(4)}, [3] * 32)
    assert choices[-1] == 3


def test_a_few_slow_steps_do_not_flip_the_choice():
    """A step slowed by something else on the machine (every 5th speculative one here, 10x) must
    not outweigh the typical step: speculation stays chosen."""
    ctl = AdaptiveSpeculation(range(4))
    steps = []
    for _ in range(80):
        counts = ctl.draft_counts([0, 1])
        k = int(counts.max())
        spec_steps = sum(1 for s in steps if s == 3)
        seconds = 20.0 if k == 3 and spec_steps % 5 == 4 else ON_WINS[k]
        _step(ctl, [0, 1], counts, [min(r, c) for r, c in zip(MOST, counts)], seconds)
        steps.append(k)
    assert steps[-20:].count(3) >= 20 - TRY
    assert ctl.summary()[2]["k"] == 3


def test_an_arm_is_timed_once_its_run_has_settled():
    """The first steps of a run find the caches holding the other arm's weights (compiled cpu,
    batch 1: a plain step 1.44, 1.24, 1.11, 1.07 ms after a speculative run, then 1.01). Timed
    from its first step, an arm tried in short runs looks slower than the chosen arm, which runs
    warm; timed after SETTLE steps, each arm's estimate is its warm cost."""
    ctl = AdaptiveSpeculation([1, 0])
    warm = {0: 1.0, 1: 1.5}  # one draft, kept 2 times in 5: 1.4 tokens in 1.5 s; plain 1 in 1 s
    step = iter(range(10**6))
    cold = []

    def run(steps):
        for _ in range(steps):
            counts = ctl.draft_counts([0])
            k = int(counts[0])
            b = ctl.buckets[1]
            first = b.run_steps if k == b.run_arm else 0  # steps of this arm just before
            seconds = warm[k] * (1.5 if first < 4 else 1.0)  # four cold steps after a switch
            cold.append(seconds != warm[k])
            _step(ctl, [0], counts, [min(k, int(next(step) % 5 < 2))], seconds)

    run(2 * TIMING + 4 * adaptive.REEXPLORE_EVERY)
    b = ctl.buckets[1]
    assert any(cold) and all(x == warm[k] for k in (0, 1) for x in b.seconds[k])  # no cold step sampled
    assert b.choice == 0 and b.tries >= 3  # each arm tried again in runs of its own


def test_arms_are_compared_as_they_ran_next_to_each_other():
    """Step times grow with the context within a request (and move with the machine's load): an
    arm tried a while ago has a median from shorter contexts than the arm chosen, which runs
    now. The choice compares arms by their times relative to one another from runs next to each
    other; by medians taken at different moments, one draft (always kept: 2 tokens in 2.2 plain
    steps' time, a loss at any context) looks cheaper after every try, and is chosen (232 steps
    drafting after the first 200, 23 tries, against 28 and 8)."""
    ctl = AdaptiveSpeculation(range(2))
    drafted = []
    for step in range(2000):
        counts = ctl.draft_counts([0])
        k = int(counts.max())
        _step(ctl, [0], counts, [k], (1.0 if k == 0 else 2.2) * (1 + step / 50))  # every arm slower as it goes
        drafted.append(k)
    b = ctl.buckets[1]
    assert b.choice == 0 and b.ratio[1] / b.ratio[0] == pytest.approx(2.2, rel=0.1)
    assert sum(drafted[200:]) <= b.tries * TRY  # only the tries draft


def test_a_plain_decision_holds_for_its_batch():
    """Deciding costs ~0.1 ms of a ~1 ms plain step at batch 1: a decision that every sequence
    decodes plainly holds PLAIN_HOLD steps for the same sequences; another batch decides anew,
    and the bucket's tries keep their schedule."""
    ctl = AdaptiveSpeculation(range(4))
    loses = {0: 1.0, 1: 2.5, 2: 3.5, 3: 4.5}  # every draft kept, and still slower than plain steps
    _feed(ctl, 4 * TIMING + 2, loses, [3])
    b = ctl.buckets[1]
    assert b.choice == 0 and b.plain_batch == (0,) and b.plain_until > b.steps
    decided = []
    original = ctl._alphas

    def spy(*args):
        decided.append(ctl.buckets[1].steps)
        return original(*args)

    ctl._alphas = spy
    b.next_try = b.steps + 4 * adaptive.PLAIN_HOLD + 1  # no try within these holds
    counts = _feed(ctl, 4 * adaptive.PLAIN_HOLD, loses, [3])
    assert counts == [0] * len(counts) and len(decided) == 4
    assert np.diff(decided).tolist() == [adaptive.PLAIN_HOLD] * 3
    b.next_try = b.steps + 2  # a try falls due within a hold: it runs on schedule
    assert _feed(ctl, TRY + 1, loses, [3]) == [0] + [3] * TRY and len(decided) == 4
    ctl.draft_counts([5])  # another sequence: decided at once
    assert len(decided) == 5


def test_margin_prevents_flip_flopping_on_noise():
    ctl = AdaptiveSpeculation(range(4))
    times = {0: 1.0, 1: 2.0, 2: 2.5, 3: 3.0}  # every draft kept: 3 drafts 4/3 tokens per s, 2 drafts 1.2
    _feed(ctl, 4 * TIMING, times, [3, 3])
    # 3 drafts become 2% slower than 2 (4 tokens in 3.4 s): inside the margin, the choice stays
    assert set(_feed(ctl, 30, {**times, 3: 3.4}, [3, 3])[:adaptive.REEXPLORE_EVERY - 20]) == {3}


def test_reexplores_the_other_arms_now_and_then():
    ctl = AdaptiveSpeculation(range(4))
    # tries at steps 64, 128 and 256: nothing moves, so the waits double
    choices = _feed(ctl, 7 * adaptive.REEXPLORE_EVERY + TRY, {k: 1.0 for k in range(4)}, [3] * 8)
    after_warmup = choices[4 * TIMING:]
    assert {0, 1, 2} <= set(after_warmup)  # each arm not chosen is re-tried in turn
    assert sum(1 for k in after_warmup if k != 3) == 3 * TRY


def test_tries_that_move_nothing_come_ever_rarer_and_one_that_moves_brings_them_back():
    """Each re-exploration costs (at batch 1 on a cpu: cold caches, a catch-up): the wait doubles
    after tries whose arm times as estimated, up to REEXPLORE_MAX, and drops back when a try finds
    its arm's time moved; the estimate then follows and the choice with it."""
    ctl = AdaptiveSpeculation(range(4))
    times = dict(CPU_LIKE)  # every draft kept: three drafts pay
    starts = []

    def run(steps):
        tries = []
        _counts(ctl, steps, times, [3], tries=tries)
        first = ctl.buckets[1].steps - steps + 1
        starts.extend(first + i for i, (t, prev) in enumerate(zip(tries, [False] + tries)) if t and not prev)

    run(4 * adaptive.REEXPLORE_MAX)
    b = ctl.buckets[1]
    assert b.choice == 3 and b.wait == adaptive.REEXPLORE_MAX
    assert np.diff(starts).tolist()[:6] == [64, 128, 256, 512, 1024, 1024]  # each judged at the next try
    times[2] = 0.8  # two drafts become much cheaper: 3 tokens in 0.8 s against 4 in 1.9 s
    for _ in range(8 * adaptive.REEXPLORE_MAX):
        run(1)
        if b.choice == 2:
            break
    assert b.choice == 2  # chosen right after its try: timed next to the choice's run
    tries = b.tries
    while b.tries == tries:  # the next try judges that one: it moved the choice
        run(1)
    assert b.wait == adaptive.REEXPLORE_EVERY and b.choice == 2


def test_buckets_are_independent_and_disabled_always_speculates():
    ctl = AdaptiveSpeculation(range(4))
    _feed(ctl, 30, {0: 1.0, 1: 1.5, 2: 1.8, 3: 2.0}, [0, 0, 1] * 21 + [0])
    assert ctl.draft_counts([100]).tolist() == [3]  # a fresh bucket explores speculation first
    ctl.reset()  # what warm-up does with its dummy steps
    assert ctl.summary() == {} and ctl.acceptance.tokens(3) == 1.0 and not ctl.sequences
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert ctl.planned(64) == 3 and ctl.planned(1) == 3 and not ctl.buckets  # no bucket: K, none created
    off = AdaptiveSpeculation(range(4), enabled=False)
    assert set(_feed(off, 10, {3: 9.0}, [0] * 64)) == {3}
    # disabled, it times nothing but keeps each sequence's acceptance (suffix drafting weighs it)
    assert off.summary() == {} and off.sequences
    ids = list(off.sequences)
    assert set(off.expected(ids, None, [3] * len(ids)).tolist()) == {1.0}  # every draft missed: 1 token a step
    with pytest.raises(ValueError, match="draft counts"):
        AdaptiveSpeculation(())


def test_restricted_arms_verify_counts_among_them():
    ctl = AdaptiveSpeculation((0, 3))
    _feed(ctl, 2 * TIMING, {0: 1.0, 3: 1.5}, [3, 2, 1])
    counts = _counts(ctl, 10, {0: 1.0, 3: 1.5}, [3, 2, 1])
    assert all(set(c) <= {0, 3} for c in counts) and counts[-1][0] == 3


def test_finished_sequences_are_forgotten_and_join_the_prior():
    ctl = AdaptiveSpeculation(range(4))
    _feed(ctl, 5, CPU_LIKE, [1, 2], ids=[7, 8])
    ctl.finish([7, 8, 9])  # 9 never drafted: ignored
    assert not ctl.sequences and len(ctl.prior().finished) == 2


# ---- losslessness under alternating steps ----------------------------------------------------------


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=3)
    path = make_self_predicting_checkpoint(tmp_path_factory.mktemp("adaptive"), cfg, seed=5, residual_scale=0.005)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in rng.integers(2, 30, 8)]
    baseline = [o.token_ids for o in _llm(path).generate(prompts, GREEDY)]
    return path, prompts, baseline


def _llm(path, plugin_params=None):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=512, progress=False,
               plugin_params=plugin_params)


PATTERNS = {
    "alternate": [True, False],
    "plain runs": [True] * 2 + [False] * 5,
    "beyond catch-up": [True] + [False] * (CATCH_UP + 3),  # asks for more plain steps than CATCH_UP
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("mode,k", [("eagle", 2), ("vanilla", 3), ("vanilla", 1)])
def test_alternating_steps_are_lossless(case, mode, k, pattern):
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode})
    plugin = llm.engine.plugin_manager.plugins[0]
    plugin.adaptive = ScriptedSpeculation(PATTERNS[pattern], k)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert alone == expected
    assert k in plugin.adaptive.log and 0 in plugin.adaptive.log
    stats = [o.spec_decode for o in outs if o.spec_decode is not None]
    drafted = sum(s.num_draft_tokens for s in stats)
    # Speculative steps after plain ones still find the MTP caches up to date: drafts keep being
    # accepted (a stale cache would make this model's drafts miss).
    assert sum(s.num_accepted_tokens for s in stats) > 0.2 * drafted
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and not plugin.states


FEWER_DRAFTS = {
    "fewer drafts": [3, 1, 2, 1, 3, 3, 2],
    "fewer drafts and plain": [1, 0, 3, 0, 0, 2, 1, 0],
}


@pytest.mark.parametrize("pattern", list(FEWER_DRAFTS))
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_steps_with_any_draft_count_are_lossless(case, mode, pattern):
    """Both modes may verify 1..K drafts per step (adaptive speculation's arms 0..K): eagle reuses
    its module, vanilla runs modules 0..k-1 and the skipped ones catch up when next used."""
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": mode})
    plugin = llm.engine.plugin_manager.plugins[0]
    assert plugin.adaptive.arms == [3, 2, 1, 0]
    plugin.adaptive = ScriptedSpeculation([], 3)
    plugin.adaptive.pattern = FEWER_DRAFTS[pattern]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts[:3]] == expected[:3]
    assert {1, 3} <= set(plugin.adaptive.log)
    stats = [o.spec_decode for o in outs if o.spec_decode is not None]
    drafted = np.sum([s.drafted_per_position for s in stats], axis=0)
    accepted = np.sum([s.accepted_per_position for s in stats], axis=0)
    assert drafted[0] > drafted[1] > drafted[2] > 0 and (accepted <= drafted).all()
    assert sum(s.num_draft_tokens for s in stats) == drafted.sum()
    assert accepted.sum() > 0.2 * drafted.sum()  # the modules' caches stay complete: drafts still hit


PER_SEQUENCE = {
    "mixed counts": [[3, 0, 1, 2], [0, 2, 3, 1], [1, 1, 0, 3], [2, 3, 2, 0]],
    "mixed and plain steps": [[0, 0, 2], 0, [3, 1, 0], 0, 0],
}
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=s, max_tokens=24,
                         ignore_eos=True) for s in range(8)]


@pytest.mark.parametrize("pattern", list(PER_SEQUENCE))
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_sequences_verifying_different_draft_counts_in_one_step_are_lossless(case, mode, pattern):
    """Adaptive speculation's per-sequence counts: one step drafts as far as its most drafts, each
    sequence verifies its own number of them (ragged verification rows), greedy and seeded
    sampling (penalties included) give the tokens of MTP off."""
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": mode})
    scripted = script_mtp_counts(llm, PER_SEQUENCE[pattern])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert any(len(set(c)) > 1 for c in scripted.counts)  # counts differed inside a step
    stats = [o.spec_decode for o in outs if o.spec_decode is not None]
    drafted = np.sum([s.drafted_per_position for s in stats], axis=0)
    accepted = np.sum([s.accepted_per_position for s in stats], axis=0)
    assert (accepted <= drafted).all() and accepted.sum() > 0.2 * drafted.sum()
    plain = [o.token_ids for o in _llm(path).generate(prompts, SEEDED)]
    script_mtp_counts(llm, PER_SEQUENCE[pattern])
    assert [o.token_ids for o in llm.generate(prompts, SEEDED)] == plain
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and not llm.engine.plugin_manager.plugins[0].states


@pytest.mark.parametrize("policy", [dict(decoding_policy="typical", posterior_threshold=0.09, posterior_alpha=0.3),
                                    dict(decoding_policy="relaxed", relaxed_topk=4, relaxed_delta=0.0,
                                         think_start_token_id=200, think_end_token_id=201)])
def test_other_policies_cap_acceptance_at_each_sequences_count(case, policy):
    """Typical and relaxed acceptance read each sequence's own verified rows and never keep more
    drafts than the sequence verified (relaxed with delta 0 is strict: MTP off's tokens)."""
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 3, **policy})
    scripted = script_mtp_counts(llm, PER_SEQUENCE["mixed counts"])
    kept = []
    plugin = llm.engine.plugin_manager.plugins[0]
    verify = plugin.plugin_verify

    def spy(batch, inputs, outputs):
        out = verify(batch, inputs, outputs)
        if out.num_drafts is not None:
            kept.append((list(out.num_drafts), list(out.num_draft_accepted)))
        return out

    plugin.plugin_verify = spy
    outs = llm.generate(prompts, GREEDY)
    assert kept and all(a <= c for counts, acc in kept for c, a in zip(counts, acc))
    assert any(len(set(c)) > 1 for c in scripted.counts)
    if policy["decoding_policy"] == "relaxed":
        assert [o.token_ids for o in outs] == expected


def test_adaptive_default_on_is_lossless(case):
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.plugin_manager.plugins[0].adaptive.enabled
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def _mtp_cache_rows(llm, prompt, pattern, margin, module=0, planned=None):
    """Run one request under a speculation pattern; an MTP module's cache rows of every position
    but the last ``margin`` (entries written from verified tokens only)."""
    engine = llm.engine
    plugin = engine.plugin_manager.plugins[0]
    plugin.adaptive = ScriptedSpeculation(pattern, plugin.k, planned)
    for cache in engine.model_wrapper.caches:  # nothing left over from an earlier run
        cache.latent.zero_()
    state = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2 * CATCH_UP + 16, ignore_eos=True))
    table = []
    while not state.seq.is_finished:
        table = list(state.seq.block_table) or table  # freed when it finishes; the data stays
        engine.step()
    positions = np.arange(len(state.seq.token_ids) - margin)
    bs = engine.block_manager.block_size
    slots = np.asarray(table)[positions // bs] * bs + positions % bs
    cache = engine.model_wrapper.caches[engine.model_wrapper.config.num_hidden_layers + module]
    return cache.latent.view(-1, cache.latent.shape[-1])[slots].clone()


@pytest.mark.parametrize("mode,k", [("vanilla", 1), ("vanilla", 3), ("eagle", 2)])
def test_speculative_steps_catch_up_the_entries_plain_steps_skipped(case, mode, k):
    """The MTP cache entries written from verified tokens do not depend on which steps speculated:
    a speculative step after plain ones (or after steps with fewer drafts) writes every entry the
    module missed. Module 0 is never left more than CATCH_UP entries behind."""
    path, prompts, _ = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode})
    margin = CATCH_UP + k + 2  # the newest entries may still hold draft-conditioned values
    modules = range(k) if mode == "vanilla" else [0]
    always = [_mtp_cache_rows(llm, prompts[0], [True], margin, m) for m in modules]
    assert all(rows.abs().sum() > 0 for rows in always)
    patterns = [PATTERNS["plain runs"]]
    if k > 1:
        patterns += [[1, 2, 1, 0, k]]  # fewer drafts than K; every module used now and then
    for pattern in patterns:  # no entry is lost
        for m in modules:
            mixed = _mtp_cache_rows(llm, prompts[0], pattern, margin, m)
            torch.testing.assert_close(mixed, always[m], atol=1e-5, rtol=1e-5)
    # plain runs longer than CATCH_UP are cut short for module 0: it misses nothing
    mixed = _mtp_cache_rows(llm, prompts[0], PATTERNS["beyond catch-up"], margin)
    torch.testing.assert_close(mixed, always[0], atol=1e-5, rtol=1e-5)


def _decode_steps(plugin) -> list[tuple[int, int]]:
    """From now on, per decode step of ``plugin``: the drafts it made and its draft rows per
    sequence (0 for a plain step)."""
    steps = []
    original = plugin.model_inputs_update

    def spy(batch, inputs):
        out = original(batch, inputs)
        if not batch.is_prefill:
            k = out.extra["mtp_k"]
            steps.append((k, int(out.extra["mtp_layout"].sub_q_lens.max()) if k else 0))
        return out

    plugin.model_inputs_update = spy
    return steps


def test_a_plain_bucket_keeps_only_the_entries_a_steady_step_writes(case):
    """Where the controller chose plain steps for the batch size, no step drafts just to keep the
    MTP caches current, and every module keeps only the K + 1 missed entries a steady step writes
    (the older ones are given up): the step that drafts again has a steady step's draft rows (a
    shape compiled at start-up; a catch-up's runs eagerly), and the tokens stay those of MTP off."""
    path, prompts, expected = case
    k, plain = 2, CATCH_UP + 10
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": "vanilla"})
    margin = k + 2
    pattern = [True] + [False] * plain + [True] * 40
    always = _mtp_cache_rows(llm, prompts[0], [True], margin)
    plugin = llm.engine.plugin_manager.plugins[0]
    steps = _decode_steps(plugin)
    mixed = _mtp_cache_rows(llm, prompts[0], pattern, margin, planned=0)
    drafted, rows = [d for d, _ in steps], [r for d, r in steps if d]
    assert drafted[0] == k and drafted[1 : 1 + plain] == [0] * plain  # no step drafted to catch up
    assert max(rows) <= STEADY_DRAFT_ROWS  # the first drafting step after the plain run too
    missed = ~torch.isclose(mixed, always, atol=1e-5, rtol=1e-5).all(dim=-1)
    assert int(missed.sum()) >= plain - k and (mixed[missed] == 0).all()  # all but the newest K + 1 given up
    last_missed = int(missed.nonzero().max())
    torch.testing.assert_close(mixed[last_missed + 1 :], always[last_missed + 1 :], atol=1e-5, rtol=1e-5)
    plugin.adaptive = ScriptedSpeculation(pattern, k, planned=0)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_vanilla_later_modules_give_up_entries_beyond_catch_up(case):
    """One-draft steps keep only module 0 current. Catching the later modules up would cost a
    decoder layer per module and token, so after CATCH_UP missed entries they give up the oldest:
    those stay unwritten, the newest CATCH_UP are written when the module is next used, and the
    tokens stay those of MTP off."""
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "vanilla"})
    margin = 2 + 2  # the newest entries may still hold draft-conditioned values
    pattern = [2] + [1] * (CATCH_UP + 10) + [2] * 40  # module 1 misses > CATCH_UP, then is used again
    always = _mtp_cache_rows(llm, prompts[0], [True], margin, module=1)
    mixed = _mtp_cache_rows(llm, prompts[0], pattern, margin, module=1)
    missed = ~torch.isclose(mixed, always, atol=1e-5, rtol=1e-5).all(dim=-1)
    assert missed.any() and (mixed[missed] == 0).all()  # given up: never written since the zeroing
    last_missed = int(missed.nonzero().max())
    torch.testing.assert_close(mixed[last_missed + 1 :], always[last_missed + 1 :], atol=1e-5, rtol=1e-5)
    assert len(always) - (last_missed + 1) >= CATCH_UP  # the newest entries were caught up
    torch.testing.assert_close(_mtp_cache_rows(llm, prompts[0], pattern, margin, module=0),
                               _mtp_cache_rows(llm, prompts[0], [True], margin, module=0), atol=1e-5, rtol=1e-5)
    plugin = llm.engine.plugin_manager.plugins[0]
    plugin.adaptive = ScriptedSpeculation(pattern, 2)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_modules_the_chosen_count_does_not_use_keep_only_a_steady_steps_entries(case):
    """Where the controller chose one draft for the batch size, module 1 keeps only the K + 1
    missed entries a steady step writes: a step of two drafts (a try) after a run of one-draft
    steps has a steady step's draft rows instead of a catch-up's, and the tokens stay MTP off's."""
    path, prompts, expected = case
    k, run = 2, CATCH_UP + 10
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": "vanilla"})
    pattern = [2] + [1] * run + [2] * 40
    always = _mtp_cache_rows(llm, prompts[0], [True], k + 2, module=1)
    plugin = llm.engine.plugin_manager.plugins[0]
    steps = _decode_steps(plugin)
    mixed = _mtp_cache_rows(llm, prompts[0], pattern, k + 2, module=1, planned=1)
    rows = [r for d, r in steps if d == 2]  # the steps of two drafts
    assert rows and max(rows) <= STEADY_DRAFT_ROWS
    missed = ~torch.isclose(mixed, always, atol=1e-5, rtol=1e-5).all(dim=-1)
    assert int(missed.sum()) >= run - 2 * k and (mixed[missed] == 0).all()
    plugin.adaptive = ScriptedSpeculation(pattern, k, planned=1)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_vanilla_prefill_runs_the_modules_the_coming_steps_use(case):
    """Where the controller runs one-draft steps at the coming batch size, a vanilla prefill writes
    only module 0's cache: the later modules, which that count does not use, start behind by the
    prompt, keep only its newest K + 1 entries to catch up (a steady step's), write them when next
    used, and the tokens stay those of MTP off."""
    path, prompts, expected = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla"})
    prompt = list(range(2, 2 + CATCH_UP + 8))  # longer than CATCH_UP: its oldest entries are given up
    margin = 3 + 2
    for module in (0, 1, 2):
        full = _mtp_cache_rows(llm, prompt, [True], margin, module)
        lean = _mtp_cache_rows(llm, prompt, [True], margin, module, planned=1)
        missed = ~torch.isclose(lean, full, atol=1e-5, rtol=1e-5).all(dim=-1)
        if module == 0:
            assert not missed.any()
        else:  # the oldest prompt entries were never written; the newest K + 1 were caught up
            m = int(missed.sum())  # (and the K - 1 before them, which vanilla's window rewrites)
            assert len(prompt) - 2 * 3 <= m <= len(prompt) - (3 + 1)
            assert missed[:m].all() and (lean[:m] == 0).all()
    plugin = llm.engine.plugin_manager.plugins[0]
    assert plugin.adaptive.plan_asked[0] == 1  # the prefill asked first, with the batch size the prompt joins
    plugin.adaptive = ScriptedSpeculation([1, 1, 3], 3, planned=1)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert plugin.adaptive.plan_asked[0] == len(prompts)  # one prefill of every prompt


def test_catch_up_steps_are_not_measured(case):
    """The first speculative step after plain ones writes the skipped MTP entries: it is no sample
    of steady speculation, so its arm's timing never sees it."""
    path, prompts, _ = case
    llm = _llm(path, {"plugin_type": "mtp", "num_speculative_tokens": 1, "mtp_mode": "vanilla"})
    plugin = llm.engine.plugin_manager.plugins[0]
    plugin.adaptive = ScriptedSpeculation([True, True, False, False, False], 1)
    llm.generate(prompts[:1], GREEDY)
    log = plugin.adaptive.log
    # after two plain steps (3 entries behind, > K + 1 = 2) the next speculative step is a catch-up
    unmeasured = sum(1 for i in range(1, len(log)) if log[i] and log[i - 2:i] == [0, 0])
    assert unmeasured > 0
    # nor is the last step: its time is known when the next step starts (step_clock.py), and none does
    last = [log[-1]]
    assert plugin.adaptive.recorded.count(1) == log.count(1) - unmeasured - last.count(1)
    assert plugin.adaptive.recorded.count(0) == log.count(0) - last.count(0)


def test_an_easy_sequence_after_hard_ones_goes_back_to_every_draft():
    """After requests whose drafts mostly miss, the prior is low at every position; a sequence
    whose drafts are all kept must not stay at one draft because it never reaches the later
    positions (they inherit the prior scaled by its first position's rate)."""
    ctl = AdaptiveSpeculation(range(4))
    _feed(ctl, 4 * TIMING, CPU_LIKE, [3], ids=[0])
    ctl.finish([0])
    rng = np.random.default_rng(0)
    for seq_id in range(1, 9):  # hard text, verified at every position: each draft kept with probability 0.3
        for _ in range(40):
            ctl.record([seq_id], [3], [int(np.argmin(rng.random(4) < 0.3))])
        ctl.finish([seq_id])
    assert (ctl.prior().alpha(np.ones(3)) < 0.45).all()
    easy = [c[0] for c in _counts(ctl, 30, CPU_LIKE, [3], ids=[99])]
    assert easy[-10:] == [3] * 10, easy


def test_an_arm_timed_lately_needs_no_reexploration_burst():
    ctl = AdaptiveSpeculation(range(4))
    _feed(ctl, 4 * TIMING, CPU_LIKE, [3])
    b = ctl.buckets[1]
    b.steps = b.next_try - 1  # the next step opens a burst for an arm not chosen
    arm = [k for k in ctl.arms if k != b.choice][b.tries % 3]
    b.timed_at[arm] = b.steps - 5  # ... which a sequence's own count timed 5 steps ago
    assert ctl.draft_counts([0]).tolist() == [b.choice]
    b.steps = b.next_try - 1
    arm = [k for k in ctl.arms if k != b.choice][b.tries % 3]
    b.timed_at[arm] = b.steps - adaptive.REEXPLORE_EVERY
    assert ctl.draft_counts([0]).tolist() == [arm]


def test_greedy_and_sampled_requests_start_from_their_own_prior():
    """Sampled requests accept far fewer drafts than greedy ones; alternating, neither starts
    from the other's rates: a sampled request after greedy ones starts without drafts, a greedy
    one after sampled ones with every draft."""
    ctl = AdaptiveSpeculation(range(4))
    _feed(ctl, 4 * TIMING, CPU_LIKE, [3], ids=[0])
    ctl.finish([0])
    rng = np.random.default_rng(1)
    for seq_id in range(1, 13):
        kind = "sampled" if seq_id % 2 else "greedy"
        for _ in range(30):
            counts = ctl.draft_counts([seq_id], [kind])
            kept = 3 if kind == "greedy" else int(np.argmin(rng.random(4) < 0.1))
            _step(ctl, [seq_id], counts, [min(kept, int(counts[0]))], CPU_LIKE[int(counts.max())])
        ctl.finish([seq_id])
    assert ctl.draft_counts([100], ["sampled"]).tolist() == [0]
    assert ctl.draft_counts([101], ["greedy"]).tolist() == [3]
    assert set(ctl.priors) == {None, "greedy", "sampled"}


def test_a_sequence_first_seen_while_arms_are_timed_keeps_its_kind():
    ctl = AdaptiveSpeculation(range(4))
    assert ctl.draft_counts([7], ["sampled"]).tolist() == [3]  # a fresh bucket: timing every arm
    _step(ctl, [7], [3], [0], 0.01)
    assert ctl.sequences[7].kind == "sampled"
    ctl.finish([7])
    assert set(ctl.priors) == {"sampled"}  # its acceptance joins the sampled requests' prior
