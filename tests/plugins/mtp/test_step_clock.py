"""A decode step's cost for the speculation controllers: the interval between the ends of two
decode steps, the engine's work after the forward included."""
import time

from mindspec import LLM, SamplingParams
from mindspec.plugins.mtp.step_clock import StepClock
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
from tests.support.draft_counts import ScriptedSpeculation


def test_only_intervals_between_two_decode_steps_count():
    now = iter([0.0, 1.0, 1.5, 2.5, 3.0, 3.25, 4.0]).__next__
    clock = StepClock(now)
    kinds = [False, True, True, False, True, True, True]  # prefill, decode, decode, mixed, decode x3
    assert [clock.lap(decode=k) for k in kinds] == [None, None, 0.5, None, None, 0.25, 0.75]


def test_the_engine_work_after_the_forward_is_part_of_a_step(tmp_path, monkeypatch):
    """Outputs built after the plugin's verification (here made 30 ms slower per step) are part
    of what each timed step reports; the plugin's own window around the forward left them out."""
    from mindspec.engine import llm_engine

    path = make_self_predicting_checkpoint(tmp_path, tiny_v3_config(num_nextn_predict_layers=1))
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 1, "mtp_mode": "vanilla"})
    plugin = llm.engine.plugin_manager.plugins[0]
    plugin.adaptive = ScriptedSpeculation([True, False], 1)
    seconds = []
    record = plugin.adaptive.record
    plugin.adaptive.record = lambda *a, **kw: (seconds.append(a[3]), record(*a, **kw))
    finish = llm_engine.LLMEngine.finish_step

    def slow_finish(self, batch, outputs):
        time.sleep(0.03)
        return finish(self, batch, outputs)

    monkeypatch.setattr(llm_engine.LLMEngine, "finish_step", slow_finish)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    timed = [s for s in seconds if s is not None]
    assert len(timed) >= 4 and min(timed) >= 0.03
