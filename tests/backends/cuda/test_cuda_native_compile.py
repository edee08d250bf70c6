"""The Triton kernels the cuda backend launches compile for Hopper (sm_90: H100, H200), Ampere
(sm_80: A100) and Blackwell (sm_100: B200), checked without a GPU (tests/support/native_compile.py).

The interpreter runs a kernel as Python, so what only Triton's compiler rejects reaches the first
GPU session untested. Here models serve greedy requests with MTP (prefill, plain and speculative
steps): the shipped model in float16, bfloat16 and float32, and DeepSeek-V2-Lite's and V3's
published widths in bfloat16; plus what those requests do not reach (split keys, a draft tree's
mask, block-FP8 projections in each architecture's mode). The launch wrappers choose the tiles
they choose on a GPU, every distinct launch is compiled to a cubin for each architecture in a
process without the interpreter, and its shared memory is checked against the block limit.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import op_references as ref
from cuda_support import ON_GPU
from mindspec import LLM, SamplingParams
from mindspec.backend import LatentCache
from mindspec.backends.cuda.mla_attention import mla_decode
from mindspec.config.defaults import default_model_dir
from mindspec.modeling.fp8 import BlockFp8Format, Fp8Weight, quantize
from tests.support.native_compile import LaunchRecorder
from test_cuda_published_widths import write_checkpoint

pytestmark = [pytest.mark.skipif(ON_GPU, reason="a GPU compiles its kernels as it runs them"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
ARCHS = ("90", "80", "100")  # Hopper (H100, H200), Ampere (A100), Blackwell (B200)
MTP = {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle", "adaptive_speculation": False}
# Every kernel a request's prefill, plain and speculative steps launch, and the split-key merge.
STEP_KERNELS = {
    "_rms_norm_kernel", "_embed_norm_concat_kernel", "_skinny_linear_kernel", "_rope_kernel",
    "_latent_norm_rope_cache_kernel", "_mla_prefill_kernel", "_mla_decode_kernel", "_merge_splits_kernel",
    "_router_kernel", "_align_routes_kernel", "_gate_up_silu_kernel", "_down_kernel", "_combine_kernel",
    "_silu_and_mul_kernel", "_accept_kernel", "_eh_proj_kernel", "_argmax_shift_kernel",
}


def _serve(model: Path, dtype: str, num_speculative_tokens: int = 3, prompts=2, max_tokens=6,
           mode: str = "eagle") -> None:
    llm = LLM(model=str(model), backend="cuda", device="cpu", dtype=dtype, progress=False, max_batch_size=2,
              plugin_params={**MTP, "num_speculative_tokens": num_speculative_tokens, "mtp_mode": mode})
    llm.generate([list(range(5, 40)), list(range(7, 30))][:prompts],
                 SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    llm.close()


def _compile_all(recorder: LaunchRecorder, path: Path, *archs: str) -> None:
    done = _compile(recorder.save(path), *archs)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    for arch in archs:
        assert f"sm_{arch}: {len(recorder.launches)} of {len(recorder.launches)} launches compiled" in done.stdout


def _compile(records: Path, *archs: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).parent  # the kernels above live in this module, which imports op_references
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(here), str(here.parent), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "tests.support.native_compile", str(records), "--arch", *archs],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)


@triton.jit
def _sum_kernel(x_ptr, out_ptr, n):
    total = 0  # an int32 that the loop turns into a float: the interpreter lets it, the compiler does not
    for i in range(n):
        total += tl.load(x_ptr + i)
    tl.store(out_ptr, total)


@triton.jit
def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


def test_the_check_reports_what_only_the_compiler_rejects(tmp_path, monkeypatch):
    """A loop-carried value whose type changes runs under the interpreter and fails to compile."""
    recorder = LaunchRecorder()
    with recorder.installed(monkeypatch):
        x, total = torch.ones(100), torch.zeros(1)
        _sum_kernel[(1,)](x, total, 100)
        _double_kernel[(1,)](x, 100, BLOCK=128)
    assert total.item() == 100 and torch.equal(x, torch.full((100,), 2.0))  # the launches still ran
    assert recorder.kernels() == {"_sum_kernel", "_double_kernel"}
    done = _compile(recorder.save(tmp_path / "launches.json"), "90")
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "_sum_kernel" in failed[0], done.stdout + done.stderr
    assert "Loop-carried variable total" in done.stdout
    assert "sm_90 ok test_cuda_native_compile._double_kernel" in done.stdout


def _attention_variants() -> None:
    """mla_decode with the keys split over programs (merged after) and with a draft tree's mask,
    at the shipped model's widths (4 heads, kv_lora_rank 64, rope 16)."""
    heads, rank, rope, blocks = 4, 64, 16, 48
    g = torch.Generator().manual_seed(0)
    tree = torch.rand(2, 4, 4, generator=g) < 0.5
    tree |= torch.eye(4, dtype=torch.bool)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for splits, mask in ((2, None), (1, tree), (3, tree)):
            meta, _ = ref.paged_metadata([150, 30], [4, 4], 16, blocks, seed=1, tree_mask=mask)
            buf = torch.randn(blocks, 16, rank + rope, generator=g).to(dtype)
            q_lat, q_pe = torch.randn(8, heads, rank).to(dtype), torch.randn(8, heads, rope).to(dtype)
            mla_decode(q_lat, q_pe, LatentCache(c_kv=buf[..., :rank], k_pe=buf[..., rank:]), meta, 0.2,
                       num_splits=splits)


def test_the_shipped_models_kernels_compile_for_hopper_ampere_and_blackwell(tmp_path, monkeypatch):
    recorder = LaunchRecorder()
    with recorder.installed(monkeypatch):
        for dtype in ("float16", "bfloat16", "float32"):  # vanilla's draft stages all feed on every row
            _serve(default_model_dir(), dtype, mode="vanilla" if dtype == "bfloat16" else "eagle")
        _attention_variants()
    assert STEP_KERNELS <= recorder.kernels(), STEP_KERNELS - recorder.kernels()
    _compile_all(recorder, tmp_path / "launches.json", *ARCHS)


def test_published_widths_kernels_compile_for_hopper_ampere_and_blackwell(tmp_path, monkeypatch):
    """MLA with 16 / 128 heads and kv_lora_rank 512, hidden 2048 / 7168, softmax routing over 64
    experts and V3's grouped sigmoid routing (the checkpoints of test_cuda_published_widths.py)."""
    recorder = LaunchRecorder()
    with recorder.installed(monkeypatch):
        for name in ("deepseek-v2-lite", "deepseek-v3"):
            _serve(write_checkpoint(tmp_path / name, name), "bfloat16", num_speculative_tokens=1, prompts=1,
                   max_tokens=3)
    # no split-key merge; eh_proj's input wider than the skinny GEMM takes (the embedding-and-norms
    # kernel and cuBLAS instead); one draft stage (no next stage's tokens to shift)
    assert STEP_KERNELS - {"_merge_splits_kernel", "_eh_proj_kernel", "_argmax_shift_kernel"} <= recorder.kernels()
    _compile_all(recorder, tmp_path / "launches.json", *ARCHS)


@pytest.mark.parametrize("arch,capability", [("90", (9, 0)), ("89", (8, 9)), ("100", (10, 0))])
def test_block_fp8_projections_compile_in_each_architectures_mode(tmp_path, monkeypatch, arch, capability):
    """e4m3 tiles into tl.dot where a K block is one FP8 MMA deep, bf16 otherwise
    (fp8_linear.dot_mode); V3's 128 x 128 blocks and 16-wide ones. Before Ada (sm_89) Triton
    cannot load e4m3 at all: there the backend dequantizes FP8 checkpoints at load
    (test_cuda_fp8_linear.py)."""
    from mindspec.backends.cuda import fp8_linear

    recorder = LaunchRecorder()
    with recorder.installed(monkeypatch):
        monkeypatch.setattr(fp8_linear, "_capability", lambda device: capability)
        for block, (n, k) in (((128, 128), (256, 512)), ((1, 16), (96, 64))):
            fmt = BlockFp8Format(block)
            q, scale = quantize(torch.randn(n, k) * 0.1, fmt)
            for dtype in (torch.bfloat16, torch.float16):
                fp8_linear.fp8_block_linear(torch.randn(3, k).to(dtype), Fp8Weight(q, scale, fmt, dtype))
    modes = {r["kwargs"]["UPCAST"] for r in recorder.launches.values()}
    assert modes == {fp8_linear.E4M3_DOT, fp8_linear.BF16_DOT}
    _compile_all(recorder, tmp_path / "launches.json", arch)
