"""Compiles the Triton kernels the cuda backend launched, for a GPU architecture, on a machine
without a GPU. TEST SUPPORT ONLY: nothing here runs a kernel on a GPU.

Under Triton's interpreter (how CI runs the cuda backend) a kernel never meets Triton's compiler,
so what only the compiler rejects (a loop-carried value whose type changes, a dtype the
architecture lacks such as e4m3 before sm_89, a block too large for shared memory) passes every
interpreter test and fails on the first GPU. Two steps close that gap:

- ``LaunchRecorder.installed`` notes every kernel launch's specialization while the kernels run
  interpreted: argument dtypes and 16-byte alignment, integer and float values (Triton
  specializes integers on 1, on divisibility by 16 and on their width), constexprs, ``num_warps``
  and ``num_stages``. With ``gpu_tiles`` the launch wrappers choose their tiles as on a GPU
  (``availability.interpreting`` reads False in the kernel modules), so what is recorded is what a
  GPU would compile; the interpreter still runs the launches.
- ``compile_launches``, in a process where the kernels are ``JITFunction``s (no
  TRITON_INTERPRET), hands each recorded launch to ``JITFunction.warmup`` through
  ``CompileOnlyDriver``, a Triton driver that targets the given architecture and launches
  nothing: Triton compiles down to the cubin (its bundled ptxas included). Each kernel's shared
  memory is checked against the architecture's limit per block, which Triton checks only when a
  kernel is loaded on a device; its registers and local memory (spills) are read from the cubin
  with Triton's bundled cuobjdump and reported.

    python -m tests.support.native_compile RECORDS.json --arch 90 80

prints one line per kernel and each failure, and exits 1 if any launch fails to compile.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

KERNEL_PACKAGE = "mindspec.backends.cuda."
# Shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), by compute capability.
MAX_SHARED_BYTES = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def _canonical_int(value: int) -> int:
    """An integer with the properties Triton specializes a non-constexpr integer on (equal to 1,
    divisible by 16, 32 or 64 bits wide), so launches that differ only in sizes compile once."""
    if value == 1:
        return 1
    base = 16 if -2**31 <= value < 2**31 else 2**40 if value < 2**63 else 2**63
    return base if value % 16 == 0 else base + 1


def _arg_spec(value, constexpr: bool = True):
    if isinstance(value, int) and not isinstance(value, bool) and not constexpr:
        return _canonical_int(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record a kernel argument of type {type(value).__name__}")


class LaunchRecorder:
    """Every distinct kernel launch seen while installed, as JSON-able records."""

    def __init__(self):
        self.launches: dict[str, dict] = {}  # canonical JSON -> record

    def kernels(self) -> set[str]:
        return {r["kernel"] for r in self.launches.values()}

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(list(self.launches.values())))
        return path

    def _record(self, fn, args, kwargs) -> None:
        params = list(inspect.signature(fn).parameters)
        constexprs = {name for name, note in inspect.get_annotations(fn).items() if "constexpr" in str(note)}
        record = {"module": fn.__module__, "kernel": fn.__name__,
                  "args": [_arg_spec(a, name in constexprs) for name, a in zip(params, args)],
                  "kwargs": {k: _arg_spec(v, k in constexprs or k not in params) for k, v in sorted(kwargs.items())}}
        self.launches.setdefault(json.dumps(record, sort_keys=True), record)

    @contextmanager
    def installed(self, monkeypatch, gpu_tiles: bool = True) -> Iterator["LaunchRecorder"]:
        import triton.runtime.interpreter as interpreter

        from mindspec.backends.cuda import availability

        recorder, run = self, interpreter.InterpretedFunction.run

        def recorded_run(kernel, *args, grid, warmup, **kwargs):
            recorder._record(kernel.fn, args, kwargs)
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(interpreter.InterpretedFunction, "run", recorded_run)
        if gpu_tiles:
            for info in pkgutil.iter_modules(importlib.import_module(KERNEL_PACKAGE.rstrip(".")).__path__):
                importlib.import_module(KERNEL_PACKAGE + info.name)  # each kernel module, before patching it
            for name, module in list(sys.modules.items()):
                if (name.startswith(KERNEL_PACKAGE) and module is not availability
                        and getattr(module, "interpreting", None) is availability.interpreting):
                    monkeypatch.setattr(module, "interpreting", lambda: False)
        yield self


class CompileOnlyDriver:
    """The part of a Triton driver that ``JITFunction.run(warmup=True)`` uses: a device, a
    stream and the target architecture. Nothing is launched or loaded."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


class _Pointer:
    """What the JIT reads of a tensor argument to specialize on it: its dtype and address."""

    def __init__(self, dtype: str, aligned: bool):
        self.dtype = getattr(torch, dtype)
        self._address = (1 << 20) + (0 if aligned else 2)

    def data_ptr(self) -> int:
        return self._address


def _argument(spec):
    return _Pointer(spec["tensor"], spec["aligned"]) if isinstance(spec, dict) else spec


def resource_usage(cubin: bytes) -> dict[str, int]:
    """{"REG": registers per thread, "LOCAL": bytes of local memory per thread (spills), ...} of a
    one-kernel cubin, by Triton's bundled cuobjdump; {} without it."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def compile_launches(launches: list[dict], arch: int) -> tuple[dict[str, dict], list[str]]:
    """-> ({kernel: the most shared memory, registers and local memory any of its launches
    needs}, failures), compiling every launch for compute capability ``arch``. Run where
    TRITON_INTERPRET is unset."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(CompileOnlyDriver(arch))  # for the rest of this process: it has no GPU to go back to
    usage: dict[str, dict] = {}
    failures: list[str] = []
    retargeted = set()
    for r in launches:
        fn = getattr(importlib.import_module(r["module"]), r["kernel"])
        if not isinstance(fn, JITFunction):
            raise RuntimeError(f"{r['kernel']} is not a JITFunction here: run without TRITON_INTERPRET")
        if id(fn) not in retargeted:  # its binder and compiled kernels were made for another target
            fn.device_caches.clear()
            retargeted.add(id(fn))
        name = f"{r['module'].removeprefix(KERNEL_PACKAGE)}.{r['kernel']}"
        try:
            kernel = fn.warmup(*map(_argument, r["args"]), grid=(1,),
                               **{k: _argument(v) for k, v in r["kwargs"].items()})
        except Exception as exc:  # noqa: BLE001 - every compiler error is a finding
            failures.append(f"sm_{arch} {name} {r['kwargs']}: {type(exc).__name__}: {str(exc)[-1500:]}")
            continue
        seen = usage.setdefault(name, {"shared": 0, "registers": 0, "local": 0})
        found = resource_usage(kernel.asm["cubin"])
        for key, value in (("shared", kernel.metadata.shared), ("registers", found.get("REG", 0)),
                           ("local", found.get("LOCAL", 0))):
            seen[key] = max(seen[key], value)
        limit = MAX_SHARED_BYTES.get(arch)
        if limit is not None and kernel.metadata.shared > limit:
            failures.append(f"sm_{arch} {name} {r['kwargs']}: needs {kernel.metadata.shared} bytes of shared "
                            f"memory, the block limit is {limit}")
    return usage, failures


def main() -> int:
    ap = argparse.ArgumentParser(description="compile recorded Triton launches for GPU architectures")
    ap.add_argument("records", type=Path)
    ap.add_argument("--arch", type=int, nargs="+", default=[90])
    args = ap.parse_args()
    launches = json.loads(args.records.read_text())
    failed = False
    for arch in args.arch:
        usage, failures = compile_launches(launches, arch)
        for name, u in sorted(usage.items()):
            spills = f", SPILLS {u['local']} bytes of local memory per thread" if u["local"] else ""
            print(f"sm_{arch} ok {name}: shared {u['shared']} bytes, {u['registers']} registers{spills}")
        for f in failures:
            print(f"FAILED {f}")
        failed |= bool(failures)
        print(f"sm_{arch}: {len(launches) - len(failures)} of {len(launches)} launches compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
