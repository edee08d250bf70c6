"""When a shape compiles on the calling thread (eager_runs.py): a prefill bucket, or a decode shape
first met after the warm-up, once its eager runs have cost what a compile is expected to take; at
once from the cache, with MINDSPEC_COMPILE_PREFILL=1, or in the warm-up; never for an offline run
whose prompts meet each bucket a few times. Packages are not compiled here: ``_package`` is
replaced by a recorder (the shapes run eagerly)."""
import numpy as np
import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.modeling import exported_step
from mindspec.modeling.forward_metadata import build_model_inputs
from mindspec.modeling.model_wrapper import ModelWrapper
from mindspec.plugins.mtp import decode_inputs as di
from mindspec.modeling.eager_runs import DEFAULT_COMPILE_S, EagerRuns
from mindspec.modeling.prefill_padding import PREFILL_ENV
from mindspec.modeling.step_recipes import DECODE, PREFILL, PREFILL_MTP, SPECULATIVE
from tests.support.checkpoints import make_self_predicting_checkpoint, tiny_v3_config

K = 2
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(initializer_range=0.2, num_nextn_predict_layers=K)
    return make_self_predicting_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, seed=5, residual_scale=0.01)


@pytest.fixture
def packaged(monkeypatch, tmp_path) -> list:
    """The shape keys ExportedSteps asks a package for, from now on (each then runs eagerly)."""
    monkeypatch.setenv(exported_step.CACHE_ENV, str(tmp_path / "cache"))  # an empty package cache
    monkeypatch.delenv(PREFILL_ENV, raising=False)  # the default policy (tests otherwise keep prefills eager)
    keys = []

    def record(self, key, args, caches, tensors, dims):
        keys.append(key)
        return None

    monkeypatch.setattr(exported_step.ExportedSteps, "_package", record)
    return keys


def _prefill(lengths):
    rng = np.random.default_rng(sum(lengths))
    tokens = [rng.integers(2, 60, n).tolist() for n in lengths]
    tables, at = [], 0
    for n in lengths:
        blocks = -(-(n + 1) // BLOCK_SIZE)
        tables.append(list(range(at, at + blocks)))
        at += blocks
    return build_model_inputs(tokens, [0] * len(lengths), tables, BLOCK_SIZE)


def _wrapper(checkpoint) -> ModelWrapper:
    w = ModelWrapper(checkpoint, backend="cpu", dtype="float32", num_mtp_modules=K, progress=False, decode_graphs=True)
    w.allocate_cache(64, BLOCK_SIZE)
    return w


def test_a_shape_is_due_once_its_eager_seconds_reach_the_compile_time():
    eager = EagerRuns()
    assert not eager.due("a", compile_s=1.0)
    eager.ran_eagerly(0.6)
    assert not eager.due("a", compile_s=1.0)
    eager.ran_eagerly(0.5)
    eager.ran_eagerly(7.0)  # no shape turned down since: nothing to add to
    assert eager.seconds == {"a": pytest.approx(1.1)}
    assert eager.due("a", compile_s=1.0) and not eager.due("b", compile_s=1.0)


@pytest.mark.parametrize("mtp", [False, True])
def test_a_prefill_bucket_compiles_after_its_eager_runs_cost_a_compile(checkpoint, packaged, mtp):
    w = _wrapper(checkpoint)
    assert w.compiled._compile_s() == DEFAULT_COMPILE_S  # nothing compiled by this process yet
    w.compiled.stats.compiled, w.compiled.stats.compile_s = 2, 10.0  # its mean compile: 5 s

    def run(lengths):
        host = _prefill(lengths)
        return w.forward_prefill_mtp_host(host, [0, 1]) if mtp else w.forward_host(host)

    for _ in range(3):
        run([5, 11])
    assert packaged == []  # three eager runs of a tiny model cost far less than 5 s
    ((key, seconds),) = w.compiled.eager_runs.seconds.items()
    assert key[0] == (PREFILL_MTP if mtp else PREFILL) and 0 < seconds < 5.0
    w.compiled.stats.compile_s = 2 * seconds  # now the eager runs have cost a compile's mean
    run([7, 13])  # the same bucket: two sequences of 16 rows
    run([20])  # another bucket, met once
    assert packaged == [key]


def test_a_cached_package_or_the_environment_compiles_at_first_meeting(checkpoint, packaged, monkeypatch):
    w = _wrapper(checkpoint)
    w.forward_host(_prefill([5]))
    ((key, _),) = w.compiled.eager_runs.seconds.items()
    assert packaged == []
    w.compiled.package_path(key).parent.mkdir(parents=True)
    w.compiled.package_path(key).write_bytes(b"a package")  # the cache has it: load at once
    w.forward_host(_prefill([6]))
    assert packaged == [key]

    monkeypatch.setenv(PREFILL_ENV, "1")
    _wrapper(checkpoint).forward_host(_prefill([20]))
    assert [k[0] for k in packaged] == [PREFILL, PREFILL]


def test_an_offline_run_of_varied_prompts_compiles_decode_shapes_only(checkpoint, packaged):
    """``LLM(decode_graphs=True)`` without compile workers: decode shapes are asked for at once,
    prompts of three buckets (5, 20 and 40 tokens) run eagerly and give the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [np.random.default_rng(n).integers(2, 60, n).tolist() for n in (5, 20, 40, 6)]
    kw = dict(model=str(checkpoint), dtype="float32", cache_block_size=BLOCK_SIZE, num_blocks=128, progress=False,
              max_batch_size=1, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": K,
                                                "adaptive_speculation": False})
    expected = [o.token_ids for o in LLM(**kw, decode_graphs=False).generate(prompts, params)]
    llm = LLM(**kw, decode_graphs=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    kinds = {key[0] for key in packaged}
    assert "speculative" in kinds and not kinds & {PREFILL, PREFILL_MTP}
    prefills = [k for k in llm.engine.model_wrapper.compiled.eager_runs.seconds if k[0] in (PREFILL, PREFILL_MTP)]
    assert len(prefills) == 3


def test_decode_shapes_compile_when_first_met_after_the_warm_up_too(checkpoint, packaged):
    """A batch size the warm-up did not meet is asked for at its first step: every step of its
    batches runs it."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [np.random.default_rng(n).integers(2, 60, n).tolist() for n in (5, 9)]
    kw = dict(model=str(checkpoint), dtype="float32", cache_block_size=BLOCK_SIZE, num_blocks=128, progress=False,
              max_batch_size=2, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": K,
                                                "adaptive_speculation": False})
    expected = [o.token_ids for o in LLM(**kw, decode_graphs=False).generate(prompts, params)]
    llm = LLM(**kw, decode_graphs=True)
    warm = list(packaged)
    assert warm and {k[0] for k in warm} <= {DECODE, SPECULATIVE}
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert {k[0] for k in packaged[len(warm):]} == {SPECULATIVE}  # batch 2's step
    assert not [k for k in llm.engine.model_wrapper.compiled.eager_runs.seconds if k[0] == SPECULATIVE]


def test_a_catch_up_step_compiles_once_its_eager_steps_cost_a_compile(checkpoint, packaged):
    """Draft rows past the steady bucket (a sequence whose MTP caches lack 9 entries after plain
    steps) are a shape met in passing: it runs eagerly until its eager seconds reach the mean
    compile time; a steady step's shape is asked for at once."""
    w = _wrapper(checkpoint)
    lengths = np.array([12])
    tokens = [np.random.default_rng(3).integers(2, 60, 12).tolist()]
    tables = di.block_tables([list(range(8))])

    def step(last_accepted):
        layout = di.decode_layout(lengths, np.array([last_accepted]), K, "vanilla")
        subs = di.sub_inputs(tokens, layout, tables, BLOCK_SIZE, K, "vanilla")
        main = di.main_inputs(np.array([tokens[0][-1]]), lengths, tables, BLOCK_SIZE, K)
        hidden = torch.zeros(subs[0].num_tokens, w.config.hidden_size)
        with torch.inference_mode():
            w.forward_speculative_host(main, subs, list(range(K)), hidden, subs[0].lm_head_indices)

    step(1)
    ((steady,),) = [packaged]
    assert steady[0] == SPECULATIVE
    step(9)
    step(9)
    ((catch_up, seconds),) = w.compiled.eager_runs.seconds.items()
    assert catch_up[0] == SPECULATIVE and catch_up != steady and seconds > 0 and packaged == [steady]
    w.compiled.stats.compiled, w.compiled.stats.compile_s = 1, seconds
    step(9)
    assert packaged == [steady, catch_up]
