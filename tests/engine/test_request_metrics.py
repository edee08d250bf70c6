"""RequestOutput.metrics: when a request was queued, scheduled, got its first and last token and
finished, recorded at the engine step that did each (sync and async scheduling, aborts, PD
adoption), and the latencies derived from them."""
import time

import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.engine.outputs import RequestMetrics
from mindspec.engine.sequence import Sequence, SequenceStatus
from mindspec.service.pd_wire import output_from_line, output_to_line
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

MTP = {"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "vanilla", "adaptive_speculation": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=2)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("metrics"), cfg, seed=5, residual_scale=0.005)


def _llm(path, **kw):
    return LLM(model=str(path), dtype="float32", cache_block_size=4, num_blocks=128, progress=False, **kw)


def test_latencies_from_the_milestones():
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=13.0, last_token_time=19.0,
                       finished_time=19.0)
    assert m.time_in_queue == 0.5 and m.time_to_first_token == 3.0
    assert m.time_per_output_token(4) == 2.0  # three tokens after the first in 6 s
    assert m.time_per_output_token(1) is None
    assert RequestMetrics(arrival_time=1.0).time_to_first_token is None


def test_first_admission_time_survives_a_preemption():
    seq = Sequence(seq_id=0, prompt_token_ids=[1, 2], max_tokens=4)
    seq.start_running()
    first = seq.first_scheduled_time
    seq.status = SequenceStatus.WAITING  # preempted
    time.sleep(0.002)
    seq.start_running()
    assert seq.status is SequenceStatus.RUNNING and seq.first_scheduled_time == first


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("plugin_params", [None, MTP], ids=["mtp-off", "vanilla"])
def test_each_milestone_is_stamped_by_the_step_that_reached_it(checkpoint, plugin_params, async_scheduling):
    """Step by step: the first token's time lies inside the step whose output first carried a
    token, the last token's inside the step that finished the request, and nothing moves after."""
    engine = _llm(checkpoint, plugin_params=plugin_params, async_scheduling=async_scheduling).engine
    before_add = time.monotonic()
    engine.add_request([5, 9, 14, 3, 7], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), request_id="a")
    first_window = last_window = None
    outputs = []
    while not outputs or not outputs[-1].finished:
        start = time.monotonic()
        step_outputs = engine.step()
        end = time.monotonic()
        for out in step_outputs:
            outputs.append(out)
            if out.new_token_ids and first_window is None:
                first_window = (start, end)
            if out.finished:
                last_window = (start, end)
    final = outputs[-1].metrics
    assert final.arrival_time >= before_add and final.arrival_time <= final.first_scheduled_time
    assert first_window[0] <= final.first_token_time <= first_window[1]
    assert last_window[0] <= final.last_token_time <= last_window[1] and final.finished_time == final.last_token_time
    assert final.first_scheduled_time <= final.first_token_time
    assert all(o.metrics.first_token_time == final.first_token_time for o in outputs if o.token_ids)
    assert all(o.metrics.finished_time is None for o in outputs[:-1])
    assert len(outputs[-1].token_ids) == 9


def test_an_aborted_request_is_finished_when_aborted(checkpoint):
    engine = _llm(checkpoint).engine
    engine.add_request([5, 9, 14], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), request_id="x")
    engine.step()
    before = time.monotonic()
    out = engine.abort("x")
    assert out.metrics.first_token_time < before <= out.metrics.finished_time <= time.monotonic()


def test_metrics_travel_with_an_output_between_nodes(checkpoint):
    out = _llm(checkpoint).generate([[4, 8, 15]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    back = output_from_line(output_to_line(out))
    assert back.metrics == out.metrics and isinstance(back.metrics, RequestMetrics)


def test_generate_gives_every_request_its_own_times(checkpoint):
    """Two requests at once: scheduled together, each with its own last token (different lengths)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 60, 6).tolist(), rng.integers(2, 60, 9).tolist()]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 12)]
    short, long = _llm(checkpoint, plugin_params=MTP).generate(prompts, params)
    assert short.metrics.arrival_time <= long.metrics.arrival_time
    assert short.metrics.finished_time < long.metrics.finished_time
    assert long.metrics.time_per_output_token(len(long.token_ids)) > 0
