"""The few-row kernels of compiled cpu decode steps (``rows_gemm.cpp``): built on first use,
loaded into the process, and called by AOTInductor packages directly through their C shims.

Inside a compiled step Inductor's GEMM template keeps one accumulator chain per (row, output
block) and reads each weight again for every row, so a 4-row verification's GEMMs cost several
times a 1-row step's. ``rows_linear`` widens each bfloat16 weight vector once and multiplies it
into up to 8 rows; every output sums over its inputs in one order whatever the row count, so a
row's result is the same alone or in a batch. ``rows_experts`` (the routed experts) and
``rows_heads`` (MLA's absorbed per-head products) run the same inner kernel.

The library is compiled with the C++ compiler AOTInductor uses, for AVX-512F cpus only (others
keep Inductor's GEMMs), into ``<cache>/kernels/`` keyed by its source and torch's version, and
loaded once per process (a compile worker loads the one its parent loaded, whatever its cache
directory). A failed build logs one warning and the steps compile without it.
MINDSPEC_CPU_ROWS_GEMM=0 turns it off (A/B runs).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch.utils import cpp_extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rows_gemm.cpp")
BLOCK = 32  # outputs per weight block (rows_gemm.cpp)
# Compiled GEMMs of up to this many rows go through rows_linear (8 rows per pass over the weight):
# 12 chained 192 x 192 GEMMs and a 4096-column lm_head, one thread, 71 / 204 / 396 us at 4 / 16 / 32
# rows against 144 / 548 / 1092 for Inductor's float32 template (benchmarks/README.md).
LINEAR_MAX_ROWS = 64
HEAD_MAX_TOKENS = 64  # compiled per-head products (MLA's absorbed weights) of up to this many tokens: rows_heads
ENV_SWITCH = "MINDSPEC_CPU_ROWS_GEMM"
LIBRARY_ENV = "MINDSPEC_ROWS_GEMM_LIBRARY"  # set once loaded: the library child processes load
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma",
         "-DCPU_CAPABILITY_AVX512"]  # ATen's vectorized exp, as Inductor's kernels build it
C_SHIMS = {
    "rows_linear": "AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle blocked, "
                   "int64_t n, AtenTensorHandle* ret0)",
    "rows_experts": "AOTITorchError aoti_torch_cpu_rows_experts(AtenTensorHandle x, AtenTensorHandle ids, "
                    "AtenTensorHandle weights, AtenTensorHandle w13, AtenTensorHandle w2, int64_t inter, "
                    "AtenTensorHandle* ret0)",
    "rows_heads": "AOTITorchError aoti_torch_cpu_rows_heads(AtenTensorHandle x, AtenTensorHandle blocked, "
                  "int64_t n, AtenTensorHandle* ret0)",
}


def supported() -> bool:
    """Whether this cpu runs the kernel (AVX-512F) and it is not switched off; builds nothing.
    The cpu backend keeps its weights blocked for it where this holds."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")


def available() -> bool:
    """Whether compiled steps call rows_linear in this process (built and loaded on first call)."""
    return _loaded() is not None


def c_shims() -> dict:
    """aot_inductor.custom_ops_to_c_shims for the packages: the ops' calls become direct C calls."""
    if not available():
        return {}
    return {getattr(torch.ops.mindspec, name).default: [shim] for name, shim in C_SHIMS.items()}


def block(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (bfloat16) -> [ceil(N / 32), K, 32]: per block and k, outputs j and 16 + j
    side by side (j < 16), so that one 32-bit lane holds both and a shift or a mask widens
    either to float32; outputs past N are zeros."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, k, dtype=weight.dtype)
    padded[:n] = weight
    halves = padded.view(blocks, 2, BLOCK // 2, k).permute(0, 3, 2, 1)  # [blocks, K, 16, 2]
    return halves.reshape(blocks, k, BLOCK).contiguous()


def block_experts(weights: torch.Tensor) -> torch.Tensor:
    """Experts' weights [E, N, K] (bfloat16) -> [E, ceil(N / 32), K, 32], each expert as ``block``."""
    return torch.stack([block(w) for w in weights])


def rows_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 inter: int) -> torch.Tensor:
    """The routed experts of a few tokens (rows_gemm.cpp): x [T, H] float32, ids / weights [T, k]
    (int64 / float32), w13 / w2 the blocked gate-up [E, 2I, H] and down [E, H, I] -> [T, H]."""
    _require()
    return torch.ops.mindspec.rows_experts(x, ids, weights, w13, w2, inter)


def block_heads(weight: torch.Tensor) -> torch.Tensor:
    """Per-head weights [H, K, N] as bmm takes them (bfloat16) -> [H, ceil(N / 32), K, 32]: head
    h's [N, K] transpose as ``block``."""
    return torch.stack([block(w.T) for w in weight])


def rows_heads(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    """x [T, H, K] float32 (last dim contiguous) -> [T, H, n]: each head's rows times its weight."""
    _require()
    return torch.ops.mindspec.rows_heads(x, blocked, n)


def rows_linear(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] float32 @ the blocked weight's [n, K].T -> [..., n] float32."""
    _require()
    return torch.ops.mindspec.rows_linear(x, blocked, n)


def _require() -> None:
    if not available():
        raise RuntimeError("rows_gemm: the kernel is not loaded (unsupported cpu, switched off, or its build failed)")


@functools.lru_cache(maxsize=1)
def _loaded() -> Optional[Path]:
    if not supported():
        return None
    try:
        path = _built()
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)  # global: packages resolve the C shim against it
        os.environ[LIBRARY_ENV] = str(path)  # child processes (compile workers) load this one
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the few-row GEMM kernel did not build (%s): compiled steps use Inductor's GEMMs", e)
        return None
    torch.library.register_fake("mindspec::rows_linear")(_linear_shape)
    torch.library.register_fake("mindspec::rows_experts")(_experts_shape)
    torch.library.register_fake("mindspec::rows_heads")(_heads_shape)
    return path


def _linear_shape(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n)


def _experts_shape(x, ids, weights, w13, w2, inter: int) -> torch.Tensor:
    return x.new_empty(x.shape)


def _heads_shape(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], n)


def _built() -> Path:
    """The library for this source and torch, compiled into the cache unless it is there."""
    from mindspec.modeling.exported_step import step_cache_dir  # the steps' cache, beside them

    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(FLAGS).encode()).hexdigest()
    name = f"rows_gemm-{key[:16]}.so"
    inherited = Path(os.environ.get(LIBRARY_ENV, ""))
    if inherited.name == name and inherited.is_file():  # the parent's (another cache directory's)
        return inherited
    path = step_cache_dir().parent / "kernels" / name
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run(_command(Path(tmp)), check=True, capture_output=True, text=True, timeout=600)
        os.replace(tmp, path)  # atomic: another process building the same key writes the same bytes
    except subprocess.CalledProcessError as e:
        raise subprocess.SubprocessError(e.stderr.strip().splitlines()[-1] if e.stderr.strip() else str(e)) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _command(out: Path) -> list[str]:
    from torch._inductor.cpp_builder import get_cpp_compiler

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [get_cpp_compiler(), *FLAGS, abi, *includes, str(SOURCE), f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}",
            "-ltorch", "-ltorch_cpu", "-lc10", "-o", str(out)]
