"""A compiled AOTInductor package run without holding Python's GIL.

``torch._inductor.aoti_load_package`` returns a runner whose ``__call__`` keeps the GIL for the
whole run (measured: a Python thread spinning beside it advanced 1-2 % of its free rate), so with
async scheduling the host thread cannot build the next step while the package computes this one.
This runner calls the package's model library through its C ABI
(``torch/csrc/inductor/aoti_runtime/interface.h``: ``AOTInductorModelContainerCreateWithDevice``,
``...Run``) with ctypes, which releases the GIL for the duration of a foreign call. Inputs and
outputs cross as ``AtenTensorHandle`` pointers made and taken by torch's own helpers
(``torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors``, ``alloc_tensors_by_stealing_from_void_ptrs``),
the same the loader uses.

Only packages whose constants are inside the model library (AOTInductor's default on CPU) and
that need no proxy executor (no extern fallback kernels) qualify; ``open_released`` returns None
for anything else, and the caller keeps torch's loader.
"""
from __future__ import annotations

import ctypes
import logging
import os
import zipfile
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class ReleasedRunner:
    """Calls a model library's container; ``runner(*tensors)`` -> list of output tensors."""

    def __init__(self, library: Path, device: str = "cpu"):
        self.library = library
        self._lib = ctypes.CDLL(str(library))  # CDLL: the GIL is released during each call
        self._lib.AOTInductorModelContainerRun.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
        ]
        self._handle = ctypes.c_void_p()
        _check(self._lib.AOTInductorModelContainerCreateWithDevice(
            ctypes.byref(self._handle), ctypes.c_size_t(1), device.encode(), None), "create the model container")
        self.num_inputs = self._count("AOTInductorModelContainerGetNumInputs")
        self.num_outputs = self._count("AOTInductorModelContainerGetNumOutputs")

    def _count(self, fn: str) -> int:
        n = ctypes.c_size_t()
        _check(getattr(self._lib, fn)(self._handle, ctypes.byref(n)), fn)
        return n.value

    def __call__(self, *tensors: torch.Tensor, before_run: Optional[Callable[[], None]] = None) -> list[torch.Tensor]:
        """``before_run``: called right before the foreign call (which releases the GIL)."""
        if len(tensors) != self.num_inputs:
            raise ValueError(f"{self.library.name} takes {self.num_inputs} tensors, got {len(tensors)}")
        # Each handle is a new reference to a tensor; the container steals (frees) them.
        capsules = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(tensors))
        # A tensor's C++ reference count going 2 -> 1 (the container freeing its handle while the
        # Python object holds the other) releases the Python object, which takes the GIL in the
        # middle of the run: a second reference per input, dropped after the run, avoids that.
        held = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(tensors))
        inputs = (ctypes.c_void_p * len(capsules))(*[_api.PyCapsule_GetPointer(c, None) for c in capsules])
        outputs = (ctypes.c_void_p * self.num_outputs)()
        if before_run is not None:
            before_run()
        try:
            _check(self._lib.AOTInductorModelContainerRun(
                self._handle, inputs, len(capsules), outputs, self.num_outputs, None, None), "run the model")
        finally:
            torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(held)  # dropped at once
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_api.PyCapsule_New(outputs[i], None, None) for i in range(self.num_outputs)])

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.AOTInductorModelContainerDelete(handle)
            self._handle = None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"AOTInductor could not {what} (error {code})")


def open_released(package: Path) -> Optional[ReleasedRunner]:
    """The package's model library, extracted once beside it (``<package>.so``), as a runner
    that releases the GIL; None where the package is not that simple (see the module docstring)."""
    try:
        with zipfile.ZipFile(package) as archive:
            names = archive.namelist()
            libraries = [n for n in names if n.endswith(".so")]
            extern_kernels = any(n.endswith(".json") and not n.endswith("_metadata.json") for n in names)
            separate_weights = any("/weights/" in n or n.endswith((".bin", ".pt")) for n in names)
            if len(libraries) != 1 or extern_kernels or separate_weights:
                return None
            library = package.with_suffix(".so")
            if not library.is_file() or library.stat().st_mtime < package.stat().st_mtime:
                tmp = library.with_name(f".{library.name}.{os.getpid()}.tmp")
                tmp.write_bytes(archive.read(libraries[0]))
                os.replace(tmp, library)
        return ReleasedRunner(library)
    except (OSError, zipfile.BadZipFile, RuntimeError, AttributeError) as exc:
        log.info("the compiled step %s runs through torch's loader (%s)", package.name, exc)
        return None
