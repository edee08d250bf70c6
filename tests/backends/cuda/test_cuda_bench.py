"""The parts of ``mindspec bench --backend cuda`` that run without a GPU: arguments, the clear
refusal, bandwidth arithmetic, and the JSON + PNG report."""
import json

import pytest
import torch

from mindspec.backends.cuda import bench
from mindspec.backends.cuda.bench_kernels import attention_bytes, moe_bytes, spec_peak


def test_parser_defaults_and_sections():
    args = bench.build_parser().parse_args(["--backend", "cuda", "--quick", "--sections", "kernels,decode"])
    assert args.quick and args.dtype == "bfloat16" and args.heads == 128
    assert bench.parse_sections(args.sections) == ["kernels", "decode"]
    with pytest.raises(ValueError, match="gpu"):
        bench.parse_sections("kernels,gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_clearly_without_a_gpu(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "nothing was measured" in err
    assert not list(tmp_path.iterdir())  # no report pretends to have measured anything


def test_bad_sections_exit_2(capsys):
    assert bench.main(["--sections", "nope"]) == 2
    assert "unknown --sections" in capsys.readouterr().err


def test_byte_counts():
    # 2 sequences x (10 cached + 1 new) rows of (8 + 2) bf16 values, plus q_lat/q_pe in and o_lat out
    assert attention_bytes(2, 1, 10, 4, 8, 2, 2) == 2 * 11 * 10 * 2 + 2 * 4 * (2 * 8 + 2) * 2
    # 3 experts' gate/up/down [16 x 8] bf16, x in and out, 2 pairs of act (8) and per-pair rows (16) written + read
    assert moe_bytes(1, 2, 3, 16, 8, 2) == 3 * 3 * 16 * 8 * 2 + 2 * 16 * 2 + 2 * 2 * (8 + 16) * 2


def test_spec_peak_prefers_the_longest_name():
    assert spec_peak("NVIDIA H100 PCIe") == 2.0e12
    assert spec_peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert spec_peak("NVIDIA H200") == 4.8e12
    assert spec_peak("Some Future GPU") is None


def _synthetic_report():
    kernel = dict(ms=0.1, bytes=10**8, gb_per_s=1000.0, fraction_of_spec_peak=0.3, fraction_of_copy_peak=0.35)
    return {
        "device": {"name": "synthetic (no GPU: report-writer test only)"}, "dtype": "bfloat16", "model": "m", "argv": [],
        "kernels": {
            "spec_peak_bytes_per_s": 3.35e12, "copy_peak_bytes_per_s": 2.9e12,
            "attention": [dict(kernel="mla_attention", shape=dict(batch=1, q_len=4, context=1024), **kernel)],
            "moe": [dict(kernel="moe_experts", shape=dict(tokens=4, experts=64, experts_hit=30), **kernel)],
        },
        "linear": [dict(dtype="bfloat16", rows=m, k=192, n=176, cublas_us=2.4, skinny_us=1.7, routed_to="skinny")
                   for m in (1, 4)],
        "decode_latency": [dict(batch=1, num_speculative_tokens=3, eager_ms=9.0, graphs_ms=3.0, graph_speedup=3.0)],
        "throughput": [dict(batch=1, mtp="mtp on", graphs=True, tokens_per_s=100.0)],
        "step_kernels": [dict(batch=1, num_speculative_tokens=k, device_ms_per_step=ms, graph_ms=ms + 0.2)
                         for k, ms in ((0, 1.0), (3, 2.5))],
    }


def test_report_is_json_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    report = _synthetic_report()
    json_path, png_path = bench.write_report(report, tmp_path / "sub" / "cuda_bench")
    assert json.loads(json_path.read_text()) == report
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    partial = {k: v for k, v in report.items() if k not in ("kernels", "throughput")}
    _, png = bench.write_report(partial, tmp_path / "partial")
    assert png.stat().st_size > 0


def test_kernel_cases_run_and_count_bytes(cuda_backend, monkeypatch):
    """The benchmark's kernel set-ups, run once each with a stand-in timer (no GPU timing here)."""
    from mindspec.backends.cuda import bench_kernels

    calls = []
    monkeypatch.setattr(bench_kernels, "_bench_ms", lambda fn: (calls.append(fn()), 2.0)[1])
    att = bench_kernels.bench_attention(cuda_backend, 2, 3, 21, 4, 32, 16, 16, torch.float32, spec=1e9, copy=2e9)
    assert calls[-1].shape == (6, 4, 32)
    assert att.bytes == attention_bytes(2, 3, 21, 4, 32, 16, 4) and att.ms == 2.0
    assert att.fraction_of_spec_peak == pytest.approx(att.bytes / 2e-3 / 1e9)
    assert att.fraction_of_copy_peak == pytest.approx(att.fraction_of_spec_peak / 2)
    moe = bench_kernels.bench_moe(cuda_backend, 5, 8, 2, 32, 16, torch.float32, spec=None, copy=1e9)
    assert calls[-1].shape == (5, 32) and moe.fraction_of_spec_peak is None
    assert moe.bytes == moe_bytes(5, 2, moe.shape["experts_hit"], 32, 16, 4) and 2 <= moe.shape["experts_hit"] <= 8


@pytest.mark.parametrize("k,mode", [(0, "vanilla"), (3, "vanilla"), (2, "eagle")])
def test_decode_step_set_up_runs(k, mode):
    """The decode-latency benchmark's step (prefill, then a decode/MTP step from host inputs), on
    the cpu backend with the shipped model."""
    from mindspec.backends.cuda.bench_e2e import _step_fn
    from mindspec.config.defaults import default_model_dir
    from mindspec.modeling.model_wrapper import ModelWrapper

    wrapper = ModelWrapper(default_model_dir(), backend="cpu", dtype="float32", num_mtp_modules=k if mode == "vanilla" else 1,
                           progress=False)
    wrapper.allocate_cache(16, 16)
    with torch.inference_mode():
        step = _step_fn(wrapper, batch=2, context=20, k=k, mode=mode, block_size=16)
        first, second = step(), step()
    assert torch.equal(first.logits, second.logits)  # a step is repeatable over the same inputs
    assert first.logits.shape[0] == 2 * (k + 1)
    if k:
        assert first.draft_tokens.shape == (2, k)


def test_stdlib_prompts():
    from mindspec.backends.cuda.bench_e2e import stdlib_prompts
    from mindspec.config.defaults import default_model_dir
    from mindspec.text_generator.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir())
    prompts = stdlib_prompts(tok, 3, 16)
    assert len(prompts) == 3 and all(len(p) == 16 for p in prompts)


def test_kernel_table_sums_device_time_per_step():
    from types import SimpleNamespace

    from mindspec.backends.cuda.bench_e2e import kernel_table

    def event(name, us):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(elapsed_us=lambda: us))

    # 2 steps: each launches gemm twice (30 + 10 us) and rms_norm once (5 us)
    events = [event("gemm", 30), event("gemm", 10), event("rms_norm", 5)] * 2
    table = kernel_table(events, steps=2, top=1)
    assert table["device_ms_per_step"] == 0.045 and table["kernels_per_step"] == 3.0
    assert table["top"] == [{"name": "gemm", "launches_per_step": 2.0, "ms_per_step": 0.04, "share": 0.8889}]


def test_linear_cases_time_both_paths_and_name_the_route(device):
    """The projection benchmark's set-up with a stand-in timer (graph timing needs a GPU): both
    paths are timed per shape and rows, and the route is the backend's (float32 stays on cuBLAS)."""
    from mindspec.backends.cuda import bench_kernels

    timed = []
    rows = bench_kernels.run_linear_benchmarks(
        torch.device(device), (torch.float32, torch.float16), rows=(1, 4), shapes=((96, 48), (2048, 16)),
        timer=lambda fn, dev: (timed.append(tuple(fn().shape)), 1.0)[1])
    assert len(rows) == 2 * 2 * 2 and len(timed) == 2 * len(rows)
    assert {(r["dtype"], r["k"], r["rows"]): r["routed_to"] for r in rows} == {
        ("float32", 96, 1): "cublas", ("float32", 96, 4): "cublas", ("float32", 2048, 1): "cublas",
        ("float32", 2048, 4): "cublas", ("float16", 96, 1): "skinny", ("float16", 96, 4): "skinny",
        ("float16", 2048, 1): "cublas", ("float16", 2048, 4): "cublas"}
    assert timed[:2] == [(1, 48), (1, 48)]
