"""A decode step's cost for the speculation controllers: the interval between the ends of two
decode steps, the engine's work after the forward included."""
import time

from mindspec import LLM, SamplingParams
from mindspec.plugins.mtp.step_clock import StepClock
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config
from tests.support.draft_counts import ScriptedSpeculation


def test_a_step_is_timed_from_its_start_to_the_next_decode_steps_start():
    now = iter([0.0, 1.0, 1.5, 2.5, 3.0, 3.25, 4.0]).__next__
    clock = StepClock(now)
    times = []
    # prefill, decode, decode, mixed, decode, decode, decode: each step but the last reports
    for decode in [False, True, True, False, True, True, True]:
        clock.started(decode)
        clock.ended(times.append)
    assert times == [None, 0.5, None, None, 0.25, 0.75]


def test_the_engine_work_after_the_forward_is_part_of_a_step(tmp_path, monkeypatch):
    """Outputs built after the plugin's verification (here made 30 ms slower per step) are part
    of what each timed step reports (a window around the forward leaves them out), and the step
    whose time is reported is the one they belong to: a plain step's outputs are timed as plain."""
    from mindspec.engine import llm_engine

    path = make_self_predicting_checkpoint(tmp_path, tiny_v3_config(num_nextn_predict_layers=1))
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 1, "mtp_mode": "vanilla"})
    plugin = llm.engine.plugin_manager.plugins[0]
    plugin.adaptive = scripted = ScriptedSpeculation([True, True, False, False, False], 1)
    finish = llm_engine.LLMEngine.finish_step

    def slow_finish(self, batch, outputs):
        if not batch.is_prefill and scripted.log[-1] == 0:  # the outputs of a plain step
            time.sleep(0.03)
        return finish(self, batch, outputs)

    monkeypatch.setattr(llm_engine.LLMEngine, "finish_step", slow_finish)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    plain = [s for k, s in scripted.seconds if k == 0]
    drafting = [s for k, s in scripted.seconds if k == 1]
    assert len(plain) >= 4 and len(drafting) >= 2
    assert min(plain) >= 0.03 and max(drafting) < 0.03
