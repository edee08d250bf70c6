"""Async scheduling (ScheduleConfig.asyncScheduling) equals synchronous scheduling token for
token: MTP off, vanilla and eagle with K = 1..3, suffix drafts (alone and with MTP), 16 prompts
arriving at different steps, with stops and max_tokens that end sequences while their next step
is already running."""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.config.mindie_config import ConfigError, parse_config
from mindspec.distributed.launch import build_engine
from mindspec.distributed.parallel_config import ParallelConfig
from mindspec.engine.args import EngineArgs
from mindspec.engine.scheduler import SchedulerConfig
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
from tests.support.draft_counts import record_draft_counts, record_mtp_steps
from tests.support.in_step_acceptance import record_acceptance, record_plain_sampling

NUM_PROMPTS = 16


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=3)
    path = make_self_predicting_checkpoint(tmp_path_factory.mktemp("async"), cfg, seed=11, residual_scale=0.005)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 30, NUM_PROMPTS)]
    arrivals = sorted(rng.integers(0, 24, NUM_PROMPTS).tolist())
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(1, 24, NUM_PROMPTS)]
    # A stop token that occurs in some outputs: sequences end on it mid-step.
    free = _llm(path, None, False).generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stop = max(set(t for o in free for t in o.token_ids[2:]), key=lambda t: sum(t in o.token_ids for o in free))
    for i in range(0, NUM_PROMPTS, 3):
        params[i] = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    return path, prompts, arrivals, params


def _llm(path, plugin_params, async_scheduling, num_blocks=512, **kw):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=num_blocks, progress=False,
               plugin_params=plugin_params, async_scheduling=async_scheduling, **kw)


def _mtp(mode, k):
    return {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode}


def _serve(llm, prompts, arrivals, params):
    """Requests join at their arrival step; every finished output, in prompt order."""
    engine, done, step = llm.engine, {}, 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(prompts[i], params[i], request_id=str(i))
        for out in engine.step():
            assert out.request_id not in done, "a request produced output after it finished"
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 2000, "no progress"
    return [done[str(i)] for i in range(len(prompts))]


def _settled(llm):
    """Nothing in flight, queued plugin-cache clears done; then no block or MTP state is left."""
    assert llm.engine.async_stepper.drain() == []
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    for plugin in llm.engine.plugin_manager.plugins:
        assert not getattr(plugin, "states", {})


@pytest.fixture(scope="module")
def expected(case):
    path, prompts, arrivals, params = case
    return [o.token_ids for o in _serve(_llm(path, None, False), prompts, arrivals, params)]


@pytest.mark.parametrize("plugin", [None] + [_mtp(m, k) for m in ("eagle", "vanilla") for k in (1, 2, 3)],
                         ids=["off"] + [f"{m}-k{k}" for m in ("eagle", "vanilla") for k in (1, 2, 3)])
def test_async_equals_sync_greedy(case, expected, plugin):
    path, prompts, arrivals, params = case
    llm = _llm(path, plugin, True)
    outs = _serve(llm, prompts, arrivals, params)
    assert [o.token_ids for o in outs] == expected
    for o, p in zip(outs, params):
        assert len(o.token_ids) <= p.max_tokens
    stats = llm.engine.async_stepper.stats
    assert stats.ahead_steps > stats.steps // 2, stats  # most steps were built while one ran
    if plugin is not None:
        assert stats.dropped_sequences > 0, stats  # sequences ended with their next step running
        assert sum(o.spec_decode.num_accepted_tokens for o in outs if o.spec_decode) > 0
    _settled(llm)


SUFFIX = {
    "suffix-k4": {"plugin_type": "suffix", "num_speculative_tokens": 4, "min_match": 1},
    "mtp-suffix-vanilla-k2": {"plugin_type": "mtp,suffix", "num_speculative_tokens": 2, "mtp_mode": "vanilla",
                              "suffix_min_match": 1, "suffix_max_drafts": 5},
    "mtp-suffix-eagle-k3": {"plugin_type": "mtp,suffix", "num_speculative_tokens": 3, "mtp_mode": "eagle",
                            "suffix_min_match": 1},
}


@pytest.mark.parametrize("name", list(SUFFIX))
def test_async_with_suffix_drafts_equals_sync(case, expected, name, monkeypatch):
    """Suffix drafts follow the tokens of the step still running: they are made when it is
    done, right before the next step runs, from the views then holding the real tokens."""
    path, prompts, arrivals, params = case
    mtp_steps, suffix_counts = record_mtp_steps(monkeypatch), record_draft_counts(monkeypatch)
    llm = _llm(path, SUFFIX[name], True)
    outs = _serve(llm, prompts, arrivals, params)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.async_stepper.stats.ahead_steps > llm.engine.async_stepper.stats.steps // 2
    if name.startswith("suffix"):
        assert any(len(set(c)) > 1 for c in suffix_counts)
    else:
        assert any(host and len(host) < len(counts) for counts, host in mtp_steps)
    _settled(llm)


def test_async_with_preemption_waits_and_stays_lossless(case, expected):
    path, prompts, arrivals, params = case
    llm = _llm(path, _mtp("eagle", 3), True, num_blocks=48)
    outs = _serve(llm, prompts, arrivals, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_preemptions for o in outs) > 0
    assert llm.engine.async_stepper.stats.waits > 1
    _settled(llm)


def test_seeded_sampling_with_penalties_equals_sync(case):
    """Random rows are seeded by output position and penalties read the output so far: both
    must see the real tokens of the step that was running when the next one was built."""
    path, prompts, arrivals, _ = case
    params = [SamplingParams(temperature=0.9, top_k=20, seed=i, repetition_penalty=1.3, frequency_penalty=0.2,
                             max_tokens=12, ignore_eos=True) for i in range(NUM_PROMPTS)]
    for plugin in (_mtp("eagle", 2), SUFFIX["mtp-suffix-vanilla-k2"]):
        sync = _serve(_llm(path, plugin, False), prompts, arrivals, params)
        asynced = _serve(_llm(path, plugin, True), prompts, arrivals, params)
        assert [o.token_ids for o in asynced] == [o.token_ids for o in sync]
        assert [o.logprobs for o in asynced] == [o.logprobs for o in sync]


def test_seeded_sampling_accepted_inside_the_step_equals_sync(case, monkeypatch):
    """Steps built ahead take their target rows' output positions and keys when they are
    filled in, after the running step's tokens are known."""
    path, prompts, arrivals, _ = case
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=30, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(NUM_PROMPTS)]
    seen = record_acceptance(monkeypatch)
    sync = _serve(_llm(path, _mtp("vanilla", 2), False), prompts, arrivals, params)
    llm = _llm(path, _mtp("vanilla", 2), True)
    asynced = _serve(llm, prompts, arrivals, params)
    assert [o.token_ids for o in asynced] == [o.token_ids for o in sync]
    assert seen["sampled"] > 0 and seen["host"] == 0
    assert llm.engine.async_stepper.stats.ahead_steps > 0
    _settled(llm)


def test_seeded_sampling_inside_plain_steps_equals_sync(case, monkeypatch):
    """MTP off: a step built ahead takes its rows' positions and keys when it is filled in."""
    path, prompts, arrivals, _ = case
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(NUM_PROMPTS)]
    seen = record_plain_sampling(monkeypatch)
    sync = _serve(_llm(path, None, False), prompts, arrivals, params)
    asynced = _serve(_llm(path, None, True), prompts, arrivals, params)
    assert [o.token_ids for o in asynced] == [o.token_ids for o in sync]
    assert seen["in_step"] > 0 and seen["host"] == 0


def test_abort_while_the_next_step_runs(case, expected):
    path, prompts, _, params = case
    llm = _llm(path, _mtp("vanilla", 2), True)
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        engine.add_request(prompts[i], long, request_id=str(i))
    for _ in range(3):
        engine.step()
    assert any(s.seq_id == 1 for s in engine.async_stepper.next.batch.seqs)  # built ahead, with it
    aborted = engine.abort("1")
    assert aborted is not None and aborted.finished
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != "1"
            if out.finished:
                done[out.request_id] = out.token_ids
    want = _llm(path, None, False).generate([prompts[i] for i in (0, 2, 3)], long)
    assert [done[r] for r in ("0", "2", "3")] == [o.token_ids for o in want]
    _settled(llm)


@pytest.mark.parametrize("plugin", [None, _mtp("vanilla", 2)], ids=["off", "vanilla-k2"])
def test_host_work_starts_once_the_device_step_is_launched(case, expected, plugin, monkeypatch):
    """Both threads' Python holds the GIL: the host thread waits for the launch signal, so it never
    runs beside the calling thread's input building for the step it overlaps."""
    from mindspec.engine import async_scheduling

    path, prompts, arrivals, params = case
    llm = _llm(path, plugin, True)
    events = []  # appended by both threads, in the order things happened
    signal = llm.engine.model_wrapper.launch
    arm = signal.arm  # each step's armed callback records when it ran
    monkeypatch.setattr(signal, "arm", lambda callback: arm(lambda: (events.append("launch"), callback())[1]))
    for name in ("_finish", "_ahead"):
        real = getattr(async_scheduling.AsyncStepper, name)
        monkeypatch.setattr(async_scheduling.AsyncStepper, name,
                            lambda self, *a, _real=real, _name=name: (events.append(_name), _real(self, *a))[1])
    real_run = async_scheduling.AsyncStepper._run
    monkeypatch.setattr(async_scheduling.AsyncStepper, "_run", lambda self, *a: (events.append("run"), real_run(self, *a))[1])
    outs = _serve(llm, prompts, arrivals, params)
    assert [o.token_ids for o in outs] == expected
    overlapped = 0
    for step in " ".join(events).split("run")[1:]:  # what happened from one device step's start to the next
        names = step.split()
        if "launch" in names:
            host = [n for n in names if n in ("_finish", "_ahead")]
            assert names.index("launch") < names.index(host[0]) if host else True, names
            overlapped += bool(host)
    assert overlapped > len(outs)  # most steps had host work beside them
    _settled(llm)


def test_config_key_and_dp_conflict(tmp_path):
    def cfg(schedule):
        return {"BackendConfig": {"ScheduleConfig": schedule, "ModelDeployConfig": {"ModelConfig": [
            {"modelWeightPath": str(tmp_path)}]}}}

    assert parse_config(cfg({"asyncScheduling": True}), base_dir=tmp_path).backend.schedule.async_scheduling
    assert not parse_config(cfg({}), base_dir=tmp_path).backend.schedule.async_scheduling
    with pytest.raises(ConfigError, match=r"ScheduleConfig\.asyncScheduling: must be true or false"):
        parse_config(cfg({"asyncScheduling": "yes"}), base_dir=tmp_path)
    args = EngineArgs(model=str(tmp_path), scheduler=SchedulerConfig(async_scheduling=True))
    with pytest.raises(ConfigError, match="asyncScheduling: not available with dp > 1"):
        build_engine(args, ParallelConfig(world_size=2, dp=2))
