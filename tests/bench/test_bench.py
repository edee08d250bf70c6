"""``mindspec bench``: the speculation summary it reports, and one small end-to-end run that writes
its JSON and PNG."""
import json

import pytest

from mindspec.bench import speed
from mindspec.bench.main import main
from mindspec.engine.outputs import SpecDecodeStats


def test_spec_summary_counts_each_position_over_the_steps_that_drafted_it():
    a, b = SpecDecodeStats.for_drafts(3), SpecDecodeStats.for_drafts(3)
    a.add_step(3, 2)
    a.add_step(3, 1)
    b.add_step(1, 1)  # adaptive speculation: a step with one draft
    b.add_step(3, 0)
    # 2 sequences: 1 token each from prefill, 8 from the 4 speculative steps, 2 from plain steps
    summary = speed.spec_summary([a, b, None], total_tokens=12, num_seqs=2)
    assert summary == {
        "mean_accepted_length": 2.0,  # (4 accepted + 4 bonus) / 4 steps
        "accepted_length_per_request": {"worst": 1.5, "median": 2.0},  # b: (1 + 2) / 2, a: (3 + 2) / 2
        "acceptance_per_position": [0.75, 0.3333, 0.0],  # 3 of 4, 1 of 3, 0 of 3
        "mean_drafts_per_step": 2.5,
        "speculative_step_share": 0.6667,  # 4 of 6 steps
    }
    assert speed.spec_summary([SpecDecodeStats.for_drafts(3)], 10, 1) == {}


def test_summary_reports_the_speedup_per_round_against_the_same_rounds_baseline():
    def measured(rounds):
        return speed.Measurement(tokens_per_s=rounds, latency_per_token_ms=[1.0] * len(rounds))

    # Round 2 is a slow spell for both: the ratio of medians (121 / 100) differs from the
    # median of the per-round ratios (1.25, 1.2, 1.1).
    rows = speed.summarise({"mtp off": measured([100.0, 50.0, 110.0]), "spec": measured([125.0, 60.0, 121.0])})
    assert rows["spec"]["speedup_vs_mtp_off"] == 1.21
    assert rows["spec"]["speedup_vs_mtp_off_rounds"] == [1.25, 1.2, 1.1]
    assert rows["spec"]["speedup_vs_mtp_off_paired_median"] == 1.2
    assert rows["mtp off"]["speedup_vs_mtp_off_rounds"] == [1.0, 1.0, 1.0]


def test_summary_compares_every_mindspec_row_with_a_peer_per_round_and_per_request():
    def measured(rounds, group_seconds):
        return speed.Measurement(tokens_per_s=rounds, latency_per_token_ms=[1.0] * len(rounds),
                                 group_seconds=group_seconds)

    rows = speed.summarise({
        "mtp off": measured([100.0, 80.0, 90.0], [[1.0, 2.0]] * 3),
        "spec": measured([150.0, 120.0, 100.0], [[0.5, 1.0], [0.5, 1.5], [0.4, 1.0]]),  # medians 0.5, 1.0
        "llama.cpp": measured([100.0, 100.0, 125.0], [[0.4, 2.0], [0.6, 2.0], [0.5, 2.0]]),  # medians 0.5, 2.0
    }, peers=("llama.cpp",))
    assert rows["spec"]["speedup_vs_llama_cpp_rounds"] == [1.5, 1.2, 0.8]
    assert rows["spec"]["speedup_vs_llama_cpp_paired_median"] == 1.2
    per_request = rows["spec"]["speedup_vs_llama_cpp_per_request"]
    assert per_request["values"] == [1.0, 2.0] and per_request["min"] == 1.0 and per_request["median"] == 1.5
    assert rows["mtp off"]["speedup_vs_llama_cpp_rounds"] == [1.0, 0.8, 0.72]
    assert not any(k.startswith("speedup_vs_llama") for k in rows["llama.cpp"])


def test_summary_gives_each_request_its_queue_first_token_and_per_token_times():
    def measured(queue, ttft, tpot):
        return speed.Measurement(tokens_per_s=[1.0] * len(ttft), latency_per_token_ms=[1.0] * len(ttft),
                                 queue_s=queue, ttft_s=ttft, tpot_s=tpot)

    rows = speed.summarise({
        "mtp off": measured([[0.0, 0.001]] * 3, [[0.01, 0.02]] * 3, [[0.004, 0.006]] * 3),
        # request 0: medians ttft 12 ms, tpot 2 ms; request 1: 30 ms, 4 ms
        "spec": measured([[0.0, 0.002]] * 3, [[0.012, 0.03], [0.011, 0.03], [0.013, 0.04]],
                         [[0.002, 0.004], [0.003, 0.004], [0.002, 0.005]]),
        "peer": speed.Measurement(tokens_per_s=[1.0] * 3, latency_per_token_ms=[1.0] * 3),
    })
    spec = rows["spec"]
    assert spec["queue_ms"] == {"median": 1.0, "worst": 2.0}
    assert spec["ttft_ms"] == {"median": 21.0, "worst": 30.0}
    assert spec["tpot_ms"] == {"median": 3.0, "worst": 4.0}
    per_request = spec["tpot_speedup_vs_mtp_off_per_request"]  # 4 / 2 and 6 / 4
    assert per_request["values"] == [2.0, 1.5] and per_request["min"] == 1.5
    assert not any(k in rows["peer"] for k in ("ttft_ms", "tpot_ms", "tpot_speedup_vs_mtp_off_per_request"))
    llama = measured([[0.0, 0.0]] * 3, [[0.006, 0.06]] * 3, [[0.004, 0.004]] * 3)
    rows = speed.summarise({"mtp off": measured([[0.0, 0.0]] * 3, [[0.01, 0.02]] * 3, [[0.004, 0.006]] * 3),
                            "llama.cpp": llama}, peers=("llama.cpp",))
    assert rows["mtp off"]["speedup_vs_llama_cpp_ttft_per_request"]["values"] == [0.6, 3.0]  # 6 / 10, 60 / 20 ms
    assert rows["mtp off"]["speedup_vs_llama_cpp_tpot_per_request"]["values"] == [1.0, 0.667]
    one_token = measured([[0.0]], [[0.01]], [[None]])  # a one-token output has no time per output token
    assert "tpot_ms" not in speed.request_latencies(one_token, one_token) and "ttft_ms" in speed.request_latencies(
        one_token, one_token)


@pytest.mark.slow
def test_bench_writes_json_and_png(tmp_path):
    out = tmp_path / "bench"
    rc = main(["--batching", "static", "--batches", "1,2", "--ks", "1", "--rounds", "1", "--new-tokens", "6", "--no-compile",
               "--no-async", "--no-hf", "--no-profile", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert list(report["results"]) == ["batch 1", "batch 2"] and report["batching"] == "static"
    rows = report["results"]["batch 2"]
    assert {"mtp off", "vanilla K=1", "eagle K=1", "vanilla K=3 adaptive", "eagle K=3 adaptive"} <= set(rows)
    for name, row in rows.items():
        assert row["tokens_per_s_median"] > 0
        if report["configs"][name]["lossless_policy"]:
            assert row["identical_to_mtp_off"], name  # greedy speculation changes no token
    assert rows["mtp off"]["speedup_vs_mtp_off"] == 1.0
    accounting = report["step_accounting"]
    assert set(accounting) == set(report["configs"]) and accounting["mtp off"]["ops_outside_graphs"] > 50  # eager
    assert sum(accounting["mtp off"]["ops"].values()) == pytest.approx(accounting["mtp off"]["ops_outside_graphs"])
    assert rows["vanilla K=1"]["mean_drafts_per_step"] == 1.0
    assert 0 < rows["vanilla K=1"]["tpot_ms"]["median"] <= rows["vanilla K=1"]["tpot_ms"]["worst"]
    assert len(rows["vanilla K=1"]["tpot_speedup_vs_mtp_off_per_request"]["values"]) == report["prompts_per_batch"]["batch 2"]
    assert 1.0 <= rows["vanilla K=1"]["mean_accepted_length"] <= 2.0


def test_also_model_runs_each_configuration_on_a_second_checkpoint_with_its_weight_bytes(tmp_path):
    """An FP8 conversion of the shipped model beside it: every configuration twice, the FP8
    model's resident weights smaller (its routed experts stay FP8 on cpu)."""
    from mindspec.config.defaults import default_model_dir
    from mindspec.modeling.fp8_convert import convert_to_block_fp8

    fp8 = convert_to_block_fp8(default_model_dir(), tmp_path / "fp8")
    out = tmp_path / "bench"
    rc = main(["--batches", "1", "--rounds", "1", "--new-tokens", "8", "--min-prompts", "2", "--no-compile",
               "--no-async", "--no-hf", "--no-profile", "--configs", "mtp off,eagle K=3", "--also-model",
               f"fp8={fp8}", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    configs = report["configs"]
    assert set(configs) == {"mtp off", "eagle K=3", "mtp off @fp8", "eagle K=3 @fp8"}
    assert configs["eagle K=3 @fp8"]["model"] == str(fp8)
    assert configs["mtp off @fp8"]["resident_weight_bytes"] < 0.8 * configs["mtp off"]["resident_weight_bytes"]
    rows = report["results"]["batch 1"]
    assert rows["eagle K=3"]["identical_to_mtp_off"] and rows["mtp off @fp8"]["tokens_per_s_median"] > 0


def test_prompt_count_continuous_runs_waves_of_the_running_limit():
    assert speed.prompt_count(1, 8, "static") == 8
    assert speed.prompt_count(16, 8, "static") == 16
    assert speed.prompt_count(1, 8, "continuous") == 8
    assert speed.prompt_count(16, 8, "continuous") == speed.WAVES * 16


@pytest.mark.slow
def test_continuous_bench_runs_every_prompt_in_one_generate_with_at_most_b_running(tmp_path, monkeypatch):
    from mindspec.bench import main as bench_main
    from mindspec.engine.scheduler import Scheduler
    from mindspec.llm import LLM

    # Observed where it happens: the sequences the scheduler holds running after each schedule,
    # and the prompts and outputs of every LLM.generate call.
    running, calls, built = [], [], []
    schedule = Scheduler.schedule

    def recording_schedule(self):
        batch = schedule(self)
        running.append(len(self.running))
        return batch

    generate = LLM.generate

    def recording_generate(self, prompts, params=None):
        outs = generate(self, prompts, params)
        calls.append((len(prompts), [len(o.token_ids) for o in outs]))
        return outs

    make_llm = bench_main._llm

    def recording_llm(*args):
        built.append(make_llm(*args))
        return built[-1]

    monkeypatch.setattr(Scheduler, "schedule", recording_schedule)
    monkeypatch.setattr(LLM, "generate", recording_generate)
    monkeypatch.setattr(bench_main, "_llm", recording_llm)
    out = tmp_path / "bench"
    rc = main(["--batching", "continuous", "--batches", "2", "--ks", "1", "--rounds", "1", "--new-tokens", "6",
               "--no-compile", "--no-async", "--no-hf", "--no-profile", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["batching"] == "continuous"
    assert report["prompts_per_batch"] == {"batch 2": 8}  # WAVES x 2
    assert list(report["results"]) == ["batch 2"]
    rows = report["results"]["batch 2"]
    # One generate per configuration with all 8 prompts, each run to its 6 tokens.
    assert calls == [(8, [6] * 8)] * len(built) and len(built) == len(rows)
    assert max(running) == 2  # never more than b running, and the limit is used
    assert all(llm.engine.scheduler.config.max_batch_size == 256 for llm in built)  # restored after the run
    for name, row in rows.items():
        assert row["tokens_per_s_median"] > 0
        if report["configs"][name]["lossless_policy"]:
            assert row["identical_to_mtp_off"], name


class _CountingLLM:
    """Stands in for an LLM: echoes each prompt's first token, counts its generate calls."""

    def __init__(self, new_graphs=()):
        from types import SimpleNamespace

        self.calls = 0
        self.new_graphs = list(new_graphs)  # graphs the n-th generate call captures (then none)
        runner = SimpleNamespace(num_graphs=0) if new_graphs else None
        self.engine = SimpleNamespace(scheduler=SimpleNamespace(config=SimpleNamespace(max_batch_size=256)),
                                      model_wrapper=SimpleNamespace(graph_runner=runner))

    def generate(self, prompts, params):
        from types import SimpleNamespace

        if self.calls < len(self.new_graphs):
            self.engine.model_wrapper.graph_runner.num_graphs += self.new_graphs[self.calls]
        self.calls += 1
        self.max_tokens = [q.max_tokens for q in params]
        self.seeds = [q.seed for q in params]
        return [SimpleNamespace(token_ids=[p[0]] * q.max_tokens, spec_decode=None, metrics=None) for p, q in zip(prompts, params)]


def test_warm_up_runs_a_configuration_once_untimed():
    from mindspec.text_generator.sampling.params import SamplingParams

    llms = {"mtp off": _CountingLLM(), "compiled": _CountingLLM()}
    prompts = [[i] for i in range(4)]
    rows = speed.bench_batch(llms, None, prompts, 2, 4, 3, SamplingParams(max_tokens=2), "static",
                             warm_up=frozenset({"compiled"}))
    assert llms["mtp off"].calls == 3 * 2 and llms["compiled"].calls == 4 * 2  # 2 groups per round
    assert len(rows["compiled"]["tokens_per_s_rounds"]) == 3


def test_warm_up_repeats_until_no_new_graph_is_captured():
    """Continuous batching, one generate per run: graphs captured in warm-up runs 1-3 (adaptive
    speculation meeting new shapes), none in run 4, so timing starts after run 4."""
    from mindspec.text_generator.sampling.params import SamplingParams

    llms = {"graphs": _CountingLLM(new_graphs=[3, 2, 1]), "mtp off": _CountingLLM(new_graphs=[2])}
    speed.bench_batch(llms, None, [[i] for i in range(8)], 2, 4, 3, SamplingParams(max_tokens=2), "continuous",
                      warm_up=frozenset(llms))
    assert llms["graphs"].calls == 4 + 3 and llms["mtp off"].calls == 2 + 3


def test_output_lengths_fixed_or_drawn_from_the_range():
    assert speed.output_lengths(5, 64) == [64] * 5
    lens = speed.output_lengths(400, 64, 0.5)
    assert min(lens) == 32 and max(lens) == 96  # both ends reached in 400 draws
    assert lens == speed.output_lengths(400, 64, 0.5)  # the same draw every time
    assert set(speed.output_lengths(50, 1, 0.9)) == {1, 2}  # never below 1
    with pytest.raises(ValueError, match="range ratio"):
        speed.output_lengths(3, 64, 1.0)


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_each_prompt_gets_its_own_output_length(batching):
    from mindspec.text_generator.sampling.params import SamplingParams

    llms = {"mtp off": _CountingLLM()}
    prompts = [[i] for i in range(16)]  # continuous: 4 waves of 4
    lens = [3, 1, 4, 1, 5, 9, 2, 6] * 2
    rows = speed.bench_batch(llms, None, prompts, 4, 8, 1, SamplingParams(max_tokens=2), batching, output_lens=lens)
    got = llms["mtp off"].max_tokens
    assert got == (lens if batching == "continuous" else lens[12:])  # static: the last group's call
    assert rows["mtp off"]["identical_to_mtp_off"]


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_each_request_samples_with_its_own_seed(batching):
    from mindspec.text_generator.sampling.params import SamplingParams

    llms = {"mtp off": _CountingLLM()}
    prompts = [[i] for i in range(16)]  # continuous: 4 waves of 4, in one generate
    speed.bench_batch(llms, None, prompts, 4, 8, 1, SamplingParams(temperature=0.7, seed=100, max_tokens=2), batching)
    assert llms["mtp off"].seeds == (list(range(100, 116)) if batching == "continuous" else [104, 105, 106, 107])
    speed.bench_batch(llms, None, prompts, 4, 8, 1, SamplingParams(max_tokens=2), batching)
    assert set(llms["mtp off"].seeds) == {None}
    last = 2**63 - 1  # the largest seed: the next requests' seeds wrap into the range
    speed.bench_batch(llms, None, prompts, 4, 8, 1, SamplingParams(temperature=0.7, seed=last, max_tokens=2), "continuous")
    assert llms["mtp off"].seeds == [last] + list(range(15))


@pytest.mark.slow
def test_sampled_bench_keeps_mtp_offs_tokens_with_every_lossless_configuration(tmp_path):
    """Seeded sampling: strict verification gives MTP off's tokens, each request its own seed."""
    out = tmp_path / "sampled"
    rc = main(["--batches", "1", "--ks", "1", "--rounds", "1", "--new-tokens", "8", "--min-prompts", "3", "--no-compile",
               "--no-async", "--no-profile", "--configs", "mtp off,vanilla K=1,eagle K=1", "--temperature", "0.8",
               "--top-p", "0.9", "--seed", "7", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["greedy"] is False
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "first_seed": 7}
    rows = report["results"]["batch 1"]
    assert "transformers generate" not in rows  # no sampled reference to compare with
    assert rows["vanilla K=1"]["identical_to_mtp_off"] and rows["eagle K=1"]["identical_to_mtp_off"]
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_sampling_options_are_checked_before_anything_runs(tmp_path, capsys):
    out = str(tmp_path / "x")
    assert main(["--temperature", "0.7", "--compare", "llama.cpp", "--out", out]) == 2
    assert "times greedy decoding" in capsys.readouterr().err
    assert main(["--temperature", "0.7", "--top-p", "1.5", "--out", out]) == 2
    assert "top_p" in capsys.readouterr().err


def test_transformers_groups_run_to_their_longest_output_and_count_what_was_asked(monkeypatch):
    import itertools

    clock = itertools.count()  # perf_counter reads 0, 1, 2, ...: the run lasts 5 "seconds"
    monkeypatch.setattr(speed.time, "perf_counter", lambda: float(next(clock)))

    class FakeHF:
        asked = []

        def generate(self, ids, max_new_tokens, **kw):
            self.asked.append((ids.shape[0], max_new_tokens, kw["min_new_tokens"]))

    m = speed.Measurement()
    speed.run_hf(FakeHF(), [[[1], [2]], [[3], [4]]], [[3, 7], [5, 2]], m)
    assert FakeHF.asked == [(2, 7, 7), (2, 5, 5)]
    assert m.tokens_per_s == [(3 + 7 + 5 + 2) / 5]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")
def test_compare_on_cuda_refuses_clearly_without_a_gpu(tmp_path, capsys):
    """`--backend cuda --compare` is this comparison on a GPU; `--backend cuda` alone is the cuda
    backend's own benchmark. Without a GPU both exit 2 and write nothing."""
    assert main(["--backend", "cuda", "--compare", "--out", str(tmp_path / "r")]) == 2
    assert "--compare needs a CUDA GPU" in capsys.readouterr().err
    assert main(["--backend", "cuda", "--out", str(tmp_path / "r")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_default_configs_leave_graphs_to_the_backend():
    """decode_graphs None: CUDA graphs on a GPU, eager on cpu; only '+compile' asks for True."""
    configs = speed.default_configs([1, 3], 3, 0, 1, compiled=True)
    assert {c.decode_graphs for c in configs if "compile" not in c.name} == {None}
    assert all(c.decode_graphs for c in configs if "compile" in c.name)
    both = {c.name: c for c in configs if c.decode_graphs and c.async_scheduling}
    assert set(both) == {"mtp off +compile +async", "vanilla K=3 +compile +async"}
    assert not both["vanilla K=3 +compile +async"].plugin_params["adaptive_speculation"]  # off under async
    eager_prefill = {c.name for c in configs if not c.compile_prefill}  # the compiled prefill, side by side
    assert eager_prefill == {"mtp off +compile +eager prefill", "vanilla K=3 +compile +eager prefill",
                             "vanilla K=3 adaptive +compile +eager prefill"}
    assert all(c.decode_graphs for c in configs if c.name in eager_prefill)
    modes = {c.plugin_params["mtp_mode"] for c in configs if c.decode_graphs and c.plugin_params}
    assert modes == {"vanilla", "eagle"}  # both modes' compiled steps, side by side


def test_configs_are_chosen_by_name():
    configs = speed.default_configs([1, 3], 3, 0, 1, compiled=True)
    chosen = speed.select_configs(configs, "vanilla K=3 +compile, mtp off")
    assert [c.name for c in chosen] == ["mtp off", "vanilla K=3 +compile"]  # the usual order
    with pytest.raises(ValueError, match="unknown configuration.*'K=9'.*choose from"):
        speed.select_configs(configs, "mtp off,K=9")
    # the baseline is measured even when not named: every speed-up and identity is against it
    assert [c.name for c in speed.select_configs(configs, "mtp off +compile")] == ["mtp off", "mtp off +compile"]


def test_unknown_configs_and_a_missing_llama_cpp_are_one_clear_error(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "r")
    assert main(["--configs", "nope", "--out", out]) == 2
    assert "unknown configuration(s) 'nope'" in capsys.readouterr().err
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "llama_cpp" else True)
    assert main(["--compare", "llama.cpp", "--out", out]) == 2
    assert "needs llama-cpp-python" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_llama_cpp_needs_a_converter_or_a_gguf_file(tmp_path, monkeypatch):
    from mindspec.bench import llama_cpp

    monkeypatch.delenv(llama_cpp.SRC_ENV, raising=False)
    with pytest.raises(llama_cpp.LlamaCppError, match="convert_hf_to_gguf.py"):
        llama_cpp.converter_dir(None)
    with pytest.raises(llama_cpp.LlamaCppError, match="convert_hf_to_gguf.py"):
        llama_cpp.converter_dir(str(tmp_path))  # a folder without the converter
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    monkeypatch.setenv(llama_cpp.SRC_ENV, str(tmp_path))
    assert llama_cpp.converter_dir(None) == tmp_path


def test_another_engine_runs_in_every_round_and_is_compared_token_for_token():
    """``others`` (llama.cpp in ``--compare llama.cpp``) run one round each, interleaved with the
    configurations, over the same prompts and output lengths."""
    from mindspec.text_generator.sampling.params import SamplingParams

    llms = {"mtp off": _CountingLLM()}
    calls = []

    def other(prompts, lengths, m, batch):
        calls.append((prompts, lengths, batch))
        m.tokens_per_s.append(10.0)
        m.latency_per_token_ms.append(1.0)
        m.token_ids = [[0]] * len(prompts)

    rows = speed.bench_batch(llms, None, [[i] for i in range(4)], 1, 4, 3, SamplingParams(max_tokens=2),
                             "static", others={"llama.cpp": other})
    assert len(calls) == 3 and calls[0] == ([[0], [1], [2], [3]], [2, 2, 2, 2], 1)
    assert rows["llama.cpp"]["tokens_per_s_rounds"] == [10.0] * 3
    assert "identical_to_mtp_off" in rows["llama.cpp"]


@pytest.mark.slow
def test_model_shape_runs_random_weights_with_simulated_acceptance(tmp_path, monkeypatch):
    from mindspec.bench import model_shapes

    tiny = json.loads((_shipped() / "config.json").read_text())
    tiny = {k: v for k, v in tiny.items() if k not in ("architectures", "bos_token_id", "eos_token_id")}
    monkeypatch.setitem(model_shapes.SHAPES, "tiny", {**tiny, "num_hidden_layers": 3})
    out = tmp_path / "shape"
    rc = main(["--model-shape", "tiny", "--shape-layers", "2", "--simulated-acceptance", "1,1,0", "--batches", "1",
               "--ks", "3", "--rounds", "1", "--new-tokens", "9", "--configs", "mtp off,eagle K=3", "--no-async",
               "--no-profile", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    shape = report["model_shape"]
    assert shape["name"] == "tiny" and shape["num_hidden_layers"] == 2 and shape["simulated_acceptance"] == [1, 1, 0]
    assert (tmp_path / "tiny-2l-random" / "random_weights.json").is_file() and report["model"].endswith("tiny-2l-random")
    assert "transformers generate" not in report["results"]["batch 1"]  # random weights: no reference to compare
    eagle = report["results"]["batch 1"]["eagle K=3"]
    assert not report["configs"]["eagle K=3"]["lossless_policy"]
    assert report["configs"]["eagle K=3"]["plugin_params"]["simulated_acceptance"] == [1, 1, 0]
    # Drafts 1 and 2 always accepted, draft 3 never, whatever the random model proposes.
    assert eagle["acceptance_per_position"] == [1.0, 1.0, 0.0] and eagle["mean_accepted_length"] == 3.0


def test_model_shape_errors_are_one_clear_message(tmp_path, capsys):
    out = str(tmp_path / "r")
    assert main(["--model-shape", "deepseek-v2-lite", "--shape-layers", "99", "--out", out]) == 2
    assert "1..27" in capsys.readouterr().err
    assert main(["--model-shape", "deepseek-v2-lite", "--ks", "3", "--simulated-acceptance", "0.9", "--out", out]) == 2
    assert "needs 3 simulated acceptance rates" in capsys.readouterr().err


def _shipped():
    from mindspec.config.defaults import default_model_dir

    return default_model_dir()


def test_prefix_cache_scenario_writes_json_and_png(tmp_path):
    out = tmp_path / "prefix"
    rc = main(["--scenario", "prefix-cache", "--configs", "mtp off", "--rounds", "1", "--conversations", "2",
               "--turns", "2", "--system-tokens", "120", "--message-tokens", "16", "--shots", "2", "--shot-tokens",
               "40", "--queries", "2", "--new-tokens", "4", "--out", str(out)])
    assert rc == 0 and out.with_suffix(".png").stat().st_size > 10_000
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert list(rows) == ["chat, mtp off", "few-shot, mtp off"]
    chat = rows["chat, mtp off"]
    assert chat["identical_outputs"]
    assert all(c > 0 for c in chat["cached_tokens"][1]) and chat["ttft_ratio_later_turns"]["count"] == 2
    assert rows["few-shot, mtp off"]["cached_tokens"][1][0] > 0


def test_split_fuse_scenario_writes_json_and_png(tmp_path):
    out = tmp_path / "split"
    rc = main(["--scenario", "split-fuse", "--configs", "mtp off", "--rounds", "1", "--streams", "2",
               "--stream-tokens", "12", "--arrive-after", "2", "--long-prompt-tokens", "150", "--chunk-tokens", "32",
               "--prompt-tokens", "16", "--out", str(out)])
    assert rc == 0 and out.with_suffix(".png").stat().st_size > 10_000
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert list(rows) == ["mtp off", "mtp off +splitfuse 32"]
    assert all(r["identical_outputs"] and r["gap_max_s"] >= r["gap_p99_s"] >= r["gap_median_s"] > 0 for r in rows.values())


def test_scenarios_name_unknown_configurations(tmp_path, capsys):
    assert main(["--scenario", "prefix-cache", "--configs", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown configuration(s) 'nope'" in capsys.readouterr().err
