"""The launch signal: armed once, fired once, when a step's work leaves the interpreter (an eager
forward as it begins, a captured graph once its replay is queued; compiled packages:
tests/modeling/test_exported_step.py)."""
import torch

from mindspec.modeling.forward_metadata import build_model_inputs, to_device
from mindspec.modeling.graph_runner import DecodeGraphRunner, _Entry
from mindspec.modeling.launch_signal import LaunchSignal
from mindspec.modeling.model_wrapper import ModelWrapper
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config


def test_armed_callback_runs_once():
    signal, calls = LaunchSignal(), []
    signal.fire()  # nothing armed: nothing happens
    signal.arm(lambda: calls.append("first"))
    signal.arm(lambda: calls.append("second"))  # replaces the first
    signal.fire()
    signal.fire()
    assert calls == ["second"]


def _wrapper(tmp_path):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=1)
    path = make_self_predicting_checkpoint(tmp_path, cfg, seed=4, residual_scale=0.01)
    wrapper = ModelWrapper(path, backend="cpu", dtype="float32", num_mtp_modules=1, progress=False)
    wrapper.allocate_cache(16, 4)
    return wrapper


def test_an_eager_forward_fires_as_it_begins(tmp_path):
    wrapper = _wrapper(tmp_path)
    order = []
    forward = wrapper.model.forward
    wrapper.model.forward = lambda *a: (order.append("model"), forward(*a))[1]
    host = build_model_inputs([[5, 6, 7]], [0], [[0]], 4)
    wrapper.launch.arm(lambda: order.append("launch"))
    with torch.inference_mode():
        wrapper.forward(to_device(host, "cpu"))
        wrapper.forward(to_device(host, "cpu"))
    assert order == ["launch", "model", "model"]


def test_a_captured_graph_fires_once_its_replay_is_queued(tmp_path):
    """A captured graph's replay runs no Python forward: the runner fires after queueing it."""
    wrapper = _wrapper(tmp_path)
    runner = DecodeGraphRunner(wrapper, capture=False)
    order = []

    class Graph:
        outputs = "outputs"

        def replay(self):
            order.append("replay")

    wrapper.launch.arm(lambda: order.append("launch"))
    assert runner._replay(_Entry(statics=None, step=Graph())) == "outputs"
    assert order == ["replay", "launch"]
