"""cuda-backend kernel tests: natively on a CUDA device when one is visible, otherwise on CPU
tensors under Triton's interpreter (how CI runs them).

Triton decides interpreter mode when ``@triton.jit`` is applied, so TRITON_INTERPRET is set here,
before any test module imports a kernel module.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_support import DEVICES, ON_GPU  # noqa: E402

if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="the cuda backend's kernels need triton (pip install -e '.[test]')")


@pytest.fixture(params=DEVICES, scope="session")
def device(request):
    return request.param


@pytest.fixture(scope="session")
def cuda_backend(device):
    from mindspec.backends.cuda import CudaBackend

    return CudaBackend(device)


@pytest.fixture(scope="session")
def cpu_backend():
    from mindspec.backends.cpu import CpuBackend

    return CpuBackend()
